"""What a request asks its answer to match, in one canonical form that is also the cache key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fovea.errors import FoveaError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputError(FoveaError):
    """A structured sequence sampled a token its grammar does not accept (a masking bug), or
    reached a state where no token of the vocabulary can go on."""

    status, code, type = 500, "structured_output_failed", "server_error"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # canonical text: a schema's compact JSON, a regex, the choices' JSON, EBNF
    param: str  # the request field it came from, named in refusals

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    @staticmethod
    def json_schema(schema: Any, param: str) -> GrammarSpec:
        # Key order is kept: xgrammar writes properties in the schema's order.
        return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @staticmethod
    def choice(options: list[str], param: str) -> GrammarSpec:
        return GrammarSpec("choice", json.dumps(list(options)), param)
