"""Valid but unusual images reach the model as the same picture as their plain RGB PNG.

Each variant is made from a drawn scene and sent through the server; its answer must equal the answer
for the plain RGB PNG of the same scene. Conversions that lose colour (greyscale, 1-bit, 16-bit grey)
are asked "How many shapes are there?"; colour-preserving ones "Describe the image.".
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from scene_helpers import fresh_scene

from fovea.demo import scenes
from fovea.media import MediaConfig

DESCRIBE, COUNT = "Describe the image.", "How many shapes are there?"
# Clean (no JPEG round trip) scenes with two or three shapes; seeds chosen from a range no other test uses.
SCENES = [fresh_scene(7100 + i, min_shapes=2, jpeg_probability=0.0) for i in range(3)]
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp",
        "TIFF": "image/tiff"}


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    im.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def data_url(data: bytes, fmt: str) -> str:
    return f"data:{MIME[fmt]};base64," + base64.b64encode(data).decode()


def white_mask(rgb: Image.Image) -> np.ndarray:
    return (np.asarray(rgb) >= 250).all(axis=-1)


# ---- the variants: RGB scene image -> (encoded bytes, format) --------------------------------------

def grey(im):
    return encode(im.convert("L"), "PNG"), "PNG"


def one_bit(im):
    return encode(im.convert("1"), "PNG"), "PNG"  # Floyd-Steinberg dithered, as PIL does by default


def grey_16bit(im):
    arr = np.asarray(im.convert("L")).astype(np.uint16) * 257
    sixteen = Image.fromarray(arr)
    assert sixteen.mode == "I;16"
    return encode(sixteen, "PNG"), "PNG"


def grey_jpeg(im):
    return encode(im.convert("L"), "JPEG", quality=95), "JPEG"


def grey_alpha(im):
    """LA with a transparent background whose grey value is black: only compositing gives white."""
    grey_arr = np.asarray(im.convert("L")).copy()
    transparent = white_mask(im)
    grey_arr[transparent] = 0
    alpha = np.where(transparent, 0, 255).astype(np.uint8)
    return encode(Image.merge("LA", (Image.fromarray(grey_arr), Image.fromarray(alpha))), "PNG"), "PNG"


def palette(im):
    return encode(im.quantize(colors=64), "PNG"), "PNG"


def palette_transparent(im):
    """P with the background's palette entry made black and marked transparent (tRNS)."""
    p = im.quantize(colors=64)
    background = p.getpixel((0, 0))
    pal = p.getpalette()
    pal[3 * background: 3 * background + 3] = [0, 0, 0]
    p.putpalette(pal)
    return encode(p, "PNG", transparency=background), "PNG"


def rgba_transparent(im):
    """RGBA whose fully transparent background pixels are black underneath."""
    arr = np.asarray(im).copy()
    transparent = white_mask(im)
    arr[transparent] = 0
    alpha = np.where(transparent, 0, 255).astype(np.uint8)
    return encode(Image.fromarray(np.dstack([arr, alpha]), "RGBA"), "PNG"), "PNG"


def rgba_opaque(im):
    return encode(im.convert("RGBA"), "PNG"), "PNG"


def cmyk_jpeg(im):
    cmyk = im.convert("CMYK")
    data = encode(cmyk, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    return data, "JPEG"


def exif_rotated(orientation: int) -> Callable:
    # Store the pixels turned so that applying the EXIF orientation turns them back upright.
    undo = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}[orientation]

    def make(im):
        stored = im.transpose(undo)
        exif = Image.Exif()
        exif[0x0112] = orientation
        return encode(stored, "JPEG", quality=95, exif=exif.tobytes()), "JPEG"

    return make


def progressive_jpeg(im):
    return encode(im, "JPEG", quality=95, progressive=True, subsampling=0), "JPEG"


def webp_lossy(im):
    return encode(im, "WEBP", quality=90), "WEBP"


def webp_lossless(im):
    return encode(im, "WEBP", lossless=True), "WEBP"


def webp_alpha(im):
    return encode(Image.open(io.BytesIO(rgba_transparent(im)[0])), "WEBP", lossless=True), "WEBP"


def gif(im):
    return encode(im.quantize(colors=128), "GIF"), "GIF"


def gif_animated(im):
    """The scene is the first frame; a blank second frame must not be what the model sees."""
    first = im.quantize(colors=128)
    blank = Image.new("RGB", im.size, (30, 70, 220)).quantize(colors=2)
    return encode(first, "GIF", save_all=True, append_images=[blank], duration=100, loop=0), "GIF"


def bmp(im):
    return encode(im, "BMP"), "BMP"


def tiff(im):
    return encode(im, "TIFF"), "TIFF"


def tiff_lzw(im):
    return encode(im, "TIFF", compression="tiff_lzw"), "TIFF"


