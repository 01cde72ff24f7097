"""A corpus of malformed and unusual requests, each with its exact status, error code and param.

Every request is generated here. Strings may carry placeholders that are filled in at run time:
``@ALLOWED@`` (the server's allowed media dir), ``@OUTSIDE@`` (a sibling dir it may not read) and
``@TRAP@`` (the port of a loopback listener that must never see a connection). While each case
runs, every outgoing ``socket.connect`` in this process other than to the test servers is refused
and recorded, so SSRF refusals are shown to happen without any connection attempt.
"""

from __future__ import annotations

import base64
import io
import os
import random
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from PIL import Image
from scene_helpers import fresh_scene

from fovea.demo import scenes
from fovea.media import MediaConfig

ANY = "<any>"
API_KEY = "sekrit-test-key"
LIMIT_IMAGES = 2
MAX_BODY = 256 * 1024
MAX_IMAGE_BYTES = 64 * 1024
MAX_PIXELS = 300_000
TEMPLATE = "user: <image> Describe the image. assistant:"
PRIVATE_HOSTS = ("localhost", "127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "::ffff:127.0.0.1", "0.0.0.0")


# ---- payloads ------------------------------------------------------------------------------------

def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    im.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def durl(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


SCENE = fresh_scene(71, min_shapes=2)
SCENE_IMAGE = scenes.render(SCENE)
GOOD_PNG = encode(SCENE_IMAGE, "PNG")
GOOD_JPEG = encode(SCENE_IMAGE, "JPEG", quality=90)
GOOD_GIF = encode(SCENE_IMAGE.convert("P"), "GIF")
GOOD_WEBP = encode(SCENE_IMAGE, "WEBP", quality=90)
GOOD_BMP = encode(SCENE_IMAGE, "BMP")
GOOD_URL = durl(GOOD_PNG)


def _corrupt_png(data: bytes) -> bytes:
    """Garble the compressed pixel stream (keeping chunk framing), so zlib must fail."""
    start = data.index(b"IDAT") + 4
    body = bytearray(data)
    for i in range(start + 2, min(start + 600, len(body) - 16)):
        body[i] = 0xFF
    return bytes(body)


def _noise_png(side: int) -> bytes:
    rng = random.Random(side)
    return encode(Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)), "PNG")


BIG_PNG = _noise_png(200)  # ~120 KB: over MAX_IMAGE_BYTES, under MAX_BODY (also as base64)
assert MAX_IMAGE_BYTES < len(BIG_PNG) and len(b64(BIG_PNG)) < MAX_BODY - 4096

