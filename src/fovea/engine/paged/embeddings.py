"""A sequence's prompt input embeddings: token embeddings with its images' rows scattered in.

Computed once when the sequence is admitted (images through the encoder cache, new ones
encoded together in bounded batches) and kept until its prefill completes, so every
chunk of a chunked prefill reads the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.image_encoder import ImageEncoder, scatter_image_rows
from fovea.engine.paged.llama import PagedLlama
from fovea.engine.paged.sequence import Sequence
from fovea.model.loader import LoadedModel


class PromptEmbedder:
    def __init__(self, loaded: LoadedModel, llama: PagedLlama, encoder_cache: EncoderCache,
                 vision_batch_size: int, on_vision_seconds: Callable[[float], None] | None = None) -> None:
        self.loaded = loaded
        self.llama = llama
        self.images = ImageEncoder(loaded, encoder_cache, vision_batch_size, on_vision_seconds)

    def image_rows(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        return self.images.rows_for(seq.request.prompt for seq in seqs)

    def fill(self, seqs: list[Sequence]) -> None:
        """Set ``prompt_embeds`` ([prompt_len, hidden]) of each sequence."""
        images = self.image_rows(seqs)
        device = self.llama.device
        for seq in seqs:
            ids = torch.tensor(seq.token_ids[:seq.prompt_len], device=device)
            embeds = self.llama.embed_ids(ids)
            rows = [images[key] for key in seq.request.prompt.image_hashes]
            scatter_image_rows(embeds, ids, rows, self.loaded.image_token_id, seq.request.request_id)
            seq.prompt_embeds = embeds
