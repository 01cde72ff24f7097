"""Run one batch of requests to completion through the transformers language model.

This is the simple batching path: requests that arrive together are left-padded into one
batch. Their images are encoded first (``model.vision.encode_images``, through the encoder
cache) and scattered into the image-token positions of the prompt embeddings; the batch
is prefilled in one forward and decoded a token at a time with a shared KV cache; finished
rows are dropped from the cache as they finish.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from fovea.engine.detokenize import IncrementalDetokenizer
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.image_encoder import ImageEncoder, scatter_image_rows, token_embeddings
from fovea.engine.request import EngineRequest, FinishEvent, TokenEvent
from fovea.engine.sampling import make_generator, sample_next
from fovea.model.loader import LoadedModel


class HFBatchRunner:
    def __init__(self, loaded: LoadedModel, encoder_cache: EncoderCache | None = None,
                 on_vision_seconds: Callable[[float], None] | None = None) -> None:
        self.loaded = loaded
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache()
        self.images = ImageEncoder(loaded, self.encoder_cache, on_vision_seconds=on_vision_seconds)
        params = inspect.signature(loaded.model.forward).parameters
        # transformers renamed ``past_key_values`` to ``cache`` in later 5.x releases.
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.pad_id = loaded.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = loaded.tokenizer.eos_token_id or 0

    @torch.inference_mode()
    def run(self, requests: list[EngineRequest]) -> None:
        loaded, device = self.loaded, self.loaded.device
        eos = loaded.eos_token_ids
        lengths = [len(r.prompt.input_ids) for r in requests]
        width = max(lengths)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, (req, n) in enumerate(zip(requests, lengths)):
            input_ids[row, width - n:] = torch.tensor(req.prompt.input_ids)
            attention_mask[row, width - n:] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        embeds = self.prompt_embeddings(requests, input_ids)

        cache = DynamicCache()
        logits = self._forward(None, attention_mask, position_ids, cache, embeds)
        for row, req in enumerate(requests):
            if req.want_first_logprobs:
                req.first_logprobs = torch.log_softmax(logits[row], dim=-1).cpu()
        detoks = [IncrementalDetokenizer(loaded.tokenizer, r.params.stop) for r in requests]
        generators = [make_generator(r.params, device) for r in requests]
        produced = [0] * len(requests)
        first_token = [None] * len(requests)
        active = list(range(len(requests)))  # indices into requests, in cache-row order
        last_pos = position_ids[:, -1]
        while True:
            next_tokens: list[int] = []
            keep_rows: list[int] = []
            for row, i in enumerate(active):
                req = requests[i]
                if req.cancelled.is_set():
                    self._finish(req, detoks[i], "cancelled", produced[i], first_token[i])
                    continue
                if req.params.eos_blocked(produced[i]):  # min_tokens: no end-of-sequence yet
                    for t in eos:
                        if 0 <= t < logits.shape[-1]:
                            logits[row, t] = float("-inf")
                token = sample_next(logits[row], req.params, generators[i])
                produced[i] += 1
                if first_token[i] is None:
                    first_token[i] = time.perf_counter() - req.arrival
                if token in eos and req.params.ends_on_eos(produced[i]):
                    self._finish(req, detoks[i], "stop", produced[i], first_token[i])
                    continue
                text = detoks[i].push(token, check_stops=req.params.stops_checked(produced[i]))
                req.emit(TokenEvent(text, token))
                if detoks[i].stopped:
                    self._finish(req, detoks[i], "stop", produced[i], first_token[i])
                elif produced[i] >= req.params.max_tokens:
                    self._finish(req, detoks[i], "length", produced[i], first_token[i])
                else:
                    keep_rows.append(row)
                    next_tokens.append(token)
            if not keep_rows:
                return
            if len(keep_rows) < len(active):
                index = torch.tensor(keep_rows, device=device)
                cache.batch_select_indices(index)
                attention_mask = attention_mask[index]
                last_pos = last_pos[index]
                active = [active[r] for r in keep_rows]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            last_pos = last_pos + 1
            step_ids = torch.tensor(next_tokens, device=device).unsqueeze(1)
            logits = self._forward(step_ids, attention_mask, last_pos.unsqueeze(1), cache, None)

    def image_embeddings(self, requests: list[EngineRequest]) -> dict[str, torch.Tensor]:
        """Embeddings of every image in the batch: cached ones reused, the rest encoded together."""
        return self.images.rows_for(r.prompt for r in requests)

    def prompt_embeddings(self, requests: list[EngineRequest], input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings with each image's rows scattered into its placeholder positions."""
        embeds = token_embeddings(self.loaded, input_ids)
        images = self.image_embeddings(requests)
        for row, req in enumerate(requests):
            rows = [images[key] for key in req.prompt.image_hashes]
            scatter_image_rows(embeds[row], input_ids[row], rows, self.loaded.image_token_id, req.request_id)
        return embeds

    def _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds) -> torch.Tensor:
        out = self.loaded.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: cache},
        )
        return out.logits[:, -1].float()

    def _finish(self, req: EngineRequest, detok: IncrementalDetokenizer, reason: str,
                produced: int, first_token: float | None) -> None:
        tail = detok.flush()
        if tail:
            req.emit(TokenEvent(tail, -1))
        req.emit(FinishEvent(
            finish_reason=reason,
            text=detok.text,
            prompt_tokens=len(req.prompt.input_ids),
            completion_tokens=produced,
            first_token_s=first_token,
            total_s=time.perf_counter() - req.arrival,
            first_logprobs=req.first_logprobs,
        ))
