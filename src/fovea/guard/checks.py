"""The result of one doctor check and the ways to show a list of them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


_ORDER = (Status.PASS, Status.WARN, Status.FAIL, Status.SKIP)


@dataclass(frozen=True, slots=True)
class Check:
    """``name`` is a stable dotted id (``cuda.driver``); ``remedy`` says what to do on warn/fail."""

    name: str
    status: Status
    detail: str
    remedy: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, "remedy": self.remedy}


def counts(checks: Iterable[Check]) -> dict[str, int]:
    result = {status.value: 0 for status in _ORDER}
    for check in checks:
        result[Status(check.status).value] += 1
    return result


def exit_code(checks: Iterable[Check]) -> int:
    """1 when any check failed, else 0 (warnings and skips do not fail the doctor)."""
    return 1 if any(check.status == Status.FAIL for check in checks) else 0


def render_text(checks: Iterable[Check]) -> str:
    """One ``[status] name  detail`` line per check, the remedy indented below warn/fail lines."""
    checks = list(checks)
    width = max((len(check.name) for check in checks), default=0)
    indent = " " * len("[pass] ")
    lines = []
    for check in checks:
        lines.append(f"[{Status(check.status).value}] {check.name.ljust(width)}  {check.detail}".rstrip())
        if check.remedy and check.status in (Status.WARN, Status.FAIL):
            lines.append(f"{indent}remedy: {check.remedy}")
    summary = counts(checks)
    verdict = "FAILED" if exit_code(checks) else "ok"
    lines.append(f"{verdict}: " + ", ".join(f"{n} {name}" for name, n in summary.items()))
    return "\n".join(lines) + "\n"


def render_json(checks: Iterable[Check], extra: dict | None = None) -> str:
    """``{"ok": bool, "counts": {"pass": n, ...}, "checks": [{"name", "status", "detail", "remedy"}]}``
    plus the ``extra`` fields (the memory plan)."""
    checks = list(checks)
    body = {
        "ok": exit_code(checks) == 0,
        "counts": counts(checks),
        "checks": [check.to_dict() for check in checks],
        **(extra or {}),
    }
    return json.dumps(body, indent=2)
