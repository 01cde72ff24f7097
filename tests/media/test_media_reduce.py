"""Large images are brought to about twice the model's input before its processor resizes them:
JPEGs decoded at a reduced DCT scale, others box-reduced; the result is the same picture."""

import io

import numpy as np
import pytest
from PIL import Image

from fovea.media import MediaConfig, decode_image_bytes


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour waves and sensor noise: JPEG-like content, not flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 5), rng.uniform(0.5, 5), rng.uniform(0, 6.28)
        img[..., c] = np.sin(x / width * fx * 6.28 + phase) * np.cos(y / height * fy * 6.28)
    img = (img + 1) * 100 + 20 + rng.normal(0, 6, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=92)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt, size, expected", [
    ("JPEG", (2800, 2100), (1400, 1050)),  # DCT scale 1/2: at least twice 336 on the short side
    ("JPEG", (6000, 4000), (1500, 1000)),  # 1/4
    ("PNG", (2800, 2100), (934, 700)),  # box-reduced by 3 after decoding (700 >= 2 x 336)
    ("PNG", (1300, 1300), (1300, 1300)),  # under four times the input: untouched
    ("JPEG", (336, 336), (336, 336)),
])
def test_large_images_come_out_at_about_twice_the_input(fmt, size, expected):
    data = encoded(photo(*size), fmt)
    assert decode_image_bytes(data, MediaConfig(), reduce_to=336).size == expected
    assert decode_image_bytes(data, MediaConfig(prereduce=False), reduce_to=336).size == size
    assert decode_image_bytes(data, MediaConfig()).size == size  # no target given: nothing to reduce to


def test_the_processor_sees_the_same_picture(demo_model):
    """Through the demo model's own processor the two-step resize differs by less than one 8-bit level
    on average (measured: 0.17 for the JPEG, 0.60 for the PNG; at most 1 and 4 levels)."""
    processor = demo_model.processor.image_processor
    for fmt in ("JPEG", "PNG"):
        data = encoded(photo(2048, 1536, seed=3), fmt)
        exact = processor(decode_image_bytes(data, MediaConfig(prereduce=False)), return_tensors="pt")
        reduced = processor(decode_image_bytes(data, MediaConfig(), reduce_to=128), return_tensors="pt")
        diff = (exact["pixel_values"] - reduced["pixel_values"]).abs()
        level = 1 / 255 / 0.26  # one 8-bit level in normalised units
        assert diff.mean() < level and diff.max() < 6 * level, (fmt, diff.mean(), diff.max())


def test_a_large_scene_is_answered_like_the_small_one(demo_model):
    from scene_helpers import fresh_scene, run_all

    from fovea.demo import scenes
    from fovea.engine import PagedEngine, PagedEngineConfig
    from fovea.engine.sampling.params import SamplingParams
    from fovea.loading.prompt import encode_prompt, render_chat

    scene = fresh_scene(5150)
    small = scenes.render(scene)
    large = small.resize((small.width * 8, small.height * 8), Image.NEAREST)
    text = render_chat(demo_model, [{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "Describe the image."}]}])
    prompts = [encode_prompt(demo_model, text, [decode_image_bytes(encoded(im, "JPEG"), MediaConfig(), reduce_to=128)])
               for im in (small, large)]
    (_, a), (_, b) = run_all(PagedEngine(demo_model, PagedEngineConfig(num_blocks=64)),
                             [(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts])
    assert a.text == b.text == scenes.describe_answer(scene)
