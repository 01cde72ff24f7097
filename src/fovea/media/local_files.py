"""``file://`` references, confined to the operator's allowed directories.

A file URL lets a client name any path on the server, so it is off unless dirs are configured, and a
path is accepted only if it is inside one both as written (no stat of paths outside, so no probing)
and after resolving every symlink (no escape through a link planted inside an allowed dir).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fovea.media.config import MediaConfig
from fovea.media.decode import check_byte_size
from fovea.media.errors import MalformedImage, MediaFetchFailed, MediaSourceForbidden


def read_file_url(url: str, config: MediaConfig) -> bytes:
    if not config.allowed_media_dirs:
        raise MediaSourceForbidden(
            "file:// image references are disabled on this server; upload the image to "
            "POST /v1/images or send it inline as a base64 data URL.")
    path = _path_from_url(url)
    allowed = ", ".join(str(d) for d in config.allowed_media_dirs)
    outside = MediaSourceForbidden(
        f"The file {str(path)!r} is outside the directories this server may read images from "
        f"({allowed}); copy it there or upload it instead.")
    if not any(Path(os.path.normpath(path)).is_relative_to(os.path.normpath(d))
               for d in config.allowed_media_dirs):
        raise outside
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, unreadable dir, symlink loop
        try:
            loose = path.resolve(strict=False)
        except (OSError, RuntimeError):
            raise outside from None
        if not _inside(loose, config):  # say "forbidden", not "missing", for a dangling escape
            raise outside from None
        raise MediaFetchFailed(f"No readable file exists at {str(path)!r}; check the path.") from None
    if not _inside(real, config):
        raise outside
    return _read_regular_file(real, str(path), config)


def _path_from_url(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaSourceForbidden(
            f"file URLs must name a local path (file:///absolute/path), not the host {parts.netloc!r}.")
    if parts.query or parts.fragment:
        raise MalformedImage(
            "The file URL has a '?' or '#' part; percent-encode those characters in the file name.")
    raw = unquote(parts.path)
    if not raw.startswith("/") or "\x00" in raw:
        raise MalformedImage(
            f"The file URL {url!r} does not name an absolute path; use file:///absolute/path.")
    return Path(raw)


def _inside(path: Path, config: MediaConfig) -> bool:
    return any(path.is_relative_to(d.resolve(strict=False)) for d in config.allowed_media_dirs)


def _read_regular_file(real: Path, shown: str, config: MediaConfig) -> bytes:
    try:
        # O_NOFOLLOW: the last component cannot have been swapped for a symlink since resolve();
        # O_NONBLOCK: a FIFO swapped in cannot hang the worker at open().
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise MediaFetchFailed(f"The file {shown!r} could not be opened ({exc.strerror}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaFetchFailed(f"{shown!r} is not a regular file; point at an image file.")
        check_byte_size(info.st_size, config)
        chunks: list[bytes] = []
        total = 0
        while total <= config.max_image_bytes:  # the file may grow after fstat: read one byte over
            chunk = os.read(fd, min(1 << 20, config.max_image_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise MediaFetchFailed(f"The file {shown!r} could not be read ({exc.strerror}).") from None
    finally:
        os.close(fd)
    check_byte_size(total, config)
    return b"".join(chunks)
