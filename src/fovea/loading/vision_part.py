"""Load only a model's vision part (tower and projector) from its directory.

What an encode-only process holds: the family's adapter builds just its vision modules, and
their weights are read from the checkpoint's safetensors by name, with nothing of the
language model read or allocated. The result stands in for a ``LoadedModel`` wherever the
vision stage runs (``ModelAdapter.vision_forward``): the modules sit at the same attribute
paths (``model.model.visual`` ...), beside the model's config.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from fovea.disagg.encoder_plan import MARGIN_BYTES, header_bytes, refuse_unless_fits
from fovea.errors import ModelLoadError
from fovea.loading.loader import inspect_model_dir, is_position_buffer, resolve_device, resolve_dtype
from fovea.models import ModelAdapter, adapter_for


@dataclass
class VisionPart:
    path: Path
    model: torch.nn.Module  # a shell: .config, and the vision modules at the full model's paths
    adapter: ModelAdapter
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    free_before_bytes: int | None = None  # free on the GPU before loading (CUDA)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def checkpoint_files(path: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def checkpoint_name(module_path: str, key: str, names: dict[str, Path]) -> str | None:
    """The checkpoint's name for ``key`` of the module at ``module_path``: transformers' own
    layout (``model.visual.*``), the original one (``visual.*``, ``vision_tower.*``), and a CLIP
    tower saved with or without its ``vision_model.`` level."""
    bases = [module_path, module_path.removeprefix("model.")]
    keys = [key, f"vision_model.{key}"] + ([key.split(".", 1)[1]] if "." in key else [])
    for base in bases:
        for k in keys:
            if f"{base}.{k}" in names:
                return f"{base}.{k}"
    return None


def load_vision_part(path: str | Path, device: str = "auto", dtype: str = "auto") -> VisionPart:
    started = time.perf_counter()
    path = Path(path).expanduser().resolve()
    inspect_model_dir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    adapter = adapter_for(config.model_type)
    assert adapter is not None  # inspect_model_dir refused the others
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    modules = adapter.build_vision_modules(config)
    names = checkpoint_files(path)
    missing: list[str] = []
    by_file: dict[Path, list[tuple[torch.Tensor, str]]] = {}
    for module_path, module in modules.items():
        for key, tensor in module.state_dict(keep_vars=True).items():
            name = checkpoint_name(module_path, key, names)
            if name is None:
                missing.append(f"{module_path}.{key}")
            else:
                by_file.setdefault(names[name], []).append((tensor, name))
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint has no weights for {len(missing)} vision tensor(s), e.g. "
                             f"{', '.join(missing[:3])}; it cannot be served by an encode-only process.")
    weights = header_bytes(names, [name for wanted in by_file.values() for _, name in wanted], torch_dtype)
    free = torch.cuda.mem_get_info(torch_device)[0] if torch_device.type == "cuda" else None
    if free is not None:  # before anything is on the GPU: the weights and the margin must fit
        refuse_unless_fits(weights + MARGIN_BYTES, free, f"its vision weights ({weights / 2**30:.2f} GiB) plus "
                           f"the margin")
    with torch.no_grad():
        for file, wanted in by_file.items():
            with safe_open(str(file), "pt") as f:
                for tensor, name in wanted:
                    stored = f.get_tensor(name)
                    if tuple(stored.shape) != tuple(tensor.shape):
                        raise ModelLoadError(f"{path}: {name} is {tuple(stored.shape)} in the checkpoint but the "
                                             f"config makes it {tuple(tensor.shape)}; fix config.json.")
                    tensor.copy_(stored)
    shell = _shell(config, modules)
    shell.to(device=torch_device).eval()
    for name, tensor in list(shell.named_parameters()) + list(shell.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != torch_dtype and not is_position_buffer(name):
            tensor.data = tensor.data.to(torch_dtype)
    return VisionPart(path, shell, adapter, torch_device, torch_dtype, time.perf_counter() - started, free)


def _shell(config: Any, modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """An empty module holding ``modules`` at their dotted paths, with the model's config."""
    shell = torch.nn.Module()
    shell.config = config
    for dotted, module in modules.items():
        parent = shell
        *parents, leaf = dotted.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
    return shell
