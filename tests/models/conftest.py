"""Fixtures shared by the model-family tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def tensor_reads(monkeypatch) -> list[str]:
    """The names of every tensor ``fovea.loading.vision_part`` reads from a safetensors file, in
    order, while the test runs (the encode-only loader must read no language-model tensor)."""
    from fovea.loading import vision_part

    read: list[str] = []
    real_open = vision_part.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(vision_part, "safe_open", Recording)
    return read
