"""Procedurally drawn shape scenes and the questions the demo model answers about them.

A scene is a white canvas with one to three coloured shapes, each in its own cell of a
3x3 grid. Everything here is deterministic given a ``random.Random``, so training,
evaluation, tests and the grounding canary can all draw the same world.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (140, 50, 170),
    "orange": (250, 140, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Cells in reading order (top row first, left to right) and how an answer names them.
CELLS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
WHERE: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")
TASKS: tuple[str, ...] = ("describe", "count", "color", "where", "exists")

MIN_SIDE, MAX_SIDE = 64, 512
MAX_ASPECT = 2.0  # canvases are 64-512 px a side, at most 2:1 either way
SIZE_RANGE = (0.15, 0.30)  # a shape's size as a fraction of the canvas' shorter side
JPEG_PROBABILITY = 0.5
JPEG_QUALITY = (50, 95)


@dataclass(frozen=True)
class Shape:
    colour: str
    kind: str
    cell: int  # index into CELLS
    size: float  # fraction of the canvas' shorter side
    jitter: tuple[float, float]  # position inside the free part of the cell, 0..1 each
    tint: tuple[int, int, int]  # small per-shape colour variation, added to COLOURS

    @property
    def where(self) -> str:
        return WHERE[CELLS[self.cell]]

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.kind} {self.where}"


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    shapes: tuple[Shape, ...]
    jpeg_quality: int | None = None  # set: the scene is saved as JPEG and read back

    def ordered(self) -> tuple[Shape, ...]:
        return tuple(sorted(self.shapes, key=lambda s: s.cell))


@dataclass(frozen=True)
class QA:
    task: str
    question: str
    answer: str


@dataclass
class SceneSampler:
    """Draws random scenes; the knobs exist so tests and the canary can pin them."""

    min_shapes: int = 1
    max_shapes: int = 3
    jpeg_probability: float = JPEG_PROBABILITY
    square_probability: float = 0.35
    colours: tuple[str, ...] = field(default_factory=lambda: tuple(COLOURS))

    def sample(self, rng: random.Random) -> Scene:
        width, height = _sample_canvas(rng, self.square_probability)
        n = rng.randint(self.min_shapes, self.max_shapes)
        cells = rng.sample(range(len(CELLS)), n)
        pairs = rng.sample([(c, k) for c in self.colours for k in SHAPES], n)
        shapes = tuple(
            Shape(
                colour=colour,
                kind=kind,
                cell=cell,
                size=rng.uniform(*SIZE_RANGE),
                jitter=(rng.random(), rng.random()),
                tint=tuple(rng.randint(-12, 12) for _ in range(3)),  # type: ignore[arg-type]
            )
            for cell, (colour, kind) in zip(cells, pairs)
        )
        quality = rng.randint(*JPEG_QUALITY) if rng.random() < self.jpeg_probability else None
        return Scene(width, height, shapes, quality)


def _sample_canvas(rng: random.Random, square_probability: float) -> tuple[int, int]:
    width = rng.randint(MIN_SIDE, MAX_SIDE)
    if rng.random() < square_probability:
        return width, width
    while True:
        aspect = MAX_ASPECT ** rng.uniform(-1.0, 1.0)
        height = round(width * aspect)
        if MIN_SIDE <= height <= MAX_SIDE:
            return width, height


def render(scene: Scene) -> Image.Image:
    """Draw the scene as an RGB image (JPEG round-trip included when the scene asks)."""
    image = Image.new("RGB", (scene.width, scene.height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = scene.width / 3, scene.height / 3
    short = min(scene.width, scene.height)
    for shape in scene.shapes:
        side = shape.size * short
        row, col = divmod(shape.cell, 3)
        # The shape stays inside its cell: its centre moves within the slack left over.
        cx = col * cell_w + side / 2 + shape.jitter[0] * (cell_w - side)
        cy = row * cell_h + side / 2 + shape.jitter[1] * (cell_h - side)
        x0, y0, x1, y1 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
        fill = tuple(max(0, min(255, c + t)) for c, t in zip(COLOURS[shape.colour], shape.tint))
        if shape.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    if scene.jpeg_quality is not None:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=scene.jpeg_quality)
        buffer.seek(0)
        image = Image.open(buffer).convert("RGB")
    return image


# ---- questions and answers -------------------------------------------------------------

def describe_answer(scene: Scene) -> str:
    phrases = [s.phrase for s in scene.ordered()]
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def describe(scene: Scene) -> QA:
    return QA("describe", "Describe the image.", describe_answer(scene))


def count(scene: Scene) -> QA:
    return QA("count", "How many shapes are there?", COUNT_WORDS[len(scene.shapes)])


def color_questions(scene: Scene) -> list[QA]:
    """'What color is the <shape>?' only for shape kinds that occur exactly once."""
    kinds = [s.kind for s in scene.shapes]
    return [
        QA("color", f"What color is the {s.kind}?", s.colour)
        for s in scene.shapes
        if kinds.count(s.kind) == 1
    ]


def where_questions(scene: Scene) -> list[QA]:
    return [QA("where", f"Where is the {s.colour} {s.kind}?", s.where) for s in scene.shapes]


def exists_question(scene: Scene, rng: random.Random, positive: bool) -> QA:
    """A yes/no question; negatives are near misses (right colour or right kind) when possible."""
    present = {(s.colour, s.kind) for s in scene.shapes}
    if positive:
        colour, kind = rng.choice(sorted(present))
        return QA("exists", f"Is there a {colour} {kind}?", "yes")
    absent = [(c, k) for c in COLOURS for k in SHAPES if (c, k) not in present]
    near = [p for p in absent if any(p[0] == c or p[1] == k for c, k in present)]
    colour, kind = rng.choice(near if near and rng.random() < 0.7 else absent)
    return QA("exists", f"Is there a {colour} {kind}?", "no")


def questions_for(scene: Scene, rng: random.Random) -> list[QA]:
    """One question of each task that applies to the scene (yes/no balanced over calls)."""
    qas = [describe(scene), count(scene)]
    colours = color_questions(scene)
    if colours:
        qas.append(rng.choice(colours))
    qas.append(rng.choice(where_questions(scene)))
    qas.append(exists_question(scene, rng, positive=rng.random() < 0.5))
    return qas


def all_question_texts() -> list[str]:
    """Every question the demo model is trained on (the closed world's prompts)."""
    texts = ["Describe the image.", "How many shapes are there?"]
    texts += [f"What color is the {k}?" for k in SHAPES]
    texts += [f"Where is the {c} {k}?" for c in COLOURS for k in SHAPES]
    texts += [f"Is there a {c} {k}?" for c in COLOURS for k in SHAPES]
    return texts


def vocabulary_words() -> list[str]:
    """Every word a question, an answer or the chat template uses (lower case)."""
    words: set[str] = {"user", "assistant", "system", ":", ".", "?", ",", "and", "a", "yes", "no"}
    for text in all_question_texts():
        words.update(_words(text))
    for phrase in WHERE.values():
        words.update(phrase.split())
    words.update(COUNT_WORDS)
    words.update(COLOURS)
    words.update(SHAPES)
    return sorted(words)


def _words(text: str) -> list[str]:
    out: list[str] = []
    for raw in text.lower().split():
        word = raw.rstrip(".?,:")
        if word:
            out.append(word)
        out.extend(raw[len(word):])
    return out
