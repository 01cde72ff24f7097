"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from fovea.config import ServerSettings
from fovea.engine.engine import Engine
from fovea.guard.canary import Canary
from fovea.media import ImageStore, MediaResolver
from fovea.model.contract import ModelContract
from fovea.model.loader import LoadedModel
from fovea.serve.metrics import Metrics


@dataclass
class ServerState:
    settings: ServerSettings
    loaded: LoadedModel
    engine: Engine
    store: ImageStore
    resolver: MediaResolver
    model_name: str
    default_temperature: float  # from the model's generation_config: greedy unless it samples
    default_top_p: float
    contract: ModelContract
    metrics: Metrics
    canary: Canary

    def health(self) -> tuple[str, list[str]]:
        """("ok" | "degraded", reasons)."""
        reasons: list[str] = []
        last = self.canary.last
        if self.settings.canary and last is not None and not last.ok:
            reasons.extend(last.reasons)
        return ("degraded" if reasons else "ok"), reasons

    def warnings(self) -> list[str]:
        if self.contract.override_forced:
            return ["preprocessing override forced: normalisation differs from the model's own "
                    f"({self.contract.processor_override})"]
        return []

    @classmethod
    def build(cls, settings: ServerSettings, loaded: LoadedModel, engine: Engine, contract: ModelContract,
              metrics: Metrics) -> "ServerState":
        gen = loaded.model.generation_config
        sampling = bool(getattr(gen, "do_sample", False))
        store = ImageStore(settings.media)
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
            canary=Canary(loaded, engine, media=settings.media),
        )
