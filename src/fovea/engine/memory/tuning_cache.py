"""Kernel choices timed at start-up, remembered between starts of the same model on the same GPU.

The engine times, for every row count a decode can have and every weight shape, the Triton
matrix-vector kernel's launch configurations and the kernel against cuBLAS (``triton_ops``),
and, for a quantized checkpoint, the FP8 and int4 kernels' launch configurations per row bucket
(``quant_matmul``). That is ~16 s of a 7B start-up (8-15 s more for FP8 on the H200), and the
answer only changes with the GPU, the software or the shapes. So the choices are kept in a JSON
file under ``$FOVEA_CACHE_DIR`` (default ``~/.cache/fovea``), one file per key:

- the key is the GPU's name and compute capability, the CUDA, torch, triton and fovea versions,
  and the model's fingerprint (the names, shapes and dtypes of its language-model weights);
- the file stores its own key, and is used only when the stored key equals this start's, every
  entry is well-formed and every configuration is one the kernel is timed in; anything else is
  ignored with a warning, and the choices are timed again and the file rewritten;
- a choice missing from the file (a shape seen for the first time) is timed as without a cache.

A stale file can cost speed, never correctness: every configuration computes the same product,
and the kernels' start-up self-check runs whatever the cache says. ``FOVEA_TUNING_CACHE=0``
turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from fovea import __version__
from fovea.engine.kernels import quant_matmul, triton_ops

log = logging.getLogger("fovea.engine.paged")

FORMAT = 5  # 2: the quantized kernels' choices ("quant_choice") too; 3: matrix-vector candidates among them;
# 4: their second version, and one for block-scaled FP8 (a choice made without it is timed again);
# 5: prefetching matrix-vector candidates at one row


def enabled() -> bool:
    return os.environ.get("FOVEA_TUNING_CACHE", "1") not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    return Path(os.environ.get("FOVEA_CACHE_DIR") or Path.home() / ".cache" / "fovea")


def model_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """What the choices depend on in a model: its weights' names, shapes and dtypes (not values)."""
    text = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in sorted(weights.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(device: torch.device, fingerprint: str) -> dict[str, str]:
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "cuda": str(torch.version.cuda), "torch": torch.__version__, "triton": triton.__version__,
            "fovea": __version__, "model": fingerprint}


def path_for(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"tuning-{digest}.json"


def _entry_key(text: str) -> tuple:
    rows, n, k, dtype = text.split(",")
    return int(rows), int(n), int(k), dtype


def _entry_text(key: tuple) -> str:
    return ",".join(str(part) for part in key)


def _quant_key(text: str) -> tuple:
    key = json.loads(text)
    if not isinstance(key, list) or not all(isinstance(part, (str, int, bool)) for part in key):
        raise ValueError(f"{text!r} is not a choice key")
    return tuple(key)


def _quant_config(fields: object) -> quant_matmul.Config:
    if not isinstance(fields, dict):
        raise TypeError(f"{fields!r} is not a configuration")
    return quant_matmul.config_from_fields(fields)


def parse(data: object, key: dict[str, str]) -> tuple[dict, dict, dict] | str:
    """(configurations, Triton-vs-cuBLAS choices, quantized kernels' configurations) from a file's
    JSON, or why it is not trusted."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return "an unknown format"
    if data.get("key") != key:
        return "a different key (GPU, versions or model)"
    configs, choices, quant = {}, {}, {}
    known = set(triton_ops.GEMV_CONFIGS)
    try:
        for text, config in data["gemv_config"].items():
            config = tuple(config)
            if config not in known:
                return f"configuration {config} is not one the kernel is timed in"
            configs[_entry_key(text)] = config
        for text, use in data["gemv_choice"].items():
            if not isinstance(use, bool):
                return f"choice {use!r} is not true or false"
            choices[_entry_key(text)] = use
        for text, fields in data["quant_choice"].items():
            choice, config = _quant_key(text), _quant_config(fields)
            if config not in quant_matmul.candidates_for(choice):
                return f"configuration {config.describe()} is not one the kernel is timed in for {choice}"
            quant[choice] = config
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"a malformed entry ({type(exc).__name__}: {exc})"
    return configs, choices, quant


def _is_engine_choice(key: tuple) -> bool:
    """A choice the engine's kernels make (a benchmark's own keys stay out of the file)."""
    try:
        quant_matmul.candidates_for(key)
    except (ValueError, IndexError, TypeError):
        return False
    return True


class TuningCache:
    """Load the choices before start-up's kernel timings, save what they added after."""

    def __init__(self, key: dict[str, str]) -> None:
        self.key = key
        self.path = path_for(key)
        self.loaded_entries = 0

    @classmethod
    def for_model(cls, device: torch.device, weights: dict[str, torch.Tensor]) -> TuningCache:
        return cls(cache_key(device, model_fingerprint(weights)))

    def load(self) -> int:
        """Put the file's choices into ``triton_ops``; returns how many it held (0: none trusted)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("kernel tuning cache %s is unreadable (%s): timing the kernels again", self.path, exc)
            return 0
        parsed = parse(data, self.key)
        if isinstance(parsed, str):
            log.warning("kernel tuning cache %s not used: it has %s; timing the kernels again", self.path, parsed)
            return 0
        configs, choices, quant = parsed
        triton_ops._GEMV_CONFIG.update(configs)
        triton_ops._GEMV_CHOICE.update(choices)
        quant_matmul._CHOSEN.update(quant)
        self.loaded_entries = len(configs) + len(choices) + len(quant)
        return self.loaded_entries

    def save(self) -> bool:
        """Write the current choices (atomically) when they add to what was loaded."""
        configs, choices = dict(triton_ops._GEMV_CONFIG), dict(triton_ops._GEMV_CHOICE)
        quant = {k: v for k, v in quant_matmul._CHOSEN.items() if _is_engine_choice(k)}
        if len(configs) + len(choices) + len(quant) <= self.loaded_entries:
            return False
        data = {"format": FORMAT, "key": self.key,
                "gemv_config": {_entry_text(k): list(v) for k, v in configs.items()},
                "gemv_choice": {_entry_text(k): v for k, v in choices.items()},
                "quant_choice": {json.dumps(list(k)): dataclasses.asdict(v) for k, v in quant.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(data, f, indent=1)
            os.replace(f.name, self.path)
            self.loaded_entries = len(configs) + len(choices) + len(quant)  # a later save: only when more
        except OSError as exc:  # a read-only home: the next start times again, nothing else changes
            log.warning("kernel tuning cache not saved to %s: %s", self.path, exc)
            return False
        return True
