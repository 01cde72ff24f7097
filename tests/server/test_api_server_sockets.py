"""The sockets ``--api-server-count`` API processes listen on (``serve.api_servers.port_socket``)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from scene_helpers import free_port

from fovea.errors import FoveaError
from fovea.serve.api_servers import port_socket


def test_connections_accepted_on_it_send_without_nagle():
    """asyncio turns Nagle's algorithm off only on sockets that say TCP. Left on, each stream's
    small SSE writes waited for the client's delayed ACK: 40 ms more to the first token."""

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = port_socket("127.0.0.1", free_port(), first=True)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_further_processes_share_the_port_and_the_first_refuses_a_taken_one():
    port = free_port()
    first = port_socket("127.0.0.1", port, first=True)
    first.listen()
    further = port_socket("127.0.0.1", port)  # SO_REUSEPORT: beside the first, as a further API process
    further.listen()
    try:
        # Another server started on the same port would share it silently: the first process refuses.
        with pytest.raises(FoveaError, match=f"cannot serve on 127.0.0.1:{port}"):
            port_socket("127.0.0.1", port, first=True)
    finally:
        first.close()
        further.close()


def test_the_shared_metrics_directory_is_refused_in_one_line_where_it_cannot_be_made(tmp_path, monkeypatch):
    from fovea.serve.api_servers import shared_metrics_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "missing"))
    with pytest.raises(FoveaError, match="set TMPDIR to a writable directory"):
        shared_metrics_dir()


def test_the_shared_metrics_directory_is_new_and_dead_servers_ones_are_swept(tmp_path, monkeypatch):
    from fovea.serve.api_servers import shared_metrics_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = tmp_path / "fovea-metrics-999999999-abc"  # no such process
    dead.mkdir()
    (dead / "counter_999999999.db").write_bytes(b"x")
    made = shared_metrics_dir()
    assert made.is_dir() and made.name.startswith(f"fovea-metrics-{os.getpid()}-") and not list(made.iterdir())
    assert not dead.exists()
    assert shared_metrics_dir() != made and made.exists()  # a live server's directory is kept
