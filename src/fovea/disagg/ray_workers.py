"""Encode workers as Ray actors, on an existing Ray cluster (``--ray-address``) or a local one.

The actor hosts the same ``EncodeService`` as a local worker process; messages travel as bytes
through Ray's object store, tensors inline (never pickled). A dead actor surfaces as ``WorkerLost``,
and one that does not answer within the timeout is killed: the pool restarts both.
"""

from __future__ import annotations

import contextlib
import logging

from fovea.disagg import wire
from fovea.disagg.channels import WorkerLost
from fovea.errors import FoveaError

log = logging.getLogger("fovea.disagg")

_ACTOR = None


def ray_module():
    try:
        import ray
    except ImportError as exc:
        raise FoveaError("--ray-address needs Ray: pip install 'fovea[ray]' (or ray>=2.50)") from exc
    return ray


def join_on_loopback(ray) -> None:
    """A cluster whose nodes bind to loopback (one machine, tests) is joined on loopback. Ray
    rewrites a 127.0.0.1 address to this machine's outward address, where nothing of that
    cluster listens, unless it believes it runs on a laptop (the switch below, read at each
    rewrite; its environment variable, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, only before import)."""
    with contextlib.suppress(AttributeError):
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def connect(address: str, log_to_driver: bool = False) -> None:
    """Join the cluster at ``address`` ("local": start one on this machine), once per process.
    ``log_to_driver``: the actors' output (a front's workers' logs) printed here too."""
    ray = ray_module()
    if ray.is_initialized():
        return
    if address == "local":
        ray.init(include_dashboard=False, log_to_driver=log_to_driver)
    else:
        loopback = address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
        if loopback:
            join_on_loopback(ray)
        ray.init(address=address, include_dashboard=False, log_to_driver=log_to_driver,
                 **({"_node_ip_address": "127.0.0.1"} if loopback else {}))
    log.info("joined the Ray cluster at %s: %s", address, ray.cluster_resources())


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        ray = ray_module()

        @ray.remote(max_restarts=0)
        class EncodeActor:
            def __init__(self, model_dir: str, device: str, dtype: str, batch_images: int,
                         fused_vision: bool) -> None:
                import torch

                from fovea.disagg.encode_worker import EncodeService, error_frame

                torch.set_num_threads(1)
                self.service, self.failure = None, None
                try:
                    self.service = EncodeService(model_dir, device, dtype, batch_images, fused_vision)
                except Exception as exc:  # noqa: BLE001 - reported by ready(), as a local worker does
                    self.failure = error_frame(exc)

            def ready(self) -> bytes:
                return self.failure if self.service is None else self.service.ready_frame()

            def handle(self, request: bytes) -> bytes:
                return self.service.handle(request)

        _ACTOR = EncodeActor
    return _ACTOR


class RayChannel:
    def __init__(self, index: int, model_dir: str, device: str, dtype: str, batch_images: int,
                 fused_vision: bool = False) -> None:
        ray = ray_module()
        # A GPU worker asks Ray for a sliver of a GPU: its memory plan, not Ray, sizes what it takes.
        options = {"num_cpus": 1, "num_gpus": 0.01 if device.startswith("cuda") else 0}
        self.ray = ray
        self.actor = _actor_class().options(**options).remote(model_dir, device, dtype, batch_images, fused_vision)
        self.pid = None  # a Ray worker's pid is not this machine's to signal
        self.index = index

    def _get(self, ref, timeout: float):
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError as exc:
            raise WorkerLost(f"did not answer within {timeout:g} s (--encode-timeout)") from exc
        except self.ray.exceptions.RayActorError as exc:
            raise WorkerLost(f"died ({type(exc).__name__})") from exc

    def ready(self, timeout: float) -> bytes:
        try:
            return self._get(self.actor.ready.remote(), timeout)
        except WorkerLost as exc:
            raise TimeoutError(str(exc)) from exc

    def alive(self) -> bool:
        return True  # a dead actor shows at its next batch (RayActorError)

    def round_trip(self, items: list[wire.Item], reply_bytes: int, timeout: float) -> list[wire.Item]:
        """Tensors inline: the message is bytes in the object store."""
        return wire.decode(self._get(self.actor.handle.remote(wire.encode(items)), timeout))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(self.actor)
