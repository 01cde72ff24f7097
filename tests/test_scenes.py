import random

import numpy as np
import pytest

from fovea.demo import scenes


def sample(seed: int, **kw) -> scenes.Scene:
    return scenes.SceneSampler(**kw).sample(random.Random(seed))


@pytest.mark.parametrize("seed", range(40))
def test_scene_obeys_the_world_rules(seed):
    scene = sample(seed)
    assert scenes.MIN_SIDE <= scene.width <= scenes.MAX_SIDE
    assert scenes.MIN_SIDE <= scene.height <= scenes.MAX_SIDE
    assert max(scene.width, scene.height) / min(scene.width, scene.height) <= scenes.MAX_ASPECT + 0.02
    assert 1 <= len(scene.shapes) <= 3
    assert len({s.cell for s in scene.shapes}) == len(scene.shapes)
    assert len({(s.colour, s.kind) for s in scene.shapes}) == len(scene.shapes)
    for shape in scene.shapes:
        assert scenes.SIZE_RANGE[0] <= shape.size <= scenes.SIZE_RANGE[1]


@pytest.mark.parametrize("seed", range(25))
def test_each_shape_is_drawn_in_its_own_cell_in_its_colour(seed):
    scene = sample(seed, jpeg_probability=0.0)
    pixels = np.asarray(scenes.render(scene)).astype(int)
    assert pixels.shape == (scene.height, scene.width, 3)
    ch, cw = scene.height / 3, scene.width / 3
    occupied = {s.cell: s for s in scene.shapes}
    for cell in range(9):
        row, col = divmod(cell, 3)
        block = pixels[int(row * ch) + 1:int((row + 1) * ch) - 1, int(col * cw) + 1:int((col + 1) * cw) - 1]
        coloured = (np.abs(block - 255).sum(-1) > 60)
        if cell not in occupied:
            assert coloured.sum() == 0, f"cell {scenes.CELLS[cell]} should be empty"
            continue
        assert coloured.sum() > 0.5 * (occupied[cell].size * min(scene.width, scene.height)) ** 2 * 0.4
        mean = block[coloured].mean(0)
        expected = np.array(scenes.COLOURS[occupied[cell].colour])
        assert np.abs(mean - expected).max() < 20


def test_describe_lists_shapes_in_reading_order_with_commas_and_and():
    shape = lambda c, k, cell: scenes.Shape(c, k, cell, 0.2, (0.5, 0.5), (0, 0, 0))
    scene = scenes.Scene(100, 100, (shape("blue", "square", 4), shape("red", "circle", 0), shape("green", "triangle", 8)))
    assert scenes.describe_answer(scene) == (
        "a red circle at the top left, a blue square in the center and a green triangle at the bottom right")
    two = scenes.Scene(100, 100, (shape("blue", "square", 5), shape("red", "circle", 3)))
    assert scenes.describe_answer(two) == "a red circle on the left and a blue square on the right"
    assert scenes.count(two).answer == "two"


def test_colour_questions_only_for_unique_kinds_and_exists_is_truthful():
    shape = lambda c, k, cell: scenes.Shape(c, k, cell, 0.2, (0.5, 0.5), (0, 0, 0))
    scene = scenes.Scene(100, 100, (shape("blue", "square", 4), shape("red", "square", 0), shape("green", "circle", 8)))
    assert [q.question for q in scenes.color_questions(scene)] == ["What color is the circle?"]
    rng = random.Random(0)
    present = {(s.colour, s.kind) for s in scene.shapes}
    for _ in range(50):
        yes = scenes.exists_question(scene, rng, positive=True)
        no = scenes.exists_question(scene, rng, positive=False)
        assert yes.answer == "yes" and no.answer == "no"
        parse = lambda q: tuple(q.question.removeprefix("Is there a ").removesuffix("?").split())
        assert parse(yes) in present and parse(no) not in present


def test_sampling_is_deterministic_and_covers_jpeg_and_non_square():
    drawn = [sample(i) for i in range(300)]
    assert drawn == [sample(i) for i in range(300)]
    assert 0.35 < np.mean([s.jpeg_quality is not None for s in drawn]) < 0.65
    assert any(s.width != s.height for s in drawn) and any(s.width == s.height for s in drawn)
    assert {len(s.shapes) for s in drawn} == {1, 2, 3}
    qualities = [s.jpeg_quality for s in drawn if s.jpeg_quality]
    assert min(qualities) >= 50 and max(qualities) <= 95
