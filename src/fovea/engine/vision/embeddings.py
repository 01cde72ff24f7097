"""A sequence's prompt input embeddings: token embeddings with its images' rows scattered in.

Computed once when the sequence is admitted (images through the encoder cache, new ones
encoded together in bounded batches) and kept until its prefill completes, so every
chunk of a chunked prefill reads the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fovea.engine.core.sequence import Sequence
from fovea.engine.model.llama import PagedLlama
from fovea.engine.transfer import to_device
from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.engine.vision.image_encoder import ImageEncoder, check_image_row_count
from fovea.loading.loader import LoadedModel


class PromptEmbedder:
    def __init__(self, loaded: LoadedModel, llama: PagedLlama, encoder_cache: EncoderCache,
                 vision_batch_size: int, on_vision_seconds: Callable[[float], None] | None = None,
                 max_batch_tokens: int | None = None, remote=None) -> None:
        self.loaded = loaded
        self.llama = llama
        # remote: an encoder pool (fovea.disagg): the vision stage runs in its workers.
        self.images = ImageEncoder(loaded, encoder_cache, vision_batch_size, on_vision_seconds,
                                   encode=remote.encode if remote is not None else None,
                                   max_batch_tokens=max_batch_tokens, remote=remote is not None,
                                   submit=remote.submit if remote is not None else None)

    def image_rows(self, seqs: list[Sequence], errors: dict[str, BaseException] | None = None
                   ) -> dict[str, torch.Tensor]:
        return self.images.rows_for((seq.request.prompt for seq in seqs), errors)

    def fill(self, seqs: list[Sequence]) -> list[tuple[Sequence, BaseException]]:
        """Set ``prompt_embeds`` ([prompt_len, hidden], or [prompt_len, (1 + levels) * hidden] with
        DeepStack features, for a prompt with images of a DeepStack model) of each sequence; return the sequences
        whose images a remote encoder could not deliver, with why (they get no embeddings).

        The image-token positions come from the host's copy of the prompt, so nothing here
        waits for the GPU (a step may be running): the ids and positions cross in one
        asynchronous copy and the rows are scattered on the device.
        """
        errors: dict[str, BaseException] = {}
        images = self.image_rows(seqs, errors)
        device = self.llama.device
        failed = []
        for seq in seqs:
            missing = [errors[key] for key in seq.request.prompt.image_hashes if key in errors]
            if missing:
                failed.append((seq, missing[0]))
                continue
            positions = [i for i, image in enumerate(seq.image_of_pos) if image >= 0]
            rows = [images[key] for key in seq.request.prompt.image_hashes]
            check_image_row_count(len(positions), rows, seq.request.request_id)
            ids, where = to_device(device, [(seq.token_ids[:seq.prompt_len], torch.long), (positions, torch.long)])
            embeds = self.llama.embed_ids(ids)
            if rows:
                flat = torch.cat(rows).to(embeds.dtype)
                if flat.shape[1] != embeds.shape[1]:
                    # DeepStack rows: the embedding, then the feature levels; text positions get
                    # zero features (the runner adds features at image positions only).
                    wide = embeds.new_zeros((embeds.shape[0], flat.shape[1]))
                    wide[:, :embeds.shape[1]] = embeds
                    embeds = wide
                embeds[where] = flat
            seq.prompt_embeds = embeds
        return failed
