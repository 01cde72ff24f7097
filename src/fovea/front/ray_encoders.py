"""The shared encode workers on Ray: N ``encode_server`` processes, each hosted by an actor on
the node Ray placed it on, listening on a Unix socket there (for PD workers on that node: the
tensors in shared memory) and on a TCP port of the node's address (for the others).

A worker is ready once its socket exists on its node (it listens only once its vision part is
loaded). One that exits, or whose actor Ray restarts, is started again; each time it is ready
the front hands every PD worker the new table (``on_change``), since it may be on another node
now. ``EncodeFleet``'s interface, so the front treats both alike.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from fovea.front.children import ENCODE_KEY_ENV, pd_worker_env
from fovea.front.encoders import backoff_s
from fovea.front.ray_hosts import DIR, HOST, PORT, RayProcess

log = logging.getLogger("fovea.front")

SOCKET = "encode.sock"


@dataclass
class RayEncodeWorker:
    index: int
    child: RayProcess
    state: str = "starting"  # starting | ready | dead | stopped
    restarts: int = 0
    failures: int = 0
    died_at: float = 0.0

    def entry(self) -> dict | None:
        """How PD workers reach it: its socket on its node, its TCP address."""
        placement = self.child.placed()
        if placement is None:
            return None
        return {"socket": f"{placement.dir}/{SOCKET}", "tcp": f"{placement.host}:{placement.port}",
                "node": placement.node}

    def status(self) -> dict:
        placement = self.child.placed()
        return {"index": self.index, "pid": self.child.pid, "state": self.state if placement or
                self.state != "starting" else "placing", "restarts": self.restarts,
                "node": placement.node if placement else None, "entry": self.entry()}


class RayEncodeFleet:
    """``args``: what ``encode_server.serve`` takes after the socket and the key (model dir,
    device, dtype, images per batch, fused vision, log level)."""

    def __init__(self, workers: int, authkey: bytes, args: tuple, resources: dict[str, float]) -> None:
        self.authkey, self.args, self.resources = authkey, args, resources
        self.count = workers
        self.procs: list[RayEncodeWorker] = []
        self.on_change: Callable[[list[dict | None]], None] = lambda entries: None

    def start(self) -> None:
        self.procs = [RayEncodeWorker(i, RayProcess(f"encode-{i}", self.resources, spread=False))
                      for i in range(self.count)]
        for proc in self.procs:
            self._launch(proc)

    def _command(self) -> list[str]:
        model, device, dtype, batch_images, fused, log_level = self.args
        command = [sys.executable, "-m", "fovea.disagg.encode_server", "--socket", f"{DIR}/{SOCKET}",
                   "--tcp", f"{HOST}:{PORT}", "--device", device, "--dtype", dtype, "--log-level", log_level,
                   "--fused-vision", {None: "auto", True: "on", False: "off"}[fused]]
        if model is not None:
            command += ["--model", model]
        if batch_images is not None:
            command += ["--batch-images", str(batch_images)]
        return command

    def _launch(self, proc: RayEncodeWorker) -> None:
        env = pd_worker_env("", self.authkey)
        proc.child.launch(self._command(), {"PYTHONPATH": env["PYTHONPATH"], ENCODE_KEY_ENV: env[ENCODE_KEY_ENV]})
        proc.state = "starting"

    @property
    def sockets(self) -> list[str]:
        """The PD workers' ``--internal-encode-socket`` values: each worker's table entry."""
        import json

        return [json.dumps(e) for e in self.entries()]

    def entries(self) -> list[dict | None]:
        return [p.entry() for p in self.procs]

    def ready(self) -> bool:
        return all(p.state == "ready" for p in self.procs)

    def check(self) -> None:
        changed = False
        for proc in self.procs:
            if proc.state == "stopped":
                continue
            if proc.child.exited():
                if proc.state != "dead":
                    log.warning("encode worker %d (pid %s) exited: %s", proc.index, proc.child.pid,
                                proc.child.exit_code())
                    proc.failures += proc.state == "starting"
                    proc.state, proc.died_at = "dead", time.monotonic()
                if time.monotonic() - proc.died_at >= backoff_s(proc.failures):
                    proc.restarts += 1
                    self._launch(proc)
                continue
            if proc.state == "starting" and proc.child.placed() is not None and proc.child.exists(SOCKET):
                proc.state, proc.failures = "ready", 0
                entry = proc.entry()
                log.info("encode worker %d (pid %s) is ready on node %s: %s, %s", proc.index, proc.child.pid,
                         entry["node"], entry["socket"], entry["tcp"])  # type: ignore[index]
                changed = True
        if changed:
            self.on_change(self.entries())

    def failed_to_start(self) -> RayEncodeWorker | None:
        """A worker whose child exited before it was ever ready (start-up only: the front gives up)."""
        return next((p for p in self.procs if p.state == "starting" and p.restarts == 0 and p.child.exited()
                     and p.child.placed() is not None), None)

    def status(self) -> list[dict]:
        return [p.status() for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            proc.state = "stopped"
            proc.child.terminate()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.child.finish(deadline)
