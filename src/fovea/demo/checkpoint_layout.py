"""Write a LLaVA's weights under the llava-hf checkpoint names, which transformers and vLLM both load.

transformers 5.x keeps a LLaVA in memory as ``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*`` and ``lm_head.*``. Its ``save_pretrained`` writes the text half
and the projector back under the original names but drops the CLIP tower's ``vision_model.``
level (``vision_tower.embeddings.*``), a layout that vLLM's ``LlavaForConditionalGeneration``
loader refuses. The layout written here is that of the llava-hf checkpoints
(``llava-hf/llava-1.5-7b-hf``)::

    vision_tower.vision_model.*     the CLIP tower (embeddings, pre_layrnorm, encoder, post_layernorm)
    multi_modal_projector.*         linear_1, linear_2
    language_model.model.*          the Llama decoder (embed_tokens, layers, norm)
    language_model.lm_head.weight   the output projection

transformers 5.x loads it through its conversion mapping for ``llava`` (plus the CLIP tower's
``vision_model`` prefix removal), and vLLM's llava loader maps exactly these names. Only the
names change: every tensor is written as it is, bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"

# (prefix a key may carry, prefix it gets), longest first; the first that matches wins.
_RENAMES: tuple[tuple[str, str], ...] = (
    # transformers 5.x in-memory names (model.state_dict())
    ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    # names already in the llava-hf layout stay as they are
    ("vision_tower.vision_model.", "vision_tower.vision_model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("multi_modal_projector.", "multi_modal_projector."),
    # transformers 5.x save_pretrained names: the CLIP tower without its vision_model level
    ("vision_tower.", "vision_tower.vision_model."),
)

LLAVA_HF_PREFIXES = ("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.",
                     "language_model.lm_head.")


def llava_hf_name(key: str) -> str:
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    raise ValueError(f"{key!r} is not a LLaVA weight name this layout knows")


def to_llava_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under llava-hf names (a name clash is an error, not a silent overwrite)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        name = llava_hf_name(key)
        if name in out:
            raise ValueError(f"two weights map to {name!r}")
        out[name] = tensor
    return out


def write_llava_hf_weights(state_dict: dict[str, torch.Tensor], path: Path) -> Path:
    """Write ``state_dict`` as one safetensors file in the llava-hf layout (metadata ``format: pt``)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_llava_hf(state_dict).items()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)  # an ordinary file's mode, as save_pretrained leaves it
    tmp.replace(path)
    return path


def save_llava_hf_weights(model: torch.nn.Module, out: Path) -> Path:
    """Replace the weights ``save_pretrained`` wrote in ``out`` by the model's in the llava-hf layout."""
    out = Path(out)
    index = out / f"{WEIGHTS}.index.json"
    if index.exists():  # a sharded save: drop its shards, the demo sizes fit one file
        for shard in set(json.loads(index.read_text())["weight_map"].values()):
            (out / shard).unlink(missing_ok=True)
        index.unlink()
    return write_llava_hf_weights(model.state_dict(), out / WEIGHTS)


def convert_file(path: Path) -> Path:
    """Rename the keys of an existing LLaVA safetensors file in place."""
    return write_llava_hf_weights(load_file(str(path)), Path(path))


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Rename a LLaVA model.safetensors to the llava-hf layout, in place.")
    parser.add_argument("path", type=Path, help="a model.safetensors file")
    args = parser.parse_args(argv)
    print(f"wrote {convert_file(args.path)}")


if __name__ == "__main__":
    main()
