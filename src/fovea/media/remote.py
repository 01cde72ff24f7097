"""``http(s)://`` references, fetched only from allowlisted hosts on public addresses.

A URL the server fetches on a client's behalf is a classic SSRF hole, so: exact host allowlist; we
resolve DNS ourselves, refuse private/loopback/link-local/... addresses, and then connect to the very
address we vetted (Host header and TLS SNI still carry the name), so a DNS answer that changes between
check and connect cannot redirect us inward; redirects are followed by hand and every hop is
re-vetted; the body is streamed and cut off at the byte cap; one deadline covers the whole fetch.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import certifi
import httpx

from fovea.media.config import MediaConfig
from fovea.media.errors import FoveaError, MalformedImage, MediaFetchFailed, MediaSourceForbidden

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


def fetch_url(url: str, config: MediaConfig) -> bytes:
    if not config.allowed_media_domains:
        raise MediaSourceForbidden(
            "http(s) image URLs are disabled on this server; upload the image to POST /v1/images "
            "or send it inline as a base64 data URL.")
    with httpx.Client(verify=_tls_context(), timeout=config.fetch_timeout_s, follow_redirects=False,
                      trust_env=False) as client:
        deadline = time.monotonic() + config.fetch_timeout_s  # network time only, not client set-up
        current = url
        for hop in range(MAX_REDIRECTS + 1):
            target = _vet(current, config, redirected_from=url if hop else None)
            body_or_location = _fetch_one(client, target, config, deadline)
            if isinstance(body_or_location, bytes):
                return body_or_location
            current = urljoin(current, body_or_location)
        raise MediaFetchFailed(
            f"Fetching {url!r} was redirected more than {MAX_REDIRECTS} times; "
            "link to the image's final address.")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying context for every fetch: loading the CA bundle takes tens of milliseconds of
    GIL time, which per fetch ate into the fetch deadline and stalled the event loop."""
    return ssl.create_default_context(cafile=certifi.where())


def _vet(url: str, config: MediaConfig, *, redirected_from: str | None) -> _Target:
    """Check scheme, host and every resolved address; a refused redirect is a failed fetch."""
    def refuse(message: str) -> FoveaError:
        if redirected_from is None:
            return MediaSourceForbidden(message)
        return MediaFetchFailed(f"Fetching {redirected_from!r} redirected to {url!r}, which is refused: "
                                f"{message}")

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise MalformedImage(f"The image URL {url!r} is malformed; check the host and port.") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise refuse(f"only http and https URLs may be fetched, not {scheme or 'a relative URL'}.")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise MalformedImage(f"The image URL {url!r} has no host name.")
    if host not in config.allowed_media_domains:
        raise refuse(f"the host {host!r} is not on this server's list of allowed image domains "
                     f"({', '.join(config.allowed_media_domains)}).")
    addresses = _resolve(host, port, redirected_from or url)
    if not config.allow_private_addresses:
        for ip in addresses:
            reason = forbidden_address_reason(ip)
            if reason:
                raise refuse(f"the host {host!r} resolves to {ip}, a {reason} address, and this server "
                             "only fetches from public addresses.")
    return _Target(url, scheme, host, port, addresses)


def forbidden_address_reason(ip: IPAddress) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    for reason, flag in (("loopback", ip.is_loopback), ("private", ip.is_private),
                         ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                         ("reserved", ip.is_reserved), ("unspecified", ip.is_unspecified)):
        if flag:
            return reason
    return None if ip.is_global else "non-public"


def _resolve(host: str, port: int, shown_url: str) -> tuple[IPAddress, ...]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise MediaFetchFailed(f"Could not resolve the host {host!r} of {shown_url!r} ({exc}).") from None
    seen: dict[IPAddress, None] = {}
    for _family, _type, _proto, _canon, sockaddr in infos:
        seen[ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])] = None
    if not seen:
        raise MediaFetchFailed(f"The host {host!r} of {shown_url!r} has no addresses.")
    return tuple(seen)


def _fetch_one(client: httpx.Client, target: _Target, config: MediaConfig,
               deadline: float) -> bytes | str:
    """Fetch one hop: the body if 200, the Location if a redirect; anything else fails."""
    last_error: Exception | None = None
    for ip in target.addresses:
        try:
            return _request(client, target, ip, config, deadline)
        except httpx.ConnectError as exc:  # try the host's next address, like a browser would
            last_error = exc
        except httpx.TimeoutException:
            raise _timed_out(target, config) from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            raise MediaFetchFailed(f"Fetching {target.url!r} failed ({_describe(exc)}).") from None
    raise MediaFetchFailed(f"Could not connect to {target.host!r} for {target.url!r} "
                           f"({_describe(last_error)}).") from None


def _request(client: httpx.Client, target: _Target, ip: IPAddress, config: MediaConfig,
             deadline: float) -> bytes | str:
    parts = urlsplit(target.url)
    ip_text = f"[{ip}]" if ip.version == 6 else str(ip)
    pinned = urlunsplit((target.scheme, f"{ip_text}:{target.port}", parts.path or "/", parts.query, ""))
    default_port = {"http": 80, "https": 443}[target.scheme]
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    if ":" in target.host:
        host_header = f"[{target.host}]" + ("" if target.port == default_port else f":{target.port}")
    headers = {"Host": host_header, "Accept": "image/*", "Accept-Encoding": "identity",
               "User-Agent": "fovea-media-fetch"}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise httpx.TimeoutException("deadline passed")
    with client.stream("GET", pinned, headers=headers, extensions=extensions,
                       timeout=min(remaining, config.fetch_timeout_s)) as response:
        if response.status_code in _REDIRECTS:
            location = response.headers.get("location")
            if not location:
                raise MediaFetchFailed(f"{target.url!r} answered {response.status_code} without a "
                                       "Location header; link to the image itself.")
            return location
        if response.status_code != 200:
            raise MediaFetchFailed(f"{target.url!r} answered HTTP {response.status_code} instead of the "
                                   "image; check that the URL is public and correct.")
        return _read_capped(response, target, config, deadline)


def _read_capped(response: httpx.Response, target: _Target, config: MediaConfig,
                 deadline: float) -> bytes:
    too_big = MediaFetchFailed(
        f"The image at {target.url!r} is larger than the {config.max_image_bytes:,}-byte limit; "
        "link to a smaller or more compressed image.")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > config.max_image_bytes:
        raise too_big
    chunks: list[bytes] = []
    total = 0
    for chunk in response.iter_raw():
        total += len(chunk)
        if total > config.max_image_bytes:
            raise too_big
        if time.monotonic() > deadline:  # a slow drip would otherwise reset the read timeout forever
            raise _timed_out(target, config)
        chunks.append(chunk)
    return b"".join(chunks)


def _timed_out(target: _Target, config: MediaConfig) -> MediaFetchFailed:
    return MediaFetchFailed(f"Fetching {target.url!r} took longer than {config.fetch_timeout_s:g} s; "
                            "use a faster host or upload the image instead.")


def _describe(exc: Exception | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None and str(exc) else type(exc).__name__
