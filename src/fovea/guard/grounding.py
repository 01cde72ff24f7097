"""Per-request grounding score: how much the answer's first tokens depend on the image.

The answer is scored twice, teacher-forced: once with the request's images and once with
every image replaced by a blank canvas of the same size. The KL divergence between the two
next-token distributions at each of the first answer tokens says how much the image moved
the answer; ``image_dependent`` compares the largest of them with the canary's calibrated
threshold. (The first token alone is not enough: a description that always starts with
"a" depends on the image only from its second word on.)
"""

from __future__ import annotations

import threading

import torch

from fovea.engine.image_encoder import ImageEncoder, check_image_row_count, token_embeddings
from fovea.guard.canary import kl_divergence
from fovea.model.loader import LoadedModel
from fovea.models.base import EncodedPrompt, reference_position_ids

SCORED_TOKENS = 8
_ONE_AT_A_TIME = threading.Lock()


@torch.inference_mode()
def answer_logprobs(loaded: LoadedModel, images: ImageEncoder, prompt: EncodedPrompt,
                    answer_ids: list[int]) -> torch.Tensor:
    """[len(answer_ids), vocab] log-probabilities of each answer position, teacher-forced.

    ``images`` is backed by the engine's encoder cache: the request's own images were just
    encoded there, so only the blank twin's are encoded here."""
    ids = torch.tensor(prompt.input_ids + answer_ids, device=loaded.device)
    found = images.rows_for([prompt])
    rows = [found[k] for k in prompt.image_hashes]
    mask = ids == loaded.image_token_id
    check_image_row_count(int(mask.sum()), rows, "grounding")
    embeds = token_embeddings(loaded, ids).unsqueeze(0)
    flat = torch.cat(rows) if rows else embeds.new_zeros((0, embeds.shape[-1]))
    positions = reference_position_ids(prompt, ids.shape[0], loaded.device, loaded.adapter.uses_mrope())
    logits = loaded.adapter.embeds_logits(loaded.model, embeds, mask, flat, positions, len(answer_ids) + 1)
    return torch.log_softmax(logits[0, :-1].float(), dim=-1).cpu()


def answer_dependence(loaded: LoadedModel, images: ImageEncoder, prompt: EncodedPrompt, blank_twin: EncodedPrompt,
                      answer_text: str, threshold: float, scored_tokens: int = SCORED_TOKENS) -> dict:
    ids = loaded.tokenizer(answer_text, add_special_tokens=False)["input_ids"][:scored_tokens]
    if not ids:
        ids = [next(iter(loaded.eos_token_ids))]  # an empty answer: score its end-of-sequence decision
    # One scoring at a time: the memory plan has one line for this forward ("grounding forward").
    with _ONE_AT_A_TIME:
        real = answer_logprobs(loaded, images, prompt, ids)
        blank = answer_logprobs(loaded, images, blank_twin, ids)
    kls = [kl_divergence(real[i], blank[i]) for i in range(len(ids))]
    return {
        "scored_tokens": len(ids),
        "kl_per_token": [round(k, 6) for k in kls],
        "mean_kl": round(sum(kls) / len(kls), 6),
        "max_kl": round(max(kls), 6),
        "threshold": round(threshold, 6),
        "image_dependent": max(kls) > threshold,
    }