VARIANTS: dict[str, tuple[Callable, str]] = {
    "grayscale-L": (grey, COUNT),
    "1-bit": (one_bit, COUNT),
    "grey-16-bit-I;16": (grey_16bit, COUNT),
    "grayscale-jpeg": (grey_jpeg, COUNT),
    "LA-transparent-background": (grey_alpha, COUNT),
    "palette-P": (palette, DESCRIBE),
    "palette-P-transparent": (palette_transparent, DESCRIBE),
    "RGBA-transparent-background": (rgba_transparent, DESCRIBE),
    "RGBA-opaque": (rgba_opaque, DESCRIBE),
    "CMYK-jpeg": (cmyk_jpeg, DESCRIBE),
    "exif-orientation-3": (exif_rotated(3), DESCRIBE),
    "exif-orientation-6": (exif_rotated(6), DESCRIBE),
    "exif-orientation-8": (exif_rotated(8), DESCRIBE),
    "progressive-jpeg": (progressive_jpeg, DESCRIBE),
    "webp-lossy": (webp_lossy, DESCRIBE),
    "webp-lossless": (webp_lossless, DESCRIBE),
    "webp-alpha": (webp_alpha, DESCRIBE),
    "gif": (gif, DESCRIBE),
    "gif-animated": (gif_animated, DESCRIBE),
    "bmp": (bmp, DESCRIBE),
    "tiff": (tiff, DESCRIBE),
    "tiff-lzw": (tiff_lzw, DESCRIBE),
}


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("unusual-media")


@pytest.fixture(scope="module")
def server(make_server, media_dir):
    return make_server(media=MediaConfig(allowed_media_dirs=(media_dir,)))


@pytest.fixture(scope="module")
def http() -> httpx.Client:
    with httpx.Client(timeout=60, trust_env=False) as client:
        yield client


def ask(http: httpx.Client, server, ref: str, question: str) -> str:
    body = {"model": "fovea-shapes", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": question}]}]}
    response = http.post(server.base_url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def plain_answers(http, server) -> dict[tuple[int, str], str]:
    answers = {}
    for i, scene in enumerate(SCENES):
        url = data_url(encode(scenes.render(scene), "PNG"), "PNG")
        for question in (DESCRIBE, COUNT):
            answers[i, question] = ask(http, server, url, question)
        # The scenes are ones the model gets right, so "same answer" also means "right answer".
        assert answers[i, DESCRIBE] == scenes.describe_answer(scene)
        assert answers[i, COUNT] == scenes.count(scene).answer
    return answers


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("scene_index", range(len(SCENES)))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unusual_image_gets_the_plain_answer(variant, scene_index, http, server, plain_answers):
    make, question = VARIANTS[variant]
    data, fmt = make(scenes.render(SCENES[scene_index]))
    assert Image.open(io.BytesIO(data)).format == fmt
    assert ask(http, server, data_url(data, fmt), question) == plain_answers[scene_index, question]


def test_upright_size_of_an_exif_rotated_upload(http, server):
    image = scenes.render(SCENES[0])
    data, _ = exif_rotated(6)(image)
    assert Image.open(io.BytesIO(data)).size == image.size[::-1]  # stored sideways
    stored = http.post(server.base_url + "/v1/images", content=data, headers={"content-type": "image/jpeg"})
    assert stored.status_code == 200, stored.text
    assert (stored.json()["width"], stored.json()["height"]) == image.size


def test_uploaded_once_and_used_twice(http, server, plain_answers):
    scene = SCENES[1]
    png = encode(scenes.render(scene), "PNG")
    upload = http.post(server.base_url + "/v1/images", files={"file": ("scene.png", png, "image/png")})
    assert upload.status_code == 200, upload.text
    meta = upload.json()
    assert meta["id"].startswith("img-") and meta["bytes"] == len(png)
    assert (meta["width"], meta["height"]) == (scene.width, scene.height)
    assert http.get(server.base_url + f"/v1/images/{meta['id']}").json()["id"] == meta["id"]
    # Used twice, for two different questions; both answers match the inline PNG's.
    assert ask(http, server, meta["id"], DESCRIBE) == plain_answers[1, DESCRIBE]
    assert ask(http, server, meta["id"], COUNT) == plain_answers[1, COUNT]
    # The same bytes uploaded as JSON get the same id (content-addressed).
    again = http.post(server.base_url + "/v1/images", json={"image": data_url(png, "PNG")})
    assert again.status_code == 200 and again.json()["id"] == meta["id"]
    # ... and /v1/completions and /generate accept the id too.
    completion = http.post(server.base_url + "/v1/completions", json={
        "prompt": "user: <image> Describe the image. assistant:", "images": [meta["id"]]})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"].strip() == plain_answers[1, DESCRIBE]
    generated = http.post(server.base_url + "/generate", json={"prompt": COUNT, "image": meta["id"]})
    assert generated.status_code == 200 and generated.json()["text"] == plain_answers[1, COUNT]


@pytest.mark.parametrize("variant", ["plain-png", "exif-orientation-8", "RGBA-transparent-background"])
def test_file_url_from_the_allowed_dir(variant, http, server, media_dir, plain_answers):
    image = scenes.render(SCENES[2])
    data = encode(image, "PNG") if variant == "plain-png" else VARIANTS[variant][0](image)[0]
    path = media_dir / f"{variant}.img"
    path.write_bytes(data)
    assert ask(http, server, path.as_uri(), DESCRIBE) == plain_answers[2, DESCRIBE]
    # file://localhost/... names the same file.
    assert ask(http, server, "file://localhost" + str(path), DESCRIBE) == plain_answers[2, DESCRIBE]
