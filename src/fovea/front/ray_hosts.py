"""The front's children as Ray actors: each PD worker and each shared encode worker is a process
that a ``ProcessHost`` actor starts on the node Ray placed it on.

Ray does what it is good at: placement by resources (a GPU worker gets its GPU from Ray, which
sets ``CUDA_VISIBLE_DEVICES`` in the actor's environment, and the child inherits it; fovea
never guesses), restarting an actor whose process or node died (on any node with the
resources, one that joins later included), and killing the actors of a front that is gone
(they are owned by its driver). The front does the rest as it does for local children: it
starts the child (``start``), learns where it listens, probes it, routes to it, and starts it
again after it exits. After Ray restarts an actor the front calls ``start`` again; a call made
while the actor waits for a node is queued by Ray until it is placed.

The child is the same program a local front runs (``fovea serve`` as a PD worker, or
``python -m fovea.disagg.encode_server``), bound to the node's address on a free port. It dies
with its actor (``parent_watch``: the actor holds its lifeline). Secrets travel as the call's
arguments, into the child's environment, never on a command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass

from fovea.disagg.parent_watch import PARENT_FD_ENV, lifeline

log = logging.getLogger("fovea.front")

# Replaced in a child's command line and environment by the actor, on its node.
HOST, PORT, DIR = "{host}", "{port}", "{dir}"
STOP_GRACE_S = 20.0


class ProcessHost:
    """The actor's body (made a Ray actor class by ``host_class``). Threaded: ``wait_child``
    blocks while ``start``, ``write`` and ``signal_child`` go on."""

    def __init__(self, label: str) -> None:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()
        self.label = label
        self.dir = tempfile.mkdtemp(prefix=f"fovea-{label}-")  # this node's: the child's socket, its tables
        self.child: subprocess.Popen | None = None
        self.token: str | None = None
        self.lifeline: int | None = None
        self.changed = threading.Condition()

    def start(self, token: str, command: list[str], env: dict[str, str], files: dict[str, str]) -> dict:
        """Start the child (ending one that still runs), with ``files`` written in its directory
        first. Returns where it runs."""
        from fovea.disagg.encoder_directory import NODE_ENV
        from fovea.front.children import free_port

        self._end(signal.SIGKILL)
        port = free_port(self.host)
        fill = lambda text: text.replace(HOST, self.host).replace(PORT, str(port)).replace(DIR, self.dir)
        for name, text in files.items():
            self.write(name, text)
        child_end, write_end = lifeline()
        environment = {**os.environ, **{k: fill(v) for k, v in env.items()}, NODE_ENV: self.node,
                       PARENT_FD_ENV: str(child_end)}
        try:
            child = subprocess.Popen([fill(a) for a in command], env=environment, pass_fds=(child_end,),
                                     start_new_session=True)
        finally:
            os.close(child_end)
        with self.changed:
            self.child, self.token, self.lifeline = child, token, write_end
            self.changed.notify_all()
        return {"node": self.node, "host": self.host, "port": port, "pid": child.pid, "dir": self.dir}

    def wait_child(self, token: str) -> int | None:
        """Until the child ``start(token, ...)`` made has exited: its exit code (None if another
        start replaced it first)."""
        with self.changed:
            self.changed.wait_for(lambda: self.token == token)
            child = self.child
        assert child is not None
        code = child.wait()
        return code if self.token == token else None

    def write(self, name: str, text: str) -> None:
        """Replace a file in the child's directory at once (a reader never sees half of it)."""
        path = os.path.join(self.dir, name)
        partial = f"{path}.partial"
        with open(partial, "w") as out:
            out.write(text)
        os.replace(partial, path)

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.dir, name))

    def signal_child(self, signum: int) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, SIGKILL after ``grace_s``; the directory removed. Returns the exit code."""
        code = self._end(signal.SIGTERM, grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def _end(self, first: int, grace_s: float = 0.0) -> int | None:
        child = self.child
        if child is None:
            return None
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(first)
            try:
                child.wait(10 if first == signal.SIGKILL else grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        return child.returncode


_HOST_CLASS = None


def host_class():
    global _HOST_CLASS
    if _HOST_CLASS is None:
        from fovea.disagg.ray_workers import ray_module

        # Restarted without limit (a node that dies takes the actor with it; Ray places it again
        # where the resources are); a call that was running when it died fails, and the front
        # starts the child again. Owned by the front's driver: gone when the front is.
        _HOST_CLASS = ray_module().remote(max_restarts=-1, max_task_retries=0, max_concurrency=8)(ProcessHost)
    return _HOST_CLASS


@dataclass
class Placement:
    """Where a child runs, as its actor reported it."""

    node: str
    host: str
    port: int
    pid: int
    dir: str


class RayProcess:
    """One child on a Ray node, as a fleet sees it: launched, placed (``placement``), exited."""

    def __init__(self, label: str, resources: dict[str, float], spread: bool) -> None:
        from fovea.disagg.ray_workers import ray_module

        self.ray = ray_module()
        resources = dict(resources)
        options = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0),
                   "resources": resources}
        if spread:
            options["scheduling_strategy"] = "SPREAD"
        self.label = label
        self.actor = host_class().options(**options).remote(label)
        self.placement: Placement | None = None
        self.failure: str | None = None  # why the last launch ended, as Ray said it
        self._start = self._wait = self._stopping = self._exists = None

    def launch(self, command: list[str], env: dict[str, str], files: dict[str, str] | None = None) -> None:
        token = uuid.uuid4().hex
        self.placement, self.failure = None, None
        self._start = self.actor.start.remote(token, command, env, files or {})
        self._wait = self.actor.wait_child.remote(token)

    def _done(self, ref) -> bool:
        return ref is not None and bool(self.ray.wait([ref], timeout=0)[0])

    def placed(self) -> Placement | None:
        """Where the child runs, once its actor has started it (None while Ray places the actor)."""
        if self.placement is None and self._done(self._start):
            try:
                self.placement = Placement(**self.ray.get(self._start))
            except self.ray.exceptions.RayError as exc:
                self.failure = f"{type(exc).__name__}"
        return self.placement

    def exited(self) -> bool:
        self.placed()
        return self.failure is not None or self._done(self._wait)

    def exit_code(self) -> int | str | None:
        if self.failure is not None:
            return self.failure
        if not self._done(self._wait):
            return None
        try:
            return self.ray.get(self._wait)
        except self.ray.exceptions.RayError as exc:  # the actor (or its node) died
            return type(exc).__name__

    @property
    def pid(self) -> int | None:
        return self.placement.pid if self.placement is not None else None

    def write(self, name: str, text: str) -> None:
        """Replace a file beside the child (a launch's own files go with its ``start``: a
        threaded actor's calls may run out of order)."""
        self.actor.write.remote(name, text)

    def exists(self, name: str) -> bool:
        """Whether the file is in the child's directory, as last asked (never blocks: the
        answer to the previous question, and the next one asked)."""
        answer = False
        if self._exists is not None and self._done(self._exists):
            with contextlib.suppress(self.ray.exceptions.RayError):
                answer = bool(self.ray.get(self._exists))
            self._exists = None
        if self._exists is None:
            self._exists = self.actor.exists.remote(name)
        return answer

    def kill(self) -> None:
        self.actor.signal_child.remote(signal.SIGKILL)

    def terminate(self) -> None:
        """Stop the child (SIGTERM, SIGKILL after the grace period); ``finish`` waits for it."""
        self._stopping = self.actor.stop.remote(STOP_GRACE_S)

    def finish(self, deadline: float) -> None:
        """After ``terminate``: wait for the child to stop (until ``deadline`` and the actor's
        own grace), then kill the actor for good, so that Ray does not start it again."""
        import time

        with contextlib.suppress(Exception):  # a dead actor, or one never placed
            self.ray.get(self._stopping, timeout=max(1.0, deadline - time.monotonic()) + 10)
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor, no_restart=True)

    def release(self) -> None:
        """Nothing to release here: the actor holds the child's lifeline."""
