import pytest
from PIL import Image

from fovea.loading.prompt import PlaceholderMismatch, encode_prompt, render_chat


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


IMAGE = {"type": "image"}
TEXT = {"type": "text", "text": "Describe the image."}


def test_one_image_expands_to_the_vision_tower_feature_count(demo_model):
    text = render_chat(demo_model, user(IMAGE, TEXT))
    enc = encode_prompt(demo_model, text, [Image.new("RGB", (200, 100), "white")])
    assert enc.input_ids.count(demo_model.image_token_id) == 64
    assert [tuple(im.pixels.shape) for im in enc.images] == [(3, 128, 128)]
    assert enc.images[0].pixels.dtype == demo_model.dtype and enc.image_token_counts == [64]


def test_two_images_and_text_only(demo_model):
    text = render_chat(demo_model, user(IMAGE, IMAGE, TEXT))
    img = Image.new("RGB", (64, 64), "white")
    assert encode_prompt(demo_model, text, [img, img]).input_ids.count(demo_model.image_token_id) == 128
    plain = encode_prompt(demo_model, render_chat(demo_model, user(TEXT)), [])
    assert plain.images == [] and demo_model.image_token_id not in plain.input_ids


def test_a_template_that_drops_the_placeholder_is_refused(demo_model):
    text = render_chat(demo_model, user(TEXT))  # rendered without the image part
    with pytest.raises(PlaceholderMismatch, match="0 image placeholder"):
        encode_prompt(demo_model, text, [Image.new("RGB", (64, 64))])


def test_raw_prompt_placeholder_count_must_match(demo_model):
    with pytest.raises(PlaceholderMismatch) as info:
        encode_prompt(demo_model, "user: <image> <image> describe", [Image.new("RGB", (64, 64))],
                      template_rendered=False)
    assert info.value.status == 400 and info.value.code == "image_placeholder_mismatch"
