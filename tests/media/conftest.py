"""Fixtures for the media tests: configs, a store, a resolver and a loopback HTTP image server."""

from __future__ import annotations

import http.server
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from media_helpers import encode, rgb
from scene_helpers import QuietHandler

from fovea.media import ImageStore, MediaConfig, MediaResolver


@pytest.fixture(autouse=True)
def _quiet_pil_warnings() -> Iterator[None]:
    # PIL warns (UserWarning) about the corrupt EXIF/TIFF data these tests feed it on purpose.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture
def config() -> MediaConfig:
    return MediaConfig()


@pytest.fixture
def store(config: MediaConfig) -> ImageStore:
    return ImageStore(config)


@pytest.fixture
def resolver(config: MediaConfig, store: ImageStore) -> MediaResolver:
    return MediaResolver(config, store)


@dataclass
class ImageServer:
    """A loopback HTTP server whose paths exercise every fetch rule."""

    port: int
    png: bytes
    hosts_seen: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(server: ImageServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(QuietHandler):

        def do_GET(self) -> None:
            server.hosts_seen.append(self.headers.get("Host", ""))
            path = self.path
            if path == "/img.png":
                self.send(200, server.png, {"Content-Type": "image/png"})
            elif path == "/redirect-ok":
                self.send(302, headers={"Location": "/img.png"})
            elif path == "/redirect-chain":
                self.send(301, headers={"Location": "/redirect-ok"})
            elif path == "/redirect-other-host":
                self.send(302, headers={"Location": server.url("/img.png", host="localhost")})
            elif path == "/redirect-internal":
                self.send(302, headers={"Location": server.url("/img.png", host="internal.test")})
            elif path == "/redirect-file":
                self.send(302, headers={"Location": "file:///etc/passwd"})
            elif path == "/redirect-loop":
                self.send(302, headers={"Location": "/redirect-loop"})
            elif path == "/redirect-no-location":
                self.send(302)
            elif path == "/missing":
                self.send(404, b"not found")
            elif path == "/html":
                self.send(200, b"<!DOCTYPE html><html><body>login</body></html>",
                           {"Content-Type": "text/html"})
            elif path == "/big-declared":
                self.send(200, b"x" * 10, {"Content-Length": str(10**12)})
            elif path == "/big-streamed":  # no Content-Length: only counting while streaming catches it
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                for _ in range(64):
                    self.wfile.write(b"\x00" * 4096)
            elif path == "/slow":
                time.sleep(2.0)  # far past the tests' 0.2 s deadline, so a missing deadline is plain
                self.send(200, server.png)
            else:
                self.send(404)

    return Handler


@pytest.fixture(scope="session")
def image_server() -> Iterator[ImageServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    httpd.daemon_threads = True
    server = ImageServer(port=httpd.server_address[1], png=encode(rgb(), "PNG"))
    httpd.RequestHandlerClass = _handler(server)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def http_config() -> MediaConfig:
    """Loopback allowed: the only way to test real fetches without network access."""
    return MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True,
                       fetch_timeout_s=2.0, max_image_bytes=100_000, store_max_bytes=1_000_000)
