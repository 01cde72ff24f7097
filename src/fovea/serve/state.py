"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from fovea.config import ServerSettings
from fovea.engine.engine import Engine
from fovea.media import ImageStore, MediaResolver
from fovea.model.loader import LoadedModel


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

    @classmethod
    def build(cls, settings: ServerSettings, loaded: LoadedModel, engine: Engine) -> "ServerState":
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
        )
