"""Structured outputs: a grammar per request (JSON schema, JSON, regex, choice, EBNF) that masks
the tokens the sampler may pick, with xgrammar.

``compiler``: grammars compiled off the request path and cached by their source (an LRU).
``matcher``: one sequence's progress through its grammar.
``bitmask``: the masks of a step's structured rows, filled on the host and applied in place to
the step's logits on the device, inside the batched sampling step.
"""

from fovea.engine.structured.spec import GrammarSpec, StructuredOutputError

__all__ = ["GrammarSpec", "StructuredOutputError"]
