"""/v1/images: upload an image once, then refer to it by id in chat requests.

Uploads are read with a hard byte cap while streaming (the app's Content-Length check does not see
chunked bodies), validated by a full decode in a worker thread, and stored by content hash.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.types import Message

from fovea.errors import FoveaError, InvalidRequest
from fovea.media.config import MediaConfig
from fovea.media.errors import ImageNotFound, ImageTooLarge
from fovea.media.inline import decode_base64, decode_data_url
from fovea.media.store import ImageStore

_FORM_OVERHEAD = 64 * 1024  # multipart headers/boundaries and JSON framing around the image


def make_images_router(store: ImageStore, config: MediaConfig) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images")
    async def upload_image(request: Request) -> dict:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "multipart/form-data":
            param, read = "file", _multipart_file
        elif content_type in ("", "application/json") or content_type.endswith("+json"):
            param, read = "image", _json_image
        elif content_type.startswith("image/") or content_type == "application/octet-stream":
            param, read = None, _raw_body
        else:
            raise InvalidRequest(
                f"POST /v1/images does not accept {content_type!r} bodies; send multipart/form-data "
                "with a 'file' field, or JSON {\"image\": \"<data URL or base64>\"}.")
        try:
            data = await read(request, config)
        except ImageTooLarge as exc:  # refused while reading: still name the field it came in
            exc.param = exc.param or param
            raise
        try:
            stored = await run_in_threadpool(store.put, data)  # full decode: keep it off the loop
        except FoveaError as exc:
            exc.param = exc.param or param
            raise
        return stored.metadata()

    @router.get("/v1/images/{image_id}")
    async def get_image(image_id: str) -> dict:
        stored = store.get(image_id)
        if stored is None:
            raise _not_found(image_id)
        return stored.metadata()

    @router.delete("/v1/images/{image_id}")
    async def delete_image(image_id: str) -> dict:
        if not store.delete(image_id):
            raise _not_found(image_id)
        return {"id": image_id, "object": "image", "deleted": True}

    return router


async def _read_body(request: Request, limit: int, config: MediaConfig) -> bytes:
    too_large = ImageTooLarge(
        f"The upload is larger than this server accepts (images up to {config.max_image_bytes:,} bytes); "
        "send a smaller or more compressed image.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _raw_body(request: Request, config: MediaConfig) -> bytes:
    return await _read_body(request, config.max_image_bytes, config)


async def _multipart_file(request: Request, config: MediaConfig) -> bytes:
    body = await _read_body(request, config.max_image_bytes + _FORM_OVERHEAD, config)
    replayed = False

    async def receive() -> Message:  # hand the capped body to Starlette's form parser
        nonlocal replayed
        if replayed:
            return {"type": "http.disconnect"}
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        async with Request(request.scope, receive).form(max_files=1, max_fields=16) as form:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise InvalidRequest("The multipart upload has no file in a field named 'file'; send the "
                                     "image as -F file=@image.png.", param="file")
            data = await upload.read(config.max_image_bytes + 1)
    except HTTPException as exc:  # Starlette reports malformed multipart this way
        raise InvalidRequest(f"The multipart body could not be parsed ({exc.detail}); send the image "
                             "as a 'file' field of multipart/form-data.", param="file") from None
    if len(data) > config.max_image_bytes:
        raise ImageTooLarge(f"The uploaded file is larger than the {config.max_image_bytes:,}-byte "
                            "limit; send a smaller or more compressed image.", param="file")
    return data


async def _json_image(request: Request, config: MediaConfig) -> bytes:
    # base64 is 4/3 of the bytes; 5% more for line breaks and the escaped slashes some encoders emit.
    body = await _read_body(request, config.max_image_bytes * 4 // 3 * 21 // 20 + _FORM_OVERHEAD, config)
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nesting deeper than the parser's stack
        raise InvalidRequest("The request body is not valid JSON; send {\"image\": \"<data URL or "
                             "base64>\"}.") from None
    ref = payload.get("image") if isinstance(payload, dict) else None
    if not isinstance(ref, str):
        raise InvalidRequest("The JSON body needs an 'image' field holding a data URL or base64 "
                             "string.", param="image")
    ref = ref.strip()
    if ":" in ref[:12] and ref[:5].lower() != "data:":
        raise InvalidRequest("POST /v1/images takes the image itself (a data URL or base64), not a URL "
                             "to it; download it and upload the bytes.", param="image")
    try:
        return decode_data_url(ref, config) if ref[:5].lower() == "data:" else decode_base64(ref, config)
    except FoveaError as exc:
        exc.param = "image"
        raise


def _not_found(image_id: str) -> ImageNotFound:
    return ImageNotFound(f"No uploaded image has the id {image_id!r}; it may have expired or been "
                         "evicted. Upload it again with POST /v1/images.")
