"""MediaResolver: inline data, uploaded ids, file:// confinement and http(s) fetch rules."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import socket
import time
from pathlib import Path

import pytest
from media_helpers import encode, max_diff, pattern, refusal, rgb

from fovea.media import ImageStore, MediaConfig, MediaResolver, remote
from fovea.media.errors import (
    ImageNotFound,
    ImageTooLarge,
    MalformedImage,
    MediaFetchFailed,
    MediaSourceForbidden,
)
from fovea.media.remote import forbidden_address_reason

PNG = encode(rgb(), "PNG")
B64 = base64.b64encode(PNG).decode()


def make(config: MediaConfig) -> MediaResolver:
    return MediaResolver(config, ImageStore(config))


# --- inline data ---

@pytest.mark.parametrize("ref", [
    "data:image/png;base64," + B64,
    "data:image/jpeg;base64," + B64,  # a wrong image subtype is harmless: the bytes decide
    "DATA:IMAGE/PNG;BASE64," + B64,
    "data:;base64," + B64,
    "data:application/octet-stream;base64," + B64,
    "data:image/png;name=cat.png;base64," + B64,
    "data:image/png;base64," + "\n".join(B64[i:i + 76] for i in range(0, len(B64), 76)),
    "data:image/png;base64," + B64.rstrip("="),
    "data:image/png;base64," + B64.replace("+", "%2B").replace("/", "%2F").replace("=", "%3D"),
    "data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode(),
    "  data:image/png;base64," + B64 + "\n",
    B64,
    B64.rstrip("="),
    base64.urlsafe_b64encode(PNG).decode(),
])
def test_inline_forms_are_accepted(resolver: MediaResolver, ref: str) -> None:
    assert resolver.load_bytes(ref) == PNG
    assert max_diff(resolver.load(ref), pattern()) == 0


def test_raw_base64_jpeg_starting_with_slash_is_not_mistaken_for_a_path(resolver: MediaResolver) -> None:
    b64 = base64.b64encode(encode(rgb(), "JPEG")).decode()
    assert b64.startswith("/9j/")
    assert resolver.load(b64).size == (37, 23)


def test_inline_byte_cap_is_413() -> None:
    config = MediaConfig(max_image_bytes=len(PNG) - 1)
    exc = refusal(make(config).load_bytes, "data:image/png;base64," + B64)
    assert type(exc) is ImageTooLarge and exc.status == 413


# --- uploaded ids ---

def test_uploaded_id_round_trips(resolver: MediaResolver, store: ImageStore) -> None:
    stored = store.put(PNG)
    assert resolver.load_bytes(stored.id) == PNG
    assert max_diff(resolver.load(stored.id), pattern()) == 0


def test_unknown_id_is_404(resolver: MediaResolver) -> None:
    exc = refusal(resolver.load, "img-" + "ab" * 16)
    assert type(exc) is ImageNotFound and (exc.status, exc.code) == (404, "image_not_found")


def test_aload_runs_off_the_event_loop(resolver: MediaResolver) -> None:
    assert asyncio.run(resolver.aload(B64)).size == (37, 23)
    with pytest.raises(ImageNotFound):
        asyncio.run(resolver.aload("img-" + "0" * 32))


# --- file:// ---

@pytest.fixture
def media_tree(tmp_path: Path) -> dict[str, Path]:
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (allowed / "sub" / "dog.png").write_bytes(PNG)
    (allowed / "name with space#1.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "escape-dir").symlink_to(outside, target_is_directory=True)
    (allowed / "inner-link.png").symlink_to(allowed / "sub" / "dog.png")
    (allowed / "dangling-out.png").symlink_to(outside / "nope.png")
    (allowed / "not-an-image.txt").write_text("hello")
    return {"root": tmp_path, "allowed": allowed, "outside": outside}


@pytest.fixture
def file_resolver(media_tree: dict[str, Path]) -> MediaResolver:
    return make(MediaConfig(allowed_media_dirs=(media_tree["allowed"],)))


@pytest.mark.parametrize("rel", ["cat.png", "sub/dog.png", "inner-link.png", "sub/../cat.png",
                                 "name%20with%20space%231.png"])
def test_file_inside_allowed_dir_is_read(file_resolver: MediaResolver, media_tree: dict[str, Path],
                                         rel: str) -> None:
    assert file_resolver.load_bytes(f"file://{media_tree['allowed']}/{rel}") == PNG


def test_file_localhost_form(file_resolver: MediaResolver, media_tree: dict[str, Path]) -> None:
    assert file_resolver.load_bytes(f"file://localhost{media_tree['allowed']}/cat.png") == PNG


@pytest.mark.parametrize("rel", [
    "../outside/secret.png", "sub/../../outside/secret.png", "%2e%2e/outside/secret.png",
    "..%2Foutside%2Fsecret.png", "escape.png", "escape-dir/secret.png", "dangling-out.png",
    "../outside/missing.png",
])
def test_file_escapes_are_forbidden(file_resolver: MediaResolver, media_tree: dict[str, Path],
                                    rel: str) -> None:
    exc = refusal(file_resolver.load_bytes, f"file://{media_tree['allowed']}/{rel}")
    assert type(exc) is MediaSourceForbidden and exc.status == 403
    assert str(media_tree["allowed"]) in exc.message  # says where files may come from


@pytest.mark.parametrize("url", ["file:///etc/passwd", "file:///proc/self/environ", "file:///"])
def test_file_outside_any_allowed_dir_is_forbidden(file_resolver: MediaResolver, url: str) -> None:
    assert type(refusal(file_resolver.load_bytes, url)) is MediaSourceForbidden


def test_sibling_dir_with_common_prefix_is_forbidden(tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "media-private").mkdir()
    (tmp_path / "media-private" / "x.png").write_bytes(PNG)
    resolver = make(MediaConfig(allowed_media_dirs=(tmp_path / "media",)))
    exc = refusal(resolver.load_bytes, f"file://{tmp_path}/media-private/x.png")
    assert type(exc) is MediaSourceForbidden


def test_file_remote_host_is_forbidden(file_resolver: MediaResolver, media_tree: dict[str, Path]) -> None:
    exc = refusal(file_resolver.load_bytes, f"file://fileserver{media_tree['allowed']}/cat.png")
    assert type(exc) is MediaSourceForbidden


def test_file_urls_are_off_without_allowed_dirs(resolver: MediaResolver, media_tree: dict[str, Path]) -> None:
    exc = refusal(resolver.load_bytes, f"file://{media_tree['allowed']}/cat.png")
    assert type(exc) is MediaSourceForbidden and "disabled" in exc.message


@pytest.mark.parametrize("rel", ["missing.png", "sub", "sub/"])
def test_missing_or_non_regular_file_fails_to_fetch(file_resolver: MediaResolver,
                                                   media_tree: dict[str, Path], rel: str) -> None:
    exc = refusal(file_resolver.load_bytes, f"file://{media_tree['allowed']}/{rel}")
    assert type(exc) is MediaFetchFailed and exc.status == 400


def test_fifo_is_refused_without_blocking(file_resolver: MediaResolver, media_tree: dict[str, Path]) -> None:
    os.mkfifo(media_tree["allowed"] / "pipe.png")
    start = time.monotonic()
    exc = refusal(file_resolver.load_bytes, f"file://{media_tree['allowed']}/pipe.png")
    assert type(exc) is MediaFetchFailed
    assert time.monotonic() - start < 10  # a blocking open would never return; slack for a loaded CI machine


def test_file_over_byte_cap_is_413(media_tree: dict[str, Path]) -> None:
    resolver = make(MediaConfig(allowed_media_dirs=(media_tree["allowed"],), max_image_bytes=100))
    exc = refusal(resolver.load_bytes, f"file://{media_tree['allowed']}/cat.png")
    assert type(exc) is ImageTooLarge and exc.status == 413


def test_file_that_is_not_an_image(file_resolver: MediaResolver, media_tree: dict[str, Path]) -> None:
    exc = refusal(file_resolver.load, f"file://{media_tree['allowed']}/not-an-image.txt")
    assert type(exc) is MalformedImage


def test_file_url_with_query_or_relative_path(file_resolver: MediaResolver,
                                              media_tree: dict[str, Path]) -> None:
    exc = refusal(file_resolver.load_bytes, f"file://{media_tree['allowed']}/cat.png?x=1")
    assert type(exc) is MalformedImage
    assert type(refusal(file_resolver.load_bytes, "file:cat.png")) is MalformedImage


def test_allowed_dir_given_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "cat.png").write_bytes(PNG)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    resolver = make(MediaConfig(allowed_media_dirs=(tmp_path / "link",)))
    assert resolver.load_bytes(f"file://{tmp_path}/link/cat.png") == PNG


# --- http(s): address rules without any network ---

@pytest.mark.parametrize(("address", "reason"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("240.0.0.1", "reserved"),
    ("100.64.0.1", "non-public"), ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_address_rules(address: str, reason: str | None) -> None:
    got = forbidden_address_reason(ipaddress.ip_address(address))
    assert (got is None) if reason is None else (got is not None)


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("answers", [["10.0.0.5"], ["93.184.216.34", "127.0.0.1"], ["169.254.169.254"],
                                     ["::ffff:10.0.0.1"]])
def test_allowlisted_host_resolving_inward_is_forbidden(monkeypatch: pytest.MonkeyPatch,
                                                         answers: list[str]) -> None:
    _fake_dns(monkeypatch, {"images.example.com": answers})
    resolver = make(MediaConfig(allowed_media_domains=("images.example.com",)))
    exc = refusal(resolver.load_bytes, "https://images.example.com/cat.png")
    assert type(exc) is MediaSourceForbidden and exc.status == 403 and "public" in exc.message


@pytest.mark.parametrize("url", [
    "https://evil.example.com/cat.png", "https://images.example.com.evil.com/cat.png",
    "https://evil.com/images.example.com/cat.png", "https://images.example.com@evil.com/cat.png",
    "https://sub.images.example.com/cat.png", "http://127.0.0.1/cat.png",
])
def test_host_not_allowlisted_is_forbidden(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    _fake_dns(monkeypatch, {})
    resolver = make(MediaConfig(allowed_media_domains=("images.example.com",)))
    exc = refusal(resolver.load_bytes, url)
    assert type(exc) is MediaSourceForbidden and "images.example.com" in exc.message


def test_host_match_is_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"images.example.com": ["10.0.0.1"]})
    resolver = make(MediaConfig(allowed_media_domains=("Images.Example.COM",)))
    # Passing the allowlist and reaching the address check proves the host matched.
    exc = refusal(resolver.load_bytes, "https://IMAGES.example.com./cat.png")
    assert type(exc) is MediaSourceForbidden and "10.0.0.1" in exc.message


def test_unresolvable_host_fails_to_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {})
    resolver = make(MediaConfig(allowed_media_domains=("images.example.com",)))
    assert type(refusal(resolver.load_bytes, "https://images.example.com/x.png")) is MediaFetchFailed


# --- http: against a real loopback server ---

def test_fetch_from_loopback_when_private_addresses_allowed(http_config: MediaConfig, image_server) -> None:
    resolver = make(http_config)
    assert resolver.load_bytes(image_server.url("/img.png")) == image_server.png
    assert max_diff(resolver.load(image_server.url("/img.png")), pattern()) == 0
    # We connect to the vetted IP but still tell the server which host we want.
    assert image_server.hosts_seen[-1] == f"127.0.0.1:{image_server.port}"


def test_loopback_is_forbidden_by_default(image_server) -> None:
    resolver = make(MediaConfig(allowed_media_domains=("127.0.0.1",)))
    exc = refusal(resolver.load_bytes, image_server.url("/img.png"))
    assert type(exc) is MediaSourceForbidden and "loopback" in exc.message


@pytest.mark.parametrize("path", ["/redirect-ok", "/redirect-chain"])
def test_redirects_within_allowed_hosts_are_followed(http_config: MediaConfig, image_server,
                                                     path: str) -> None:
    assert make(http_config).load_bytes(image_server.url(path)) == image_server.png


@pytest.mark.parametrize(("path", "words"), [
    ("/redirect-other-host", "localhost"), ("/redirect-file", "file"), ("/redirect-loop", "3 times"),
    ("/redirect-no-location", "Location"), ("/missing", "404"),
])
def test_bad_redirects_and_statuses_fail_to_fetch(http_config: MediaConfig, image_server, path: str,
                                                  words: str) -> None:
    exc = refusal(make(http_config).load_bytes, image_server.url(path))
    assert type(exc) is MediaFetchFailed and (exc.status, exc.code) == (400, "media_fetch_failed")
    assert words in exc.message


def test_redirect_to_an_internal_address_is_refused(monkeypatch: pytest.MonkeyPatch, image_server) -> None:
    # An allowlisted host that redirects to an allowlisted name resolving inward: every hop is vetted.
    # 127.0.0.1 stands in for a public address here; internal.test resolves to "internal" 127.0.0.2.
    _fake_dns(monkeypatch, {"127.0.0.1": ["127.0.0.1"], "internal.test": ["127.0.0.2"]})
    monkeypatch.setattr(remote, "forbidden_address_reason",
                        lambda ip: "private" if str(ip) == "127.0.0.2" else None)
    config = MediaConfig(allowed_media_domains=("127.0.0.1", "internal.test"))
    resolver = make(config)
    assert resolver.load_bytes(image_server.url("/img.png")) == image_server.png
    exc = refusal(resolver.load_bytes, image_server.url("/redirect-internal"))
    assert type(exc) is MediaFetchFailed and "127.0.0.2" in exc.message and "internal.test" in exc.message


@pytest.mark.parametrize("path", ["/big-declared", "/big-streamed"])
def test_byte_cap_while_fetching(image_server, path: str) -> None:
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True,
                         max_image_bytes=50_000, fetch_timeout_s=2.0)
    exc = refusal(make(config).load_bytes, image_server.url(path))
    assert type(exc) is MediaFetchFailed and "50,000" in exc.message


def test_fetch_timeout(image_server) -> None:
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True,
                         fetch_timeout_s=0.2)
    start = time.monotonic()
    exc = refusal(make(config).load_bytes, image_server.url("/slow"))
    assert time.monotonic() - start < 1.5  # /slow answers after 2 s; slack for a loaded CI machine
    assert type(exc) is MediaFetchFailed and "0.2 s" in exc.message


def test_fetched_html_page_is_an_invalid_image(http_config: MediaConfig, image_server) -> None:
    exc = refusal(make(http_config).load, image_server.url("/html"))
    assert type(exc) is MalformedImage and "HTML" in exc.message


def test_connection_refused_fails_to_fetch(http_config: MediaConfig) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        exc = refusal(make(http_config).load_bytes, f"http://127.0.0.1:{port}/x.png")
    assert type(exc) is MediaFetchFailed


def test_connects_to_the_vetted_address_and_sends_the_name(monkeypatch: pytest.MonkeyPatch,
                                                           image_server) -> None:
    _fake_dns(monkeypatch, {"images.test": ["127.0.0.1"], "127.0.0.1": ["127.0.0.1"]})
    config = MediaConfig(allowed_media_domains=("images.test",), allow_private_addresses=True)
    url = f"http://images.test:{image_server.port}/img.png"
    assert make(config).load_bytes(url) == image_server.png
    assert image_server.hosts_seen[-1] == f"images.test:{image_server.port}"
