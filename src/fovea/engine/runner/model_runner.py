"""Turns a step plan into one forward over the paged cache and returns the logits to sample.

Also owns start-up: picking the decode kernel, sizing the KV cache (profiling a max-size
step on CUDA) and capturing decode CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from fovea.engine.config import PagedEngineConfig
from fovea.engine.core.scheduler import Chunk, StepPlan
from fovea.engine.core.sequence import Sequence
from fovea.engine.kernels import triton_util
from fovea.engine.memory.planner import Planner
from fovea.engine.model.attention import (
    AttnMeta,
    PrefillBatch,
    PrefillSpan,
    attention_backend,
)
from fovea.engine.model.kv_cache import KVCache, KVPlan
from fovea.engine.model.llama import PagedLlama
from fovea.engine.model.quant_linear import fp8_producers_problem, quantized_kernels_problem
from fovea.engine.runner.cuda_graphs import DecodeBatch, GraphedDecode, capture_sizes
from fovea.engine.runner.kernel_selfcheck import self_check
from fovea.engine.runner.staging import resolve_pending
from fovea.engine.sampling.prompt_scores import PromptScores, score_step
from fovea.engine.transfer import to_device
from fovea.engine.vision.embeddings import PromptEmbedder
from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.engine.vision.vision_graphs import try_graphed_vision
from fovea.engine.vision.vision_stage import choose_vision_stage
from fovea.loading.loader import LoadedModel
from fovea.startup_clock import STARTUP

log = logging.getLogger("fovea.engine.paged")


def decode_forward(llama: PagedLlama, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """A decode-only step on device tensors (what a CUDA graph captures): logits of every row."""
    meta = AttnMeta(slot_mapping=slots, num_decodes=ids.shape[0], block_tables=block_tables,
                    context_lens=context_lens)
    return llama.forward(llama.embed_ids(ids), positions, meta, cache)


def chunk_positions(seq: Sequence, start: int, end: int) -> list[list[int]]:
    """The three M-RoPE position rows of tokens [start, end) of ``seq``: the prompt's own rows,
    then (tokens generated and recomputed after a preemption) index + delta on every row."""
    delta = seq.position_delta
    if seq.mrope is None:
        flat = list(range(start + delta, end + delta))
        return [flat, flat, flat]
    inside = max(start, min(end, seq.prompt_len))
    tail = list(range(inside + delta, end + delta))
    return [row[start:inside] + tail for row in seq.mrope]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: PagedEngineConfig, encoder_cache: EncoderCache,
                 on_vision_seconds: Callable[[float], None] | None = None,
                 remote_encoder=None) -> None:
        self.loaded = loaded
        self.config = config
        self.device = loaded.device
        self.block_size = config.block_size
        use_triton = bool(config.triton_decode) and triton_util.available()
        if use_triton:
            with STARTUP.phase("kernel self-check"):
                problem = self_check(self.device, loaded.dtype)
            if problem:
                log.warning("Triton kernels disabled, using the torch path: %s", problem)
                use_triton = False
        elif config.triton_decode:
            log.warning("triton is not importable: paged decode uses the torch path")
        self.use_triton = use_triton
        self.attention = attention_backend("triton" if use_triton else "torch")
        fused = use_triton and config.fused_kernels is not False
        self.llama = PagedLlama(loaded.adapter.lm_spec(loaded.model), config.max_model_len, self.attention,
                                fused=fused)
        log.info("paged engine: %s decode attention, %s forward", "Triton" if use_triton else "torch",
                 "fused (Triton kernels)" if fused else "torch-op")
        if fused and loaded.quantization is not None:
            with STARTUP.phase("kernel self-check"):
                problem = quantized_kernels_problem(self.llama.layers, loaded.dtype, self.device)
            if problem:
                log.warning("%s kernels disabled, its layers dequantised per call (slow): %s",
                            loaded.quantization.label, problem)
                self.llama.quant_kernels = False
                self.llama.int4_scratch = None  # the torch path dequantises per call: no shared buffer
            elif self.llama.fp8_producers:
                with STARTUP.phase("kernel self-check"):
                    problem = fp8_producers_problem(self.llama.layers, loaded.dtype, self.device, self.llama.eps)
                if problem:
                    log.warning("FP8 activations quantised by their own launches (the producers' quantisation "
                                "failed its check): %s", problem)
                    self.llama.fp8_producers = False
        # Dynamic-resolution towers are batched by tokens too: their activation peak grows with
        # the patches of a call, not its image count.
        self.fixed_image_shape = loaded.adapter.fixed_image_shape(loaded.model.config)
        self.embedder = PromptEmbedder(loaded, self.llama, encoder_cache, config.vision_batch_size,
                                       on_vision_seconds,
                                       max_batch_tokens=None if self.fixed_image_shape else config.max_num_batched_tokens,
                                       remote=remote_encoder)
        # Prompt tokens whose input embeddings may be held at once (Scheduler.max_prefill_tokens):
        # a full step of prefill plus one longest prompt started in an earlier step.
        self.max_prefill_tokens = config.max_num_batched_tokens + config.max_model_len
        # The vision stage: fused kernels where they pass their start-up check (chosen before
        # the memory profile, so the profile measures the path that runs).
        self.vision_batched: Callable[[torch.Tensor], torch.Tensor] | None = None  # fixed-size towers: [n, C, H, W]
        if remote_encoder is not None:
            vision_label = "remote (encode workers; this process runs no vision forward)"
        else:
            with STARTUP.phase("vision stage check"):
                stage = choose_vision_stage(loaded, enabled=fused and bool(config.fused_vision))
            self.embedder.images.encode, vision_label, self.vision_batched = stage
        self.vision_label = vision_label
        log.info("vision stage: %s", vision_label)
        shape = self.llama.kv_shape(self.block_size)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.graphs: GraphedDecode | None = None
        self.decode_graphs_enabled = bool(config.cuda_graphs) and use_triton
        if config.cuda_graphs and not use_triton:
            log.warning("CUDA graphs need the Triton decode kernel; decoding eagerly")
        planner = Planner(self, shape)
        with STARTUP.phase("memory profile"):
            self.memory_plan = planner.plan()
        log.info("%s", self.memory_plan.render())
        self.kv_plan = KVPlan(self.memory_plan.kv_blocks, self.block_size, shape.bytes_per_block,
                              self.memory_plan.line("kv_cache").how)
        self.cache = KVCache(shape, self.kv_plan.num_blocks, self.device)
        if self.decode_graphs_enabled:
            with STARTUP.phase("decode graphs"):
                self.graphs = self.build_graphs()
                self.graphs.capture()
        planner.enforce(self.memory_plan)

    def build_graphs(self, cls: type[GraphedDecode] = GraphedDecode, cache: KVCache | None = None) -> GraphedDecode:
        # The graphs get a partial over (llama, cache), not a bound method: a cycle back to
        # this runner would keep the KV cache alive after the engine is dropped until the
        # garbage collector happens to run.
        cache = cache if cache is not None else self.cache
        return cls(functools.partial(decode_forward, self.llama, cache),
                   capture_sizes(self.config.max_num_seqs, self.config.max_graph_batch),
                   self.max_blocks_per_seq, cache.scratch_slot, cache.scratch_block, self.device)

    def capture_vision_graphs(self) -> None:
        """Graphs of the vision stage for batches up to vision_batch_size (CUDA, fixed image size)."""
        if self.config.cuda_graphs and self.fixed_image_shape and self.vision_batched is not None:
            self.embedder.images.graphs = try_graphed_vision(self.loaded, self.config.vision_batch_size,
                                                             encode=self.vision_batched)

    # ---- start-up profile -------------------------------------------------------------
    def _dummy_spans(self, total: int | None = None) -> list[tuple[int, int]]:
        """(offset, length) of the prefill chunks of a step of ``total`` tokens (default:
        max_num_batched_tokens) in chunks of at most max_model_len (one sequence cannot be longer)."""
        total = total or self.config.max_num_batched_tokens
        longest = self.config.max_model_len
        return [(lo, min(longest, total - lo)) for lo in range(0, total, longest)]

    def scratch_blocks(self) -> int:
        """Blocks a scratch cache needs for ``dummy_step``."""
        return -(-self.config.max_num_batched_tokens // self.block_size) + len(self._dummy_spans())

    @torch.inference_mode()
    def dummy_step(self, cache: KVCache, tokens: int | None = None, rows: int | None = None) -> torch.Tensor:
        """A step the scheduler can form, on random inputs: prefill chunks of ``tokens`` tokens
        (default max_num_batched_tokens) with logits for ``rows`` rows (default max_num_seqs,
        the most a step samples). Returns the float32 logits, as ``execute`` does."""
        cfg, device, bs = self.config, self.device, self.block_size
        spans, tables, slots, positions, next_block = [], [], [], [], 0
        for offset, length in self._dummy_spans(tokens):
            blocks = list(range(next_block, next_block + -(-length // bs)))
            next_block += len(blocks)
            spans.append(PrefillSpan(offset, length, 0, torch.tensor(blocks, device=device)))
            tables.append(blocks)
            slots.extend(range(blocks[0] * bs, blocks[0] * bs + length))
            positions.extend(range(length))
        n = len(slots)
        hidden = torch.randn((n, self.llama.embed.shape[1]), dtype=self.llama.dtype, device=device)
        meta = AttnMeta(slot_mapping=torch.tensor(slots, device=device), prefills=spans)
        if self.attention.batched_prefill:
            meta.prefill_batch = PrefillBatch.build(spans, tables, device)
        rows = min(n, cfg.max_num_seqs if rows is None else rows)
        logit_rows = torch.arange(n - rows, n, device=device)
        return self.llama.forward(hidden, torch.tensor(positions, device=device), meta, cache, logit_rows).float()

    @torch.inference_mode()
    def dummy_vision_batch(self) -> torch.Tensor | None:
        """One full vision batch through the path serving uses (graphs where captured)."""
        images = self.embedder.images
        if images.remote:
            return None  # the encode workers hold the vision activations, not this process
        if self.fixed_image_shape is None:
            # The largest images the processor produces that a prompt can hold, as many as one
            # vision call takes.
            adapter, model_config, codec = self.loaded.adapter, self.loaded.model.config, self.loaded.codec
            limit = self.config.max_model_len - 1
            one = adapter.dummy_images(model_config, codec, 1, max_tokens=limit, device=self.device)[0]
            # Only the images of the first vision call (one image of this size may fill it), made
            # on the device: at the largest size each is ~75 M random values (2.5 s on the host).
            count = min(self.config.vision_batch_size, len(images.batches([one] * self.config.vision_batch_size)[0]))
            batch = [one] if count == 1 else adapter.dummy_images(model_config, codec, count, max_tokens=limit,
                                                                             device=self.device)
            return torch.cat(images.run(images.to_device(batch)))
        pixels = torch.randn((self.config.vision_batch_size, *self.fixed_image_shape),
                             dtype=self.loaded.dtype, device=self.device)
        if images.graphs is not None and images.graphs.can_run(pixels):
            return images.graphs(pixels)
        return self.vision_batched(pixels)

    # ---- steps ------------------------------------------------------------------------
    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs, out = self.block_size, []
        pos = start
        while pos < end:
            block, offset = divmod(pos, bs)
            stop = min(end, (block + 1) * bs)
            base = table[block] * bs
            out.extend(range(base + offset, base + offset + (stop - pos)))
            pos = stop
        return out

    def _decode_batch(self, chunks: list[Chunk]) -> DecodeBatch:
        bs = self.block_size
        width = max(c.start // bs + 1 for c in chunks)
        tables = []
        for c in chunks:
            row = c.seq.block_table[:width]
            tables.append(row + [row[0]] * (width - len(row)))  # padding is never read
        return DecodeBatch([c.seq.token_ids[c.start] for c in chunks], [c.start + c.seq.position_delta for c in chunks],
                           [c.seq.block_table[c.start // bs] * bs + c.start % bs for c in chunks],
                           tables, [c.start + 1 for c in chunks])

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step; logits [sampling chunks, vocab] float32, in plan order. A decode's
        input token may still be on the device (``staging.pending_token``): it is read from
        ``previous``, the last step's sampled tokens, without waiting for them. A prefill chunk
        of a sequence that scores its prompt has its rows scored and handed to it
        (``prompt_scores.score_step``)."""
        device = self.device
        decodes, prefills = plan.chunks[:plan.num_decodes], plan.chunks[plan.num_decodes:]
        batch = self._decode_batch(decodes) if decodes else None
        if batch is not None and not prefills and self.graphs is not None and self.graphs.can_run(len(batch)):
            return self.graphs.run(batch, previous)
        ids = list(batch.token_ids) if batch else []
        positions = list(batch.positions) if batch else []
        mrope = any(c.seq.mrope is not None and c.start < c.seq.prompt_len for c in prefills)
        rows3: list[list[int]] = [list(positions), list(positions), list(positions)] if mrope else []
        slots = list(batch.slots) if batch else []
        rows = list(range(len(ids)))
        spans: list[PrefillSpan] = []
        tables: list[list[int]] = []
        overrides: list[tuple[int, torch.Tensor]] = []
        hidden_width = self.llama.embed.shape[1]
        deep_rows: list[int] = []  # batch rows of image tokens in this step's prefill chunks (DeepStack)
        deep_parts: list[torch.Tensor] = []
        scored: list[tuple[PromptScores, int, int]] = []  # (a sequence's scores, first row position, rows)
        score_rows: list[int] = []  # batch rows whose final hidden states are scored, in ``scored`` order
        score_targets: list[int] = []  # the prompt token each of them predicts
        for c in prefills:
            seq, offset = c.seq, len(ids)
            if seq.scores is not None:
                lo, hi = seq.scores.wanted(c.start, c.end)
                if hi > lo:
                    score_rows.extend(range(offset + lo - c.start, offset + hi - c.start))
                    score_targets.extend(seq.token_ids[lo + 1:hi + 1])
                    scored.append((seq.scores, lo, hi - lo))
            ids.extend(seq.token_ids[c.start:c.end])
            if mrope:
                for row, out in zip(chunk_positions(seq, c.start, c.end), rows3):
                    out.extend(row)
            else:
                positions.extend(range(c.start + seq.position_delta, c.end + seq.position_delta))
            slots.extend(self._slots(seq.block_table, c.start, c.end))
            used = -(-c.end // self.block_size)
            tables.append(seq.block_table[:used])
            # The per-span block ids feed the torch path only; the Triton kernel reads ``tables``.
            block_ids = None if self.attention.batched_prefill else torch.tensor(
                seq.block_table[:used], dtype=torch.long, device=device)
            spans.append(PrefillSpan(offset, c.length, c.start, block_ids))
            if c.start < seq.prompt_len:
                assert seq.prompt_embeds is not None, "prompt embeddings are filled at admission"
                embeds = seq.prompt_embeds[c.start:min(c.end, seq.prompt_len)]
                if embeds.shape[1] != hidden_width:  # DeepStack features of this chunk's prompt rows
                    if any(image >= 0 for image in seq.image_of_pos[c.start:c.start + embeds.shape[0]]):
                        # The whole slice (its text rows' features are zeros, and x + 0 == x): no
                        # device-side gather from a host index list, which would wait for the GPU.
                        deep_rows.extend(range(offset, offset + embeds.shape[0]))
                        deep_parts.append(embeds[:, hidden_width:])
                    embeds = embeds[:, :hidden_width]
                overrides.append((offset, embeds))
            if c.sample:
                rows.append(offset + c.length - 1)
        if mrope:
            positions = rows3[0] + rows3[1] + rows3[2]  # staged flat, viewed [3, T] on the device
        arrays: list[tuple[list, torch.dtype]] = [(ids, torch.long), (positions, torch.long), (slots, torch.long),
                                                  (rows, torch.long), (deep_rows, torch.long)]
        if batch is not None:
            arrays += [(batch.block_tables, torch.int32), (batch.context_lens, torch.int32)]
        use_prefill_kernel = bool(spans) and self.attention.batched_prefill
        if use_prefill_kernel:
            arrays += PrefillBatch.arrays(spans, tables)
        if scored:
            arrays += [(score_rows, torch.long), (score_targets, torch.long)]
        staged = to_device(device, arrays)
        if scored:
            *staged, score_t, target_t = staged
        ids_t, pos_t, slots_t, rows_t, deep_t = staged[:5]
        if mrope:
            pos_t = pos_t.view(3, -1)
        hidden = self.llama.embed_ids(resolve_pending(ids_t, previous))
        for offset, embeds in overrides:
            hidden[offset:offset + embeds.shape[0]] = embeds
        meta = AttnMeta(slot_mapping=slots_t, num_decodes=len(decodes), prefills=spans)
        rest = staged[5:]
        if batch is not None:
            meta.block_tables, meta.context_lens = rest[0], rest[1]
            rest = rest[2:]
        if use_prefill_kernel:
            meta.prefill_batch = PrefillBatch.from_tensors(spans, *rest)
        logit_rows = None if len(rows) == len(ids) else rows_t
        deepstack = None
        if deep_rows:
            levels = self.llama.deepstack_layers
            deepstack = (deep_t, torch.cat(deep_parts).view(len(deep_rows), levels, hidden_width))
        if not scored:
            return self.llama.forward(hidden, pos_t, meta, self.cache, logit_rows, deepstack).float()
        logits, normed = self.llama.forward(hidden, pos_t, meta, self.cache, logit_rows, deepstack, score_t)
        logits = logits.float()
        # Logits of at most max_num_seqs rows at once, the step's sampled rows included: what the
        # memory profile's step holds.
        score_step(self.llama.lm_logits, normed, target_t, scored, max(1, self.config.max_num_seqs - len(rows)))
        return logits
