"""Where a PD worker finds each shared encode worker, and how it reaches it.

A shared encode worker listens on a Unix socket on its node and, when it runs on Ray, on a
TCP port of that node's address too. A PD worker on the same node uses the socket, and the
tensors travel in shared memory; one on another node connects over TCP, and the tensors travel
inline in the frames. Either way each embedding carries the same verified header and checksum
(``handoff``): the transport changes nothing the receiving side checks.

On Ray an encode worker that dies is restarted by Ray, perhaps on another node: its address
changes. The front has the Ray actor that hosts each PD worker rewrite the table's file on the
PD worker's node (``ENDPOINTS_ENV`` names it), and a channel that reconnects reads the current
entry on every attempt. A file, not a message: the table is read where the encoder pool lives,
which is the engine core's process, not the one that answers HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger("fovea.disagg")

NODE_ENV = "FOVEA_NODE_ID"  # set by the Ray host of a PD worker: the node it runs on
ENDPOINTS_ENV = "FOVEA_ENCODE_ENDPOINTS_FILE"  # the file that holds the front's table (JSON), on Ray


@dataclass(frozen=True)
class Endpoint:
    """One way to reach an encode worker: ``family`` AF_UNIX (``address`` a path; tensors in
    shared memory) or AF_INET (``address`` (host, port); tensors inline)."""

    family: str
    address: str | tuple[str, int]

    @property
    def shared(self) -> bool:
        return self.family == "AF_UNIX"

    def describe(self) -> str:
        if self.shared:
            return f"shared memory, Unix socket {self.address}"
        host, port = self.address  # type: ignore[misc]
        return f"TCP to {host}:{port}, tensors inline"


def parse_entry(entry: str | dict) -> dict:
    """A table entry: a bare path (a worker the local front started) or the Ray front's dict
    (``socket``, ``tcp`` "host:port", ``node``), maybe as JSON text (a command-line value)."""
    if isinstance(entry, str) and entry.startswith("{"):
        entry = json.loads(entry)
    if isinstance(entry, str):
        return {"socket": entry, "tcp": None, "node": None}
    if not isinstance(entry, dict) or not (entry.get("socket") or entry.get("tcp")):
        raise ValueError(f"an encode worker's entry needs a socket or a tcp address, not {entry!r}")
    return {"socket": entry.get("socket"), "tcp": entry.get("tcp"), "node": entry.get("node")}


def write_table(path: str, entries: list[dict]) -> None:
    """Replace the table's file at once (a reader never sees half of it)."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as out:
        json.dump(entries, out)
    os.replace(partial, path)


class EncoderDirectory:
    def __init__(self, entries: list[str | dict], node: str | None = None, table: str | None = None) -> None:
        """``node``: the node this PD worker runs on (None: a local front's worker, same machine).
        ``table``: a file whose JSON list replaces ``entries`` whenever it changes."""
        self.node, self.table = node, table
        self._lock = threading.Lock()
        self._entries = [parse_entry(e) for e in entries]
        self._read_at: float | None = None  # the table file's mtime when last read
        self._chosen: dict[int, Endpoint] = {}  # what each index was last reached by (logged on change)
        self._refresh()

    @classmethod
    def from_environment(cls, fallback: list[str]) -> EncoderDirectory:
        """The table the Ray front keeps for this PD worker, else the local front's socket paths."""
        return cls(list(fallback), os.environ.get(NODE_ENV), os.environ.get(ENDPOINTS_ENV))

    def __len__(self) -> int:
        return len(self._entries)

    def _refresh(self) -> None:
        if self.table is None:
            return
        mtime = os.stat(self.table).st_mtime_ns
        if mtime == self._read_at:
            return
        with open(self.table) as table:
            parsed = [parse_entry(e) for e in json.load(table)]
        with self._lock:
            self._entries, self._read_at = parsed, mtime

    def endpoint(self, index: int) -> Endpoint:
        """How to reach worker ``index`` now: its socket when it runs on this node (or no node is
        named: one machine), else its TCP address."""
        self._refresh()
        with self._lock:
            entry = self._entries[index]
        same_node = entry["node"] is None or self.node is None or entry["node"] == self.node
        if entry["socket"] and same_node:
            chosen = Endpoint("AF_UNIX", entry["socket"])
        elif entry["tcp"]:
            host, _, port = str(entry["tcp"]).rpartition(":")
            chosen = Endpoint("AF_INET", (host, int(port)))
        else:
            raise ValueError(f"encode worker {index} runs on node {entry['node']}, another than this one "
                             f"({self.node}), and has no TCP address")
        if self._chosen.get(index) != chosen:
            self._chosen[index] = chosen
            log.info("encode worker %d -> this PD worker (node %s): %s (encode worker's node %s)", index,
                     self.node or "local", chosen.describe(), entry["node"] or "local")
        return chosen
