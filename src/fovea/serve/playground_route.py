"""GET / : the playground, a static page (HTML and plain JS, no build step) shipped in the package.

The page holds no data and no secrets: it calls the same API as any client, so a server with
``--api-key`` still asks the page for the key on every request it makes.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

PLAYGROUND_DIR = Path(__file__).resolve().parent / "playground"
PAGES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/playground/grounding.js": ("grounding.js", "text/javascript; charset=utf-8"),
         "/playground/app.js": ("app.js", "text/javascript; charset=utf-8")}


def make_playground_router() -> APIRouter:
    router = APIRouter()
    for path, (name, media_type) in PAGES.items():
        def page(name: str = name, media_type: str = media_type) -> FileResponse:
            return FileResponse(PLAYGROUND_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})
        router.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    return router
