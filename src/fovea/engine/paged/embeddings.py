"""A sequence's prompt input embeddings: token embeddings with its images' rows scattered in.

Computed once when the sequence is admitted (images through the encoder cache, new ones
encoded together in bounded batches) and kept until its prefill completes, so every
chunk of a chunked prefill reads the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.paged.llama import PagedLlama
from fovea.engine.paged.sequence import Sequence
from fovea.model.loader import LoadedModel
from fovea.model.prompt import PlaceholderMismatch
from fovea.model.vision import encode_images


class PromptEmbedder:
    def __init__(self, loaded: LoadedModel, llama: PagedLlama, encoder_cache: EncoderCache,
                 vision_batch_size: int, on_vision_seconds: Callable[[float], None] | None = None) -> None:
        self.loaded = loaded
        self.llama = llama
        self.encoder_cache = encoder_cache
        self.vision_batch_size = vision_batch_size
        self.on_vision_seconds = on_vision_seconds

    def image_rows(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        todo: dict[str, torch.Tensor] = {}
        for seq in seqs:
            prompt = seq.request.prompt
            for index, key in enumerate(prompt.image_hashes):
                if key in found or key in todo:
                    continue
                cached = self.encoder_cache.get(key)
                if cached is not None:
                    found[key] = cached
                else:
                    todo[key] = prompt.pixel_values[index]
        keys = list(todo)
        for lo in range(0, len(keys), self.vision_batch_size):
            batch = keys[lo:lo + self.vision_batch_size]
            started = time.perf_counter()
            encoded = encode_images(self.loaded, torch.stack([todo[k] for k in batch]))
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
            if self.on_vision_seconds:
                self.on_vision_seconds(time.perf_counter() - started)
            for key, rows in zip(batch, encoded):
                self.encoder_cache.put(key, rows)
                found[key] = rows
        return found

    def fill(self, seqs: list[Sequence]) -> None:
        """Set ``prompt_embeds`` ([prompt_len, hidden]) of each sequence."""
        images = self.image_rows(seqs)
        device = self.llama.device
        for seq in seqs:
            ids = torch.tensor(seq.token_ids[:seq.prompt_len], device=device)
            embeds = self.llama.embed_ids(ids)
            positions = (ids == self.loaded.image_token_id).nonzero().squeeze(1)
            rows = [images[key] for key in seq.request.prompt.image_hashes]
            supplied = sum(r.shape[0] for r in rows)
            if supplied != positions.numel():
                raise PlaceholderMismatch(
                    f"request {seq.request.request_id}: {positions.numel()} image-token positions but "
                    f"{supplied} image embedding rows", status=500)
            if rows:
                embeds[positions] = torch.cat(rows).to(embeds.dtype)
            seq.prompt_embeds = embeds
