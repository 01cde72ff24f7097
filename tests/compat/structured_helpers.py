"""Shared pieces of the structured-output and tool tests: a live server on a byte-level model."""

from __future__ import annotations

import base64
import io

from PIL import Image

# Bounded schemas: random weights cannot run on forever inside them (no free-length strings).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "admin": {"type": "boolean"}}, "required": ["name", "age", "admin"], "additionalProperties": False}
SHAPE = {"type": "object", "properties": {
    "shape": {"enum": ["circle", "square", "triangle"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 1, "maxItems": 3}},
    "required": ["shape", "count", "colors"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                          "label": {"type": "string", "enum": ["a", "b"]}},
         "required": ["x", "label"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "shape": SHAPE, "point": POINT}


def image_url(color: tuple[int, int, int] = (200, 30, 30), size: int = 56) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, image: bool = False) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url()}})
    return [{"role": "user", "content": content}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
