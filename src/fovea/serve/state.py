"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fovea.config import ServerSettings
from fovea.engine.engine import PagedEngine
from fovea.guard.canary import Canary
from fovea.loading.contract import ModelContract
from fovea.loading.loader import LoadedModel
from fovea.media import ImageStore, MediaResolver
from fovea.serve.metrics import Metrics
from fovea.serve.preprocess import Preprocessor
from fovea.serve.structured import build_grammar_compiler


@dataclass
class ServerState:
    settings: ServerSettings
    loaded: LoadedModel
    engine: PagedEngine
    store: ImageStore
    resolver: MediaResolver
    model_name: str
    default_temperature: float  # from the model's generation_config: greedy unless it samples
    default_top_p: float
    contract: ModelContract
    metrics: Metrics
    canary: Canary
    preprocessor: Preprocessor
    grammars: Any = None  # structured outputs' GrammarCompiler; None: xgrammar is not installed

    def health(self) -> tuple[str, list[str]]:
        """("ok" | "degraded" | "starting", reasons). "starting": under --api-server-count, not every
        API process has finished its start-up yet (a client that waits for ready would load one)."""
        reasons: list[str] = []
        last = self.canary.last
        if self.settings.canary and last is not None and not last.ok and self.canary_meaningful:
            reasons.extend(last.reasons)
        servers = self.api_servers()
        if servers is not None and servers["serving"] < servers["of"]:
            reasons.append(f"{servers['serving']} of {servers['of']} API processes are serving "
                           "(--api-server-count); the others are starting")
            if not self.engine.all_api_serving_seen:
                return "starting", reasons
        return ("degraded" if reasons else "ok"), reasons

    def api_servers(self) -> dict[str, int] | None:
        """Under --api-server-count N > 1: how many API processes serve, of N (the core's last stats)."""
        if self.settings.api_server_count <= 1:
            return None
        return {"serving": self.engine.api_serving, "of": self.settings.api_server_count}

    @property
    def canary_meaningful(self) -> bool:
        """False with --load-format dummy: random weights cannot look at an image, so the canary's
        verdict says nothing (it still runs: it exercises the whole serving path)."""
        return self.contract.load_format != "dummy"

    def warnings(self) -> list[str]:
        warnings = []
        if self.contract.override_forced:
            warnings.append("preprocessing override forced: normalisation differs from the model's own "
                            f"({self.contract.processor_override})")
        if self.contract.load_format == "dummy":
            warnings.append("--load-format dummy: the weights are random; answers and the canary's verdict mean nothing")
        return warnings

    @classmethod
    def build(cls, settings: ServerSettings, loaded: LoadedModel, engine: PagedEngine, contract: ModelContract,
              metrics: Metrics) -> ServerState:
        gen = loaded.model.generation_config
        sampling = bool(getattr(gen, "do_sample", False))
        store = ImageStore(settings.media)
        preprocessor = Preprocessor(loaded, settings.media, preprocess_workers(settings, loaded),
                                    contract.recipe_fingerprint, observe=metrics.prepare.observe)
        return cls(
            settings=settings,
            loaded=loaded,
            engine=engine,
            store=store,
            resolver=MediaResolver(settings.media, store),
            model_name=settings.served_model_name or loaded.name,
            default_temperature=float(gen.temperature or 1.0) if sampling else 0.0,
            default_top_p=float(gen.top_p or 1.0) if sampling else 1.0,
            contract=contract,
            metrics=metrics,
            canary=Canary(loaded, engine, media=settings.media, prompts=preprocessor.prompts),
            preprocessor=preprocessor,
            grammars=build_grammar_compiler(loaded, lm_head_rows(loaded, engine)),
        )


def preprocess_workers(settings: ServerSettings, loaded: LoadedModel) -> int:
    """--preprocess-workers, by default 0: this process's threads. Measured on the H200 machine
    (bench/preprocess_probe.py, LLaVA-1.5-7B's processor, docs/benchmarks.md): threads prepared
    245 requests/s; 7 worker processes 6 requests/s, their first requests stalling 10-40 s."""
    return settings.preprocess_workers or 0


def lm_head_rows(loaded: LoadedModel, engine: Any) -> int:
    """The width of the logits the sampler sees (the LM head's rows, padding included)."""
    rows = getattr(engine, "vocab_size", None)  # the engine's LM head (its own process's or the core's)
    if rows is not None:
        return int(rows)
    return int(loaded.model.get_output_embeddings().weight.shape[0])
