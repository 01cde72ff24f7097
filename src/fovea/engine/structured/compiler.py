"""Grammars compiled off the request path, once per distinct source, kept in an LRU.

Compiling a JSON schema takes milliseconds to seconds of CPU: it runs on this module's own
threads, never on the event loop or the engine's worker. Concurrent requests for the same
source share one compilation. ``TokenizerInfo`` (each token's bytes, for xgrammar) is built
once per model, with the LM head's row count: rows past the tokenizer's vocabulary (padding)
are tokens no grammar allows, so they are always masked.

What it hands out is a ``Grammar``: the compiled grammar, and whether this vocabulary can begin
words it cannot finish (``dead_ends``), which the masks then check for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from fovea.engine.structured.dead_ends import Budget, can_finish, spells_every_byte
from fovea.engine.structured.spec import GrammarSpec
from fovea.errors import InvalidRequest

DEFAULT_CAPACITY = 256  # compiled grammars kept (a JSON schema's is typically tens of kB)


class GrammarRefused(InvalidRequest):
    """A 400 whose code names the problem: invalid_json_schema, invalid_regex, invalid_grammar,
    grammar_unsatisfiable."""


_CODES = {"json_schema": "invalid_json_schema", "json_object": "invalid_json_schema",
          "regex": "invalid_regex", "choice": "invalid_choice", "grammar": "invalid_grammar",
          "structural_tag": "invalid_tool_parameters"}


def choice_regex(options: list[str]) -> str:
    """A regex matching exactly one of ``options`` (each taken literally)."""
    return "(" + "|".join(_literal(o) for o in options) + ")"


_META = set("\\^$.|?*+()[]{}/-")


def _literal(text: str) -> str:
    # Not re.escape: it escapes spaces and other characters xgrammar's regex dialect does not know.
    return "".join("\\" + c if c in _META else c for c in text)


@dataclass(frozen=True, slots=True)
class Grammar:
    compiled: xgr.CompiledGrammar
    vocab_size: int  # the LM head's rows, the masks' width
    dead_ends: bool  # not every byte is a token: an allowed token may have no way to the end


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 capacity: int = DEFAULT_CAPACITY, threads: int = 2) -> None:
        if vocab_size < len(tokenizer):
            raise ValueError(f"the LM head has {vocab_size} rows but the tokenizer {len(tokenizer)} tokens")
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.dead_ends = not spells_every_byte(self.info)
        # xgrammar's own cache is off: this one is bounded by entries and keyed by our canonical source.
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.capacity = capacity
        self._lru: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
        # Re-entrant: a compilation that is already done when its callback is attached (in
        # _future, under the lock) runs _store at once, in the same thread.
        self._lock = threading.RLock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fovea-grammar")
        self.compiled = 0  # compilations run (cache misses)

    async def get(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar, from the cache or compiled on this compiler's threads."""
        return await asyncio.wrap_future(self._future(spec))

    def get_now(self, spec: GrammarSpec) -> Grammar:
        """The same, blocking (benchmarks, tests)."""
        return self._future(spec).result()

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        with self._lock:
            hit = self._lru.get(spec.key)
            if hit is not None:
                self._lru.move_to_end(spec.key)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(hit)
                return done
            future = self._pending.get(spec.key)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._pending[spec.key] = future
                future.add_done_callback(lambda f, key=spec.key: self._store(key, f))
            return future

    def _store(self, key: tuple[str, str], future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if future.exception() is None:  # refusals are not cached: they are cheap to find again
                self._lru[key] = future.result()
                while len(self._lru) > self.capacity:
                    self._lru.popitem(last=False)

    def _compile(self, spec: GrammarSpec) -> Grammar:
        self.compiled += 1
        try:
            compiled = self._compile_source(spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, InvalidJSONError...
            raise GrammarRefused(f"{spec.param}: xgrammar cannot compile this {spec.kind.replace('_', ' ')}: "
                                 f"{str(exc).strip()[:500]}", code=_CODES[spec.kind], param=spec.param) from None
        grammar = Grammar(compiled, self.vocab_size, self.dead_ends)
        check_satisfiable(grammar, spec)
        return grammar

    def _compile_source(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        # Compact JSON (no free whitespace): a model cannot pad an answer with endless blanks.
        if spec.kind == "json_schema":
            schema = json.dumps(bounded_strings(json.loads(spec.source)))
            return self._xgr.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":  # OpenAI's JSON mode: any JSON object
            return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.source)
        if spec.kind == "choice":
            return self._xgr.compile_regex(choice_regex(json.loads(spec.source)))
        if spec.kind == "structural_tag":  # tool calls (serve/tools/calls.py)
            return self._xgr.compile_structural_tag(spec.source)
        return self._xgr.compile_grammar(spec.source)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def bounded_strings(node: Any) -> Any:
    """The schema with each length-bounded string (minLength/maxLength, no pattern or format)
    as a pattern of that many plain characters. xgrammar 0.2.9 compiles a length bound to a rule
    that lets raw control characters through, which is not JSON; the pattern excludes them (and
    escape sequences, which such strings then cannot hold)."""
    if isinstance(node, list):
        return [bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{"" if high is None else int(high)}}}$'
    return out


def check_satisfiable(grammar: Grammar, spec: GrammarSpec) -> None:
    """Refuse a grammar this model's vocabulary cannot write: no token begins it (a word-level
    vocabulary without ``{``, say), or, where not every byte is a token, none of the ways it
    begins can be finished (the demo's words without a space token, for "red circle"). A search
    that runs out of steps accepts the grammar: the masks check each step again."""
    matcher = xgr.GrammarMatcher(grammar.compiled)
    bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    writable = bool(bitmask.any())
    if writable and grammar.dead_ends:
        writable = can_finish(matcher, grammar.vocab_size, Budget()) is not False
    if not writable:
        raise GrammarRefused(f"{spec.param}: this model's vocabulary cannot write any answer that matches this "
                             f"{spec.kind.replace('_', ' ')} (no sequence of its tokens spells one); the model "
                             f"cannot write it.", code="grammar_unsatisfiable", param=spec.param)
