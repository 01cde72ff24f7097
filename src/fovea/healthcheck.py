"""The container HEALTHCHECK: healthy when /health says ``ok`` and the grounding canary passed.

    python -m fovea.healthcheck [URL]      # default http://127.0.0.1:$FOVEA_PORT/health (port 8000)

A server whose canary fails keeps answering requests but turns /health ``degraded``; the
orchestrator then sees the container unhealthy instead of a fluent model that ignores images.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request


def verdict(body: dict) -> tuple[bool, str]:
    if body.get("status") != "ok":
        return False, f"/health is {body.get('status')!r}: {'; '.join(body.get('reasons') or []) or 'no reason given'}"
    canary = body.get("canary")
    if canary is None:
        return True, "ok (canary off: --no-canary)"
    if not canary.get("ok"):
        return False, "the grounding canary failed"
    return True, f"ok, canary passed (min ablation KL {canary.get('min_ablation_kl'):.3f})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else f"http://127.0.0.1:{os.environ.get('FOVEA_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:  # 200 (or 503 under --strict, raised below)
            body = json.load(reply)
    except urllib.error.HTTPError as exc:
        body = json.load(exc)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}")
        return 1
    ok, text = verdict(body)
    print(("healthy: " if ok else "unhealthy: ") + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