# name -> (bytes, status, code)
BROKEN: dict[str, tuple[bytes, int, str]] = {
    "truncated_png": (GOOD_PNG[: len(GOOD_PNG) // 2], 400, "invalid_image"),
    "png_signature_only": (GOOD_PNG[:8], 400, "invalid_image"),
    "png_header_only": (GOOD_PNG[:33], 400, "invalid_image"),
    "corrupt_png_pixels": (_corrupt_png(GOOD_PNG), 400, "invalid_image"),
    "truncated_jpeg": (GOOD_JPEG[: len(GOOD_JPEG) // 2], 400, "invalid_image"),
    "jpeg_soi_only": (GOOD_JPEG[:4], 400, "invalid_image"),
    "truncated_gif": (GOOD_GIF[: len(GOOD_GIF) // 2], 400, "invalid_image"),
    "truncated_webp": (GOOD_WEBP[: len(GOOD_WEBP) // 2], 400, "invalid_image"),
    "bmp_header_only": (GOOD_BMP[:40], 400, "invalid_image"),
    "tiff_header_only": (b"II*\x00\x08\x00\x00\x00", 400, "invalid_image"),
    "plain_text": (b"this is a caption, not an image\n" * 4, 400, "invalid_image"),
    "html_login_page": (b"<!DOCTYPE html><html><body>Please sign in</body></html>", 400, "invalid_image"),
    "json_text": (b'{"image": "cat.png"}', 400, "invalid_image"),
    "random_bytes": (b"\x13\x37" + random.Random(5).randbytes(2046), 400, "invalid_image"),
    "empty": (b"", 400, "invalid_image"),
    "svg": (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"/>',
            400, "unsupported_image_format"),
    "psd": (b"8BPS\x00\x01" + bytes(64), 400, "unsupported_image_format"),
    "pdf": (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", 400, "unsupported_image_format"),
    "ico": (b"\x00\x00\x01\x00\x01\x00" + bytes(64), 400, "unsupported_image_format"),
    "heic": (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(32), 400, "unsupported_image_format"),
    "pnm": (b"P6\n2 2\n255\n" + bytes(12), 400, "unsupported_image_format"),
    "too_many_pixels": (encode(Image.new("RGB", (600, 600), "white"), "PNG"), 400, "image_too_large"),
}


# ---- cases ---------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    method: str
    path: str
    status: int
    code: str
    param: object = ANY
    json: object = None
    content: bytes | None = None
    files: dict | None = None
    headers: dict = field(default_factory=dict)
    chunked: bool = False
    server: str = "main"  # "main" or "keyed" (the one with an API key)
    raw_json: bytes | None = None  # sent verbatim as application/json


CASES: list[Case] = []


def add(*args, **kw) -> None:
    CASES.append(Case(*args, **kw))


def chat(*content, role: str = "user", extra_messages=(), **fields) -> dict:
    return {"model": "fovea-shapes", "messages": [*extra_messages, {"role": role, "content": list(content)}],
            **fields}


def text(t: str = "Describe the image.") -> dict:
    return {"type": "text", "text": t}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def hi(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


CHAT, COMP, GEN, IMAGES = "/v1/chat/completions", "/v1/completions", "/generate", "/v1/images"

# Broken images in every reference form and on every endpoint.
for name, (data, status, code) in BROKEN.items():
    add(f"chat-dataurl-{name}", "POST", CHAT, status, code, "messages[0].content[1]",
        json=chat(text(), image(durl(data))))
    add(f"completions-base64-{name}", "POST", COMP, status, code, "images[0]",
        json={"prompt": TEMPLATE, "images": [b64(data)]})
    add(f"generate-file-{name}", "POST", GEN, status, code, "image",
        json={"prompt": "Describe the image.", "image": f"file://@ALLOWED@/broken-{name}.img"})
    add(f"upload-multipart-{name}", "POST", IMAGES, status, code, "file",
        files={"file": (f"{name}.png", data, "image/png")})
    add(f"upload-json-{name}", "POST", IMAGES, status, code, "image", json={"image": durl(data)})
    add(f"upload-raw-{name}", "POST", IMAGES, status, code, None, content=data,
        headers={"content-type": "image/png"})

# Bad data URLs and inline base64.
for name, url, code in [
    ("no-base64-flag", "data:image/png," + b64(GOOD_PNG), "invalid_image"),
    ("text-mime", "data:text/plain;base64," + b64(GOOD_PNG), "invalid_image"),
    ("json-mime", "data:application/json;base64,e30=", "invalid_image"),
    ("no-comma", "data:image/png;base64" + b64(GOOD_PNG), "invalid_image"),
    ("bad-alphabet", "data:image/png;base64,!!!!not*base64!!!!", "invalid_image"),
    ("impossible-length", "data:image/png;base64,A", "invalid_image"),
    ("only-padding", "data:image/png;base64,====", "invalid_image"),
    ("svg-mime", durl(BROKEN["svg"][0], "image/svg+xml"), "unsupported_image_format"),
    ("jpeg-labelled-png-but-truncated", durl(GOOD_JPEG[:200]), "invalid_image"),
    ("raw-base64-garbage", "%%%%~~~~", "invalid_image"),
    ("raw-base64-of-text", b64(b"hello world, definitely not pixels"), "invalid_image"),
    ("whitespace-only", "   \n\t ", "invalid_image"),
    ("malformed-image-id", "img-xyz", "invalid_image"),
    ("unix-path", "/etc/passwd", "invalid_image"),
    ("home-path", "~/cat.png", "invalid_image"),
    ("relative-path", "./cat.png", "invalid_image"),
]:
    add(f"chat-ref-{name}", "POST", CHAT, 400, code, "messages[0].content[0]", json=chat(image(url), text()))
add("chat-image-too-large-bytes", "POST", CHAT, 413, "image_too_large", "messages[0].content[0]",
    json=chat(image(durl(BIG_PNG)), text()))

# Unknown uploaded ids.
UNKNOWN_ID = "img-" + "0123456789abcdef" * 2
add("chat-unknown-id", "POST", CHAT, 404, "image_not_found", "messages[0].content[1]",
    json=chat(text(), image(UNKNOWN_ID)))
add("completions-unknown-id", "POST", COMP, 404, "image_not_found", "images[0]",
    json={"prompt": TEMPLATE, "images": [UNKNOWN_ID]})
add("generate-unknown-id", "POST", GEN, 404, "image_not_found", "image",
    json={"prompt": "Describe the image.", "image": UNKNOWN_ID})
add("images-get-unknown-id", "GET", f"{IMAGES}/{UNKNOWN_ID}", 404, "image_not_found")
add("images-delete-unknown-id", "DELETE", f"{IMAGES}/{UNKNOWN_ID}", 404, "image_not_found")
add("images-get-not-an-id", "GET", f"{IMAGES}/not-an-id", 404, "image_not_found")

# Schemes that are never fetched.
for name, url in [
    ("ftp", "ftp://example.com/cat.png"), ("gopher", "gopher://example.com/1"),
    ("javascript", "javascript:alert(1)"), ("s3", "s3://bucket/cat.png"),
    ("windows-path", "C:\\Users\\me\\cat.png"), ("blob", "blob:https://example.com/uuid"),
]:
    add(f"chat-scheme-{name}", "POST", CHAT, 403, "media_source_forbidden", "messages[0].content[0]",
        json=chat(image(url), text()))

# file:// references: confined to the allowed dir, whatever the spelling.
for name, url, status, code in [
    ("etc-passwd", "file:///etc/passwd", 403, "media_source_forbidden"),
    ("outside-dir", "file://@OUTSIDE@/secret.png", 403, "media_source_forbidden"),
    ("dotdot", "file://@ALLOWED@/../outside/secret.png", 403, "media_source_forbidden"),
    ("dotdot-deep", "file://@ALLOWED@/sub/../../outside/secret.png", 403, "media_source_forbidden"),
    ("dotdot-percent-encoded", "file://@ALLOWED@/%2e%2e/outside/secret.png", 403, "media_source_forbidden"),
    ("dotdot-to-etc", "file://@ALLOWED@/../../../../../../etc/passwd", 403, "media_source_forbidden"),
    ("prefix-sibling-dir", "file://@ALLOWED@-evil/secret.png", 403, "media_source_forbidden"),
    ("symlink-to-outside-file", "file://@ALLOWED@/link-secret.png", 403, "media_source_forbidden"),
    ("symlink-to-outside-dir", "file://@ALLOWED@/link-outside/secret.png", 403, "media_source_forbidden"),
    ("dangling-symlink-outside", "file://@ALLOWED@/dangling-out.png", 403, "media_source_forbidden"),
    ("symlink-to-etc-passwd", "file://@ALLOWED@/link-passwd", 403, "media_source_forbidden"),
    ("remote-host", "file://evil.example.com@ALLOWED@/scene.png", 403, "media_source_forbidden"),
    ("dangling-symlink-inside", "file://@ALLOWED@/dangling-in.png", 400, "media_fetch_failed"),
    ("missing-file", "file://@ALLOWED@/missing.png", 400, "media_fetch_failed"),
    ("directory", "file://@ALLOWED@/sub", 400, "media_fetch_failed"),
    ("fifo", "file://@ALLOWED@/a-fifo", 400, "media_fetch_failed"),
    ("query", "file://@ALLOWED@/scene.png?x=1", 400, "invalid_image"),
    ("fragment", "file://@ALLOWED@/scene.png#top", 400, "invalid_image"),
    ("nul-byte", "file://@ALLOWED@/scene%00.png", 400, "invalid_image"),
    ("relative", "file:scene.png", 400, "invalid_image"),
    ("too-big", "file://@ALLOWED@/big.png", 413, "image_too_large"),
]:
    add(f"chat-file-{name}", "POST", CHAT, status, code, "messages[0].content[1]",
        json=chat(text(), image(url)))
add("completions-file-outside", "POST", COMP, 403, "media_source_forbidden", "images[0]",
    json={"prompt": TEMPLATE, "images": ["file://@OUTSIDE@/secret.png"]})
add("generate-file-symlink-escape", "POST", GEN, 403, "media_source_forbidden", "image",
    json={"prompt": "Describe the image.", "image": "file://@ALLOWED@/link-secret.png"})

# http(s): hosts not on the list, and listed hosts on private addresses. None may be contacted.
for name, url, status, code in [
    ("unlisted-host", "http://evil.example.com/cat.png", 403, "media_source_forbidden"),
    ("unlisted-host-https", "https://evil.example.com/cat.png", 403, "media_source_forbidden"),
    ("loopback-v4", "http://127.0.0.1:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("localhost", "http://localhost:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("localhost-uppercase", "http://LOCALHOST:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("localhost-trailing-dot", "http://localhost.:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("private-10", "http://10.0.0.1/cat.png", 403, "media_source_forbidden"),
    ("link-local-metadata", "http://169.254.169.254/latest/meta-data/", 403, "media_source_forbidden"),
    ("loopback-v6", "http://[::1]:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("v4-mapped-v6-loopback", "http://[::ffff:127.0.0.1]:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("unspecified", "http://0.0.0.0:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("decimal-loopback", "http://2130706433:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("hex-loopback", "http://0x7f000001:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("short-loopback", "http://127.1:@TRAP@/cat.png", 403, "media_source_forbidden"),
    ("userinfo-hides-loopback", "http://evil.example.com@127.0.0.1:@TRAP@/cat.png", 403,
     "media_source_forbidden"),
    ("userinfo-hides-unlisted", "http://127.0.0.1:@TRAP@@evil.example.com/cat.png", 403,
     "media_source_forbidden"),
    ("https-link-local", "https://169.254.169.254/", 403, "media_source_forbidden"),
    ("bad-port", "http://localhost:99999/cat.png", 400, "invalid_image"),
    ("no-host", "http:///cat.png", 400, "invalid_image"),
    ("broken-ipv6-literal", "http://[::1/cat.png", 400, "invalid_image"),
]:
    add(f"chat-http-{name}", "POST", CHAT, status, code, "messages[0].content[0]",
        json=chat(image(url), text()))
add("completions-http-private", "POST", COMP, 403, "media_source_forbidden", "images[0]",
    json={"prompt": TEMPLATE, "images": ["http://10.0.0.1/cat.png"]})
add("generate-http-metadata", "POST", GEN, 403, "media_source_forbidden", "image",
    json={"prompt": "Describe the image.", "image": "http://169.254.169.254/latest/meta-data/iam"})

# Wrong JSON and schema errors on /v1/chat/completions.
add("chat-not-json", "POST", CHAT, 400, "invalid_request", None, raw_json=b"{not json")
add("chat-truncated-json", "POST", CHAT, 400, "invalid_request", None, raw_json=b'{"messages": [{"role": "us')
add("chat-empty-body", "POST", CHAT, 400, "invalid_request", raw_json=b"")
add("chat-json-array", "POST", CHAT, 400, "invalid_request", None, json=[{"role": "user", "content": "hi"}])
add("chat-json-string", "POST", CHAT, 400, "invalid_request", None, json="hi")
add("chat-json-null", "POST", CHAT, 400, "invalid_request", raw_json=b"null")
add("chat-missing-messages", "POST", CHAT, 400, "invalid_request", "messages", json={"model": "fovea-shapes"})
add("chat-empty-messages", "POST", CHAT, 400, "invalid_request", "messages", json={"messages": []})
add("chat-messages-string", "POST", CHAT, 400, "invalid_request", "messages", json={"messages": "hi"})
add("chat-message-not-object", "POST", CHAT, 400, "invalid_request", "messages[0]", json={"messages": [5]})
add("chat-role-missing", "POST", CHAT, 400, "invalid_request", "messages[0].role",
    json={"messages": [{"content": "hi"}]})
# A tool turn needs a chat template that renders tools; the demo model's renders none.
add("chat-role-tool", "POST", CHAT, 400, "tools_not_supported", "messages[0]",
    json={"messages": [{"role": "tool", "content": "hi"}]})
add("chat-role-unknown", "POST", CHAT, 400, "invalid_request", "messages[0].role",
    json={"messages": [{"role": "robot", "content": "hi"}]})
add("chat-content-number", "POST", CHAT, 400, "invalid_request", "messages[0].content",
    json={"messages": [{"role": "user", "content": 5}]})
add("chat-user-content-null", "POST", CHAT, 400, "invalid_request", "messages[0].content",
    json={"messages": [{"role": "user", "content": None}]})
add("chat-user-content-missing", "POST", CHAT, 400, "invalid_request", "messages[1].content",
    json={"messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]})
for name, part in [
    ("video", {"type": "video", "video": "x"}),
    ("input-audio", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
    ("image-without-url-wrapper", {"type": "image", "image": GOOD_URL}),
    ("missing-type", {"text": "hi"}),
    ("type-null", {"type": None, "text": "hi"}),
    ("part-is-string", "hi"),
    ("part-is-list", [text()]),
]:
    add(f"chat-part-{name}", "POST", CHAT, 400, "invalid_request", "messages[0].content[1]",
        json=chat(text(), part))
for role in ("assistant", "system", "developer"):
    before = [{"role": "user", "content": "hi"}] if role == "assistant" else []
    where = len(before)
    add(f"chat-image-in-{role}-message", "POST", CHAT, 400, "invalid_request", f"messages[{where}].content[1]",
        json=chat(text(), image(GOOD_URL), role=role, extra_messages=before))
for fname, values in {
    "temperature": [-0.1, 2.01, 100, "hot", [1]],
    "top_p": [0, -0.5, 1.01, "all"],
    "max_tokens": [0, -1, 1.5, "ten"],
    "max_completion_tokens": [0, -3],
    "n": [0, 129, "two"],
    "top_logprobs": [21, -1],
    "top_k": [-2],
    "min_p": [1.5],
    "presence_penalty": [2.5],
    "frequency_penalty": [-3],
    "repetition_penalty": [0],
    "stop_token_ids": [[-1]],
    "seed": ["abc", 1.5],
    "stop": [["a", "b", "c", "d", "e"], [""], "", 5, [1]],
    "stream": [[1], {"on": True}],
    "stream_options": ["yes"],
    "fovea": ["on"],
    "model": [5],
}.items():
    for value in values:
        param = {"fovea": ANY, "stop": "stop[0]" if value == [1] else "stop",
                 "stop_token_ids": "stop_token_ids[0]"}.get(fname, fname)
        add(f"chat-{fname}-{value!r}", "POST", CHAT, 400, "invalid_request", param, json=hi(**{fname: value}))
for fname, value, param in [("fovea", {"unknown": 1}, "fovea.unknown"),
                            ("stream_options", {"frobnicate": True}, "stream_options.frobnicate"),
                            ("audio", {"voice": "alloy"}, "audio"), ("not_a_field", 1, "not_a_field")]:
    body = hi(**{fname: value}, **({"stream": True} if fname == "stream_options" else {}))
    add(f"chat-{fname}-{value!r}", "POST", CHAT, 400, "unsupported_parameter", param, json=body)
add("chat-fovea-grounding-not-bool", "POST", CHAT, 400, "invalid_request", "fovea.grounding",
    json=hi(fovea={"grounding": [1]}))
add("chat-max-tokens-past-context", "POST", CHAT, 400, "context_length_exceeded", "max_tokens",
    json=hi(max_tokens=100_000))
add("chat-unknown-model", "POST", CHAT, 404, "model_not_found", "model", json=hi(model="gpt-4o"))
add("chat-unknown-model-with-image", "POST", CHAT, 404, "model_not_found", "model",
    json=chat(image(GOOD_URL), text(), model="llava-1.5-7b"))
add("chat-too-many-images", "POST", CHAT, 400, "too_many_images", "messages[0].content[3]",
    json=chat(text(), image(GOOD_URL), image(GOOD_URL), image(GOOD_URL)))
add("chat-too-many-images-across-messages", "POST", CHAT, 400, "too_many_images", "messages[2].content[0]",
    json=chat(image(GOOD_URL), text(), extra_messages=[
        {"role": "user", "content": [image(GOOD_URL), image(GOOD_URL), text()]},
        {"role": "assistant", "content": "two"}]))
add("chat-too-many-broken-images", "POST", CHAT, 400, "too_many_images", "messages[0].content[2]",
    json=chat(image("data:,"), image("data:,"), image("data:,")))
add("chat-one-bad-among-good", "POST", CHAT, 400, "invalid_image", "messages[0].content[1]",
    json=chat(image(GOOD_URL), image(durl(b"junk")), text()))

# /v1/completions: schema and placeholder counting.
for name, body, status, code, param in [
    ("missing-prompt", {"images": []}, 400, "invalid_request", "prompt"),
    ("empty-prompt", {"prompt": ""}, 400, "invalid_request", "prompt"),
    ("two-prompts-with-images", {"prompt": ["a", "b"], "images": [GOOD_URL]}, 400, "invalid_request", "images"),
    ("prompts-text-and-ids", {"prompt": ["a", [1]]}, 400, "invalid_request", "prompt[1]"),
    ("no-prompts", {"prompt": []}, 400, "invalid_request", "prompt"),
    ("prompt-number", {"prompt": 5}, 400, "invalid_request", "prompt"),
    ("images-string", {"prompt": TEMPLATE, "images": GOOD_URL}, 400, "invalid_request", "images"),
    ("images-number-item", {"prompt": TEMPLATE, "images": [5]}, 400, "invalid_request", "images[0]"),
    ("images-empty-string", {"prompt": TEMPLATE, "images": [""]}, 400, "invalid_image", "images[0]"),
    ("placeholder-without-image", {"prompt": TEMPLATE, "images": []}, 400, "image_placeholder_mismatch", None),
    ("image-without-placeholder", {"prompt": "user: Describe the image. assistant:", "images": [GOOD_URL]},
     400, "image_placeholder_mismatch", None),
    ("two-placeholders-one-image", {"prompt": "user: <image> <image> Describe the image. assistant:",
                                    "images": [GOOD_URL]}, 400, "image_placeholder_mismatch", None),
    ("one-placeholder-two-images", {"prompt": TEMPLATE, "images": [GOOD_URL, GOOD_URL]},
     400, "image_placeholder_mismatch", None),
    ("too-many-images", {"prompt": "<image>" * 3 + TEMPLATE, "images": [GOOD_URL] * 3},
     400, "too_many_images", "images[2]"),
    ("second-image-broken", {"prompt": "user: <image> <image> Describe. assistant:",
                             "images": [GOOD_URL, durl(GOOD_PNG[:100])]}, 400, "invalid_image", "images[1]"),
    ("unknown-model", {"prompt": "hello", "model": "gpt-3.5-turbo-instruct"}, 404, "model_not_found", "model"),
    ("temperature-high", {"prompt": "hello", "temperature": 3}, 400, "invalid_request", "temperature"),
    ("top-p-zero", {"prompt": "hello", "top_p": 0}, 400, "invalid_request", "top_p"),
    ("n-too-many", {"prompt": "hello", "n": 129}, 400, "invalid_request", "n"),
    ("logprobs-true", {"prompt": "hello", "logprobs": True}, 400, "invalid_request", "logprobs"),
    ("logprobs-21", {"prompt": "hello", "logprobs": 21}, 400, "invalid_request", "logprobs"),
    ("messages-field", {"prompt": "hello", "messages": []}, 400, "unsupported_parameter", "messages"),
    ("stop-five", {"prompt": "hello", "stop": list("abcde")}, 400, "invalid_request", "stop"),
    ("max-tokens-past-context", {"prompt": "hello", "max_tokens": 100_000}, 400, "context_length_exceeded",
     "max_tokens"),
]:
    add(f"completions-{name}", "POST", COMP, status, code, param, json=body)
add("completions-not-json", "POST", COMP, 400, "invalid_request", None, raw_json=b"prompt=hello")

# /generate.
for name, body, status, code, param in [
    ("missing-prompt", {"image": GOOD_URL}, 400, "invalid_request", "prompt"),
    ("empty-prompt", {"prompt": ""}, 400, "invalid_request", "prompt"),
    ("prompt-list", {"prompt": ["a"]}, 400, "invalid_request", "prompt"),
    ("image-number", {"prompt": "Describe the image.", "image": 5}, 400, "invalid_request", "image"),
    ("image-list", {"prompt": "Describe the image.", "image": [GOOD_URL, GOOD_URL]}, 400, "invalid_request",
     "image"),
    ("image-bad-data-url", {"prompt": "Describe the image.", "image": "data:image/png;base64,AAAA"},
     400, "invalid_image", "image"),
    ("image-scheme", {"prompt": "Describe the image.", "image": "ftp://x/y.png"}, 403,
     "media_source_forbidden", "image"),
    ("unknown-model", {"prompt": "hello", "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("temperature-negative", {"prompt": "hello", "temperature": -1}, 400, "invalid_request", "temperature"),
    ("top-p-over", {"prompt": "hello", "top_p": 2}, 400, "invalid_request", "top_p"),
    ("max-tokens-zero", {"prompt": "hello", "max_tokens": 0}, 400, "invalid_request", "max_tokens"),
    ("n-zero", {"prompt": "hello", "n": 0}, 400, "invalid_request", "n"),
    ("logprobs", {"prompt": "hello", "logprobs": 1}, 400, "unsupported_parameter", "logprobs"),
    ("max-tokens-past-context", {"prompt": "hello", "max_tokens": 100_000}, 400, "context_length_exceeded",
     "max_tokens"),
]:
    add(f"generate-{name}", "POST", GEN, status, code, param, json=body)

# /v1/images: body shapes it does not take.
add("upload-text-plain", "POST", IMAGES, 400, "invalid_request", None, content=GOOD_PNG,
    headers={"content-type": "text/plain"})
add("upload-form-urlencoded", "POST", IMAGES, 400, "invalid_request", None, content=b"image=abc",
    headers={"content-type": "application/x-www-form-urlencoded"})
add("upload-json-invalid", "POST", IMAGES, 400, "invalid_request", None, raw_json=b"{oops")
add("upload-json-list", "POST", IMAGES, 400, "invalid_request", "image", json=[GOOD_URL])
add("upload-json-missing-image", "POST", IMAGES, 400, "invalid_request", "image", json={"file": GOOD_URL})
add("upload-json-image-number", "POST", IMAGES, 400, "invalid_request", "image", json={"image": 5})
add("upload-json-http-url", "POST", IMAGES, 400, "invalid_request", "image",
    json={"image": "http://localhost/cat.png"})
add("upload-json-file-url", "POST", IMAGES, 400, "invalid_request", "image", json={"image": "file:///etc/passwd"})
add("upload-multipart-wrong-field", "POST", IMAGES, 400, "invalid_request", "file",
    files={"image": ("scene.png", GOOD_PNG, "image/png")})
add("upload-multipart-file-as-text-field", "POST", IMAGES, 400, "invalid_request", "file",
    content=b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nnot a file\r\n--XyZ--\r\n",
    headers={"content-type": "multipart/form-data; boundary=XyZ"})
add("upload-multipart-garbled", "POST", IMAGES, 400, "invalid_request", "file",
    content=b"this is not multipart at all", headers={"content-type": "multipart/form-data; boundary=XyZ"})
add("upload-raw-too-large", "POST", IMAGES, 413, "image_too_large", None, content=BIG_PNG,
    headers={"content-type": "image/png"})
add("upload-raw-too-large-chunked", "POST", IMAGES, 413, "image_too_large", None, content=BIG_PNG,
    headers={"content-type": "image/png"}, chunked=True)
add("upload-multipart-too-large", "POST", IMAGES, 413, "image_too_large", "file",
    files={"file": ("big.png", BIG_PNG, "image/png")})
add("upload-json-too-large", "POST", IMAGES, 413, "image_too_large", ANY, json={"image": durl(BIG_PNG)})
add("upload-multipart-too-large-past-form-overhead", "POST", IMAGES, 413, "image_too_large", ANY,
    files={"file": ("big.png", BIG_PNG + bytes(80_000), "image/png")})

# Routing.
add("route-unknown", "GET", "/v1/nope", 404, "not_found")
add("route-chat-get", "GET", CHAT, 405, "method_not_allowed")
add("route-models-post", "POST", "/v1/models", 405, "method_not_allowed", json={})
add("route-health-delete", "DELETE", "/health", 405, "method_not_allowed")
add("route-images-put", "PUT", f"{IMAGES}/{UNKNOWN_ID}", 405, "method_not_allowed", content=GOOD_PNG)

# Oversized bodies, with and without Content-Length.
HUGE = b"A" * (MAX_BODY + 50_000)
HUGE_CHAT = ('{"messages": [{"role": "user", "content": "' + "x" * (MAX_BODY + 50_000) + '"}]}').encode()
add("body-chat-too-large", "POST", CHAT, 413, "request_too_large", None, raw_json=HUGE_CHAT)
add("body-chat-too-large-chunked", "POST", CHAT, 413, "request_too_large", None, raw_json=HUGE_CHAT, chunked=True)
add("body-chat-too-large-image", "POST", CHAT, 413, "request_too_large", None,
    json=chat(image(durl(HUGE)), text()))
add("body-completions-too-large-chunked", "POST", COMP, 413, "request_too_large", None,
    json={"prompt": TEMPLATE, "images": [b64(HUGE)]}, chunked=True)
add("body-generate-too-large", "POST", GEN, 413, "request_too_large", None,
    json={"prompt": "x" * (MAX_BODY + 10)})
add("body-upload-raw-too-large", "POST", IMAGES, 413, "request_too_large", None, content=HUGE,
    headers={"content-type": "image/png"})
add("body-upload-raw-too-large-chunked", "POST", IMAGES, 413, "request_too_large", None, content=HUGE,
    headers={"content-type": "image/png"}, chunked=True)
add("body-upload-multipart-too-large", "POST", IMAGES, 413, "request_too_large", None,
    files={"file": ("huge.png", HUGE, "image/png")})

# API key: every route but /health needs it.
for name, method, path, headers, kw in [
    ("models-no-key", "GET", "/v1/models", {}, {}),
    ("models-wrong-key", "GET", "/v1/models", {"authorization": "Bearer wrong"}, {}),
    ("models-key-without-bearer", "GET", "/v1/models", {"authorization": API_KEY}, {}),
    ("models-lowercase-bearer", "GET", "/v1/models", {"authorization": f"bearer {API_KEY}"}, {}),
    ("models-basic-auth", "GET", "/v1/models", {"authorization": "Basic " + b64(f"user:{API_KEY}".encode())}, {}),
    ("models-key-prefix", "GET", "/v1/models", {"authorization": f"Bearer {API_KEY[:-1]}"}, {}),
    ("models-key-in-x-api-key", "GET", "/v1/models", {"x-api-key": API_KEY}, {}),
    ("chat-no-key", "POST", CHAT, {}, {"json": hi()}),
    ("chat-wrong-key", "POST", CHAT, {"authorization": "Bearer nope"}, {"json": chat(image(GOOD_URL), text())}),
    ("completions-no-key", "POST", COMP, {}, {"json": {"prompt": "hello"}}),
    ("generate-no-key", "POST", GEN, {}, {"json": {"prompt": "hello"}}),
    ("upload-no-key", "POST", IMAGES, {}, {"content": GOOD_PNG}),
    ("image-get-no-key", "GET", f"{IMAGES}/{UNKNOWN_ID}", {}, {}),
    ("image-delete-no-key", "DELETE", f"{IMAGES}/{UNKNOWN_ID}", {}, {}),
    ("metrics-no-key", "GET", "/metrics", {}, {}),
    ("unknown-route-no-key", "GET", "/v1/nope", {}, {}),
]:
    add(f"auth-{name}", method, path, 401, "invalid_api_key", None, headers=headers, server="keyed", **kw)

assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus-media")
    allowed, outside, evil = root / "allowed", root / "outside", root / "allowed-evil"
    for d in (allowed, outside, evil, allowed / "sub"):
        d.mkdir()
    (outside / "secret.png").write_bytes(GOOD_PNG)
    (evil / "secret.png").write_bytes(GOOD_PNG)
    (allowed / "scene.png").write_bytes(GOOD_PNG)
    (allowed / "big.png").write_bytes(BIG_PNG)
    for name, (data, _, _) in BROKEN.items():
        (allowed / f"broken-{name}.img").write_bytes(data)
    (allowed / "link-secret.png").symlink_to(outside / "secret.png")
    (allowed / "link-outside").symlink_to(outside, target_is_directory=True)
    (allowed / "link-passwd").symlink_to("/etc/passwd")
    (allowed / "dangling-out.png").symlink_to(outside / "nope.png")
    (allowed / "dangling-in.png").symlink_to(allowed / "nope.png")
    os.mkfifo(allowed / "a-fifo")
    return root


@pytest.fixture(scope="module")
def trap() -> Iterator[socket.socket]:
    """A loopback listener nothing may connect to: the fetch targets above point at it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def servers(make_server, media_root) -> dict:
    media = MediaConfig(
        max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_PIXELS,
        allowed_media_dirs=(media_root / "allowed",), allowed_media_domains=PRIVATE_HOSTS,
        allow_private_addresses=False, fetch_timeout_s=1.0, store_max_bytes=4 * 1024 * 1024)
    main = make_server(media=media, limit_images_per_prompt=LIMIT_IMAGES, max_body_bytes=MAX_BODY)
    keyed = make_server(api_key=API_KEY, max_body_bytes=MAX_BODY)
    return {"main": main, "keyed": keyed}


@pytest.fixture(scope="module")
def http(servers) -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as client:
        yield client


def guard_outbound(monkeypatch, ports: set[int]) -> list:
    """Refuse and record every socket connection in this process except to loopback ``ports``."""
    attempts: list = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def allowed(sock, address) -> bool:
        return (sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] in ("127.0.0.1", "::1")
                and address[1] in ports)

    def connect(sock, address):
        if not allowed(sock, address):
            attempts.append(address)
            raise ConnectionRefusedError(f"test: outbound connection to {address!r} blocked")
        return real_connect(sock, address)

    def connect_ex(sock, address):
        if not allowed(sock, address):
            attempts.append(address)
            return 111  # ECONNREFUSED
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    return attempts


@pytest.fixture
def outbound(monkeypatch, servers) -> list:
    return guard_outbound(monkeypatch, {int(s.base_url.rsplit(":", 1)[1]) for s in servers.values()})


def fill(value, subs: dict[str, str]):
    if isinstance(value, str):
        for key, sub in subs.items():
            value = value.replace(key, sub)
        return value
    if isinstance(value, list):
        return [fill(v, subs) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, subs) for k, v in value.items()}
    return value


def send(http: httpx.Client, base_url: str, case: Case, subs: dict[str, str]) -> httpx.Response:
    import json as jsonlib

    kw: dict = {"headers": dict(case.headers)}
    content = case.content
    if case.raw_json is not None or case.json is not None:
        content = case.raw_json if case.raw_json is not None else jsonlib.dumps(fill(case.json, subs)).encode()
        kw["headers"].setdefault("content-type", "application/json")
    if case.files is not None:
        request = http.build_request(case.method, base_url + case.path, files=case.files, headers=kw["headers"])
        content = request.read()
        kw["headers"]["content-type"] = request.headers["content-type"]
    if content is not None:
        if case.chunked:
            kw["content"] = iter([content[i:i + 16384] for i in range(0, len(content), 16384)])
        else:
            kw["content"] = content
    return http.request(case.method, base_url + fill(case.path, subs), **kw)


# ---- the corpus ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_corpus(case: Case, servers, http, media_root, trap, outbound, assert_error):
    subs = {"@ALLOWED@": str(media_root / "allowed"), "@OUTSIDE@": str(media_root / "outside"),
            "@TRAP@": str(trap.getsockname()[1])}
    response = send(http, servers[case.server].base_url, case, subs)
    assert_error(response, case.status, case.code, case.param)
    assert outbound == [], f"the server tried to connect to {outbound}"


def test_corpus_is_big_and_covers_every_endpoint():
    assert len(CASES) >= 120
    assert {c.path for c in CASES} >= {CHAT, COMP, GEN, IMAGES, "/v1/models", "/metrics"}
    assert {c.status for c in CASES} >= {400, 401, 403, 404, 405, 413}


def test_deleted_upload_is_not_found_everywhere(servers, http, assert_error):
    base = servers["main"].base_url
    png = encode(scenes.render(fresh_scene(72)), "PNG")
    uploaded = http.post(base + IMAGES, content=png, headers={"content-type": "image/png"})
    assert uploaded.status_code == 200, uploaded.text
    image_id = uploaded.json()["id"]
    assert http.delete(f"{base}{IMAGES}/{image_id}").json() == {"id": image_id, "object": "image", "deleted": True}
    assert_error(http.delete(f"{base}{IMAGES}/{image_id}"), 404, "image_not_found")
    assert_error(http.get(f"{base}{IMAGES}/{image_id}"), 404, "image_not_found")
    assert_error(http.post(base + CHAT, json=chat(text(), image(image_id))), 404, "image_not_found",
                 "messages[0].content[1]")
    assert_error(http.post(base + GEN, json={"prompt": "Describe the image.", "image": image_id}),
                 404, "image_not_found", "image")


def test_health_stays_open_with_an_api_key(servers, http):
    base = servers["keyed"].base_url
    assert http.get(base + "/health").status_code == 200
    assert http.get(base + "/health").json()["status"] == "ok"
    models = http.get(base + "/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fovea-shapes"
    answer = http.post(base + CHAT, headers={"authorization": f"Bearer {API_KEY}"},
                       json=chat(image(GOOD_URL), text("How many shapes are there?")))
    assert answer.status_code == 200, answer.text


# Schema errors inside a content part name the field by its request path, as every other error does.
PART_PATHS = [
    ("empty-url", image(""), "messages[0].content[0].image_url.url"),
    ("url-missing", {"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url.url"),
    ("url-number", {"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[0].image_url.url"),
    ("image-url-is-string", {"type": "image_url", "image_url": GOOD_URL}, "messages[0].content[0].image_url"),
    ("detail-unknown", {"type": "image_url", "image_url": {"url": GOOD_URL, "detail": "ultra"}},
     "messages[0].content[0].image_url.detail"),
    ("text-number", {"type": "text", "text": 5}, "messages[0].content[0].text"),
    ("text-missing", {"type": "text"}, "messages[0].content[0].text"),
]


@pytest.mark.parametrize("name,part,param", PART_PATHS, ids=[p[0] for p in PART_PATHS])
def test_content_part_schema_errors_are_400s(name, part, param, servers, http, assert_error):
    response = http.post(servers["main"].base_url + CHAT, json=chat(part, text()))
    error = assert_error(response, 400, "invalid_request")
    assert error["param"].startswith("messages[0].content[0]"), error


@pytest.mark.parametrize("name,part,param", PART_PATHS, ids=[p[0] for p in PART_PATHS])
def test_content_part_schema_error_param_is_the_request_path(name, part, param, servers, http, assert_error):
    response = http.post(servers["main"].base_url + CHAT, json=chat(part, text()))
    assert_error(response, 400, "invalid_request", param)


@pytest.mark.parametrize("kind", ["json", "multipart"])
def test_upload_too_large_names_its_field(kind, servers, http, assert_error):
    url = servers["main"].base_url + IMAGES
    if kind == "json":
        response = http.post(url, json={"image": durl(BIG_PNG)})
    else:
        response = http.post(url, files={"file": ("big.png", BIG_PNG + bytes(80_000), "image/png")})
    assert_error(response, 413, "image_too_large", "image" if kind == "json" else "file")


def test_empty_content_list_is_refused(servers, http, assert_error):
    response = http.post(servers["main"].base_url + CHAT, json={"messages": [{"role": "user", "content": []}]})
    assert_error(response, 400, "invalid_request", "messages[0].content")


SEED_OVERFLOW = ()  # fixed; was a 500
TINY_SAMPLING = ()  # fixed; was a 500
IMAGE_TOKEN = ()  # fixed; was a 500
FORMER_5XX = [
    pytest.param(CHAT, hi(seed=2**70, temperature=1.0, max_tokens=2), marks=SEED_OVERFLOW,
                 id="chat-seed-above-64-bits"),
    pytest.param(CHAT, hi(seed=-2**63 - 1, temperature=1.0, max_tokens=2), marks=SEED_OVERFLOW,
                 id="chat-seed-below-int64"),
    pytest.param(GEN, {"prompt": "hello", "seed": 2**64, "temperature": 0.5, "max_tokens": 2},
                 marks=SEED_OVERFLOW, id="generate-seed-2-to-the-64"),
    pytest.param(CHAT, hi(temperature=1e-300, max_tokens=2), marks=TINY_SAMPLING, id="chat-temperature-1e-300"),
    pytest.param(COMP, {"prompt": "hello", "temperature": 1e-45, "max_tokens": 2}, marks=TINY_SAMPLING,
                 id="completions-temperature-1e-45"),
    pytest.param(CHAT, hi(temperature=1.0, top_p=1e-300, max_tokens=2), marks=TINY_SAMPLING,
                 id="chat-top-p-1e-300"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "what does <image> mean?"}], "max_tokens": 2},
                 marks=IMAGE_TOKEN, id="chat-image-token-typed-as-text"),
    pytest.param(CHAT, chat(image(GOOD_URL), text("<image>"), max_tokens=2), marks=IMAGE_TOKEN,
                 id="chat-image-token-typed-next-to-an-image"),
    pytest.param(GEN, {"prompt": "<image> hi", "max_tokens": 2}, marks=IMAGE_TOKEN,
                 id="generate-image-token-in-prompt"),
]


@pytest.mark.parametrize("path,body", FORMER_5XX)
def test_client_input_never_causes_a_5xx(path, body, servers, http):
    """Inputs the fuzzer found that once caused 500s (seed overflow, NaN sampling, a typed placeholder)."""
    response = http.post(servers["main"].base_url + path, json=body)
    assert response.status_code < 500, response.text


def test_outbound_guard_sees_a_real_fetch(make_server, trap, monkeypatch, assert_error):
    """The corpus's 'no connection attempted' check is not vacuous: a fetch that is allowed is caught."""
    loose = make_server(media=MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True,
                                          fetch_timeout_s=1.0))
    attempts = guard_outbound(monkeypatch, {int(loose.base_url.rsplit(":", 1)[1])})
    port = trap.getsockname()[1]
    with httpx.Client(timeout=30, trust_env=False) as client:
        response = client.post(loose.base_url + CHAT, json=chat(image(f"http://127.0.0.1:{port}/cat.png"), text()))
    assert_error(response, 400, "media_fetch_failed", "messages[0].content[0]")
    assert attempts == [("127.0.0.1", port)]


# Runs after the corpus (pytest keeps file order): the server is unharmed by all of it.
def test_server_is_healthy_and_correct_after_the_corpus(servers, http, trap):
    base = servers["main"].base_url
    health = http.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    reply = http.post(base + CHAT, json=chat(image(GOOD_URL), text()))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == scenes.describe_answer(SCENE)
    generated = http.post(base + GEN, json={"prompt": "How many shapes are there?",
                                            "image": "file://" + str(Path(servers["main"].settings.media
                                                                          .allowed_media_dirs[0]) / "scene.png")})
    assert generated.status_code == 200 and generated.json()["text"] == scenes.count(SCENE).answer
    # Refused images were counted as modality errors, by reason.
    metrics = http.get(base + "/metrics").text
    for reason in ("invalid_image", "unsupported_image_format", "image_too_large", "media_source_forbidden",
                   "image_not_found", "too_many_images", "image_placeholder_mismatch", "media_fetch_failed"):
        assert f'fovea_modality_mismatch_errors_total{{reason="{reason}"}}' in metrics, reason
    # Nothing ever connected to the trap listener.
    readable, _, _ = select.select([trap], [], [], 0)
    assert not readable, "a fetch reached the loopback trap listener"
