"""transformers' own forward, kept as the reference that tests and ``fovea doctor`` compare the
engine against (never used to serve).

``reference_generate`` runs ``generate`` on exactly the prompt the engine gets: the same
token ids, the same preprocessed pixels and, for M-RoPE families, the inputs transformers
derives its 3-D positions from (``ModelAdapter.reference_inputs``).
"""

from __future__ import annotations

import torch

from fovea.loading.loader import LoadedModel
from fovea.models.base import EncodedPrompt


@torch.inference_mode()
def reference_generate(loaded: LoadedModel, prompt: EncodedPrompt, max_new_tokens: int, **options) -> list[int]:
    """Greedy tokens from transformers' ``generate``, up to (not including) an end-of-sequence
    token, as the engine reports them; ``options`` go to ``generate`` (``repetition_penalty=...``)."""
    ids = torch.tensor([loaded.adapter.reference_ids(prompt, loaded.image_token_id)], device=loaded.device)
    extra = loaded.adapter.reference_inputs(prompt, loaded.device, loaded.image_token_id)
    out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, **extra, **options)
    tokens = out[0, ids.shape[1]:].tolist()
    ends = [i for i, t in enumerate(tokens) if t in loaded.eos_token_ids]
    return tokens[:ends[0]] if ends else tokens


@torch.inference_mode()
def reference_logits(loaded: LoadedModel, prompt: EncodedPrompt, generated: list[int] | None = None) -> torch.Tensor:
    """[vocab] float32 logits of the next token after the prompt and ``generated``: transformers'
    forward (the first generated token's when ``generated`` is empty)."""
    ids = torch.tensor([loaded.adapter.reference_ids(prompt, loaded.image_token_id) + list(generated or [])],
                       device=loaded.device)
    extra = loaded.adapter.reference_inputs(prompt, loaded.device, loaded.image_token_id)
    out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra)
    return out.logits[0, -1].float()


@torch.inference_mode()
def reference_prompt_logprobs(loaded: LoadedModel, prompt: EncodedPrompt) -> torch.Tensor:
    """[len(prompt), vocab] float32 log-probabilities at every prompt position, teacher-forced:
    ``log_softmax`` of transformers' logits over the prompt and its images (row p predicts token
    p + 1). The reference of the engine's prompt scoring (``PromptScoring``) and grounding."""
    ids = torch.tensor([loaded.adapter.reference_ids(prompt, loaded.image_token_id)], device=loaded.device)
    extra = loaded.adapter.reference_inputs(prompt, loaded.device, loaded.image_token_id)
    out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra)
    return torch.log_softmax(out.logits[0].float(), dim=-1)
