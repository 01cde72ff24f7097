"""``fovea doctor``: checks that say why a GPU is (not) used, each with a remedy."""

from __future__ import annotations

from fovea.guard.checks import Check, Status, exit_code, render_json, render_text

__all__ = ["Check", "Status", "exit_code", "render_json", "render_text"]
