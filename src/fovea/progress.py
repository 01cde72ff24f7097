"""Progress bars (tqdm) for long CLI work: model loading, demo training and evaluation, benchmarks.

They draw only on a terminal: piped into a log file or a container's log driver they stay quiet
(tqdm's ``disable=None``). ``FOVEA_PROGRESS=1`` draws them anyway, ``FOVEA_PROGRESS=0`` never.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def enabled_setting() -> bool | None:
    """tqdm's ``disable``: None (= off unless stderr is a TTY), or forced by FOVEA_PROGRESS."""
    forced = os.environ.get("FOVEA_PROGRESS")
    if forced == "1":
        return False
    if forced == "0":
        return True
    return None


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    kwargs.setdefault("disable", enabled_setting())
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
