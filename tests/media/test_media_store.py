"""ImageStore: content-addressed ids, byte-bounded LRU, TTL expiry, validation, thread safety."""

from __future__ import annotations

import hashlib
import threading

import pytest
from media_helpers import encode, refusal, rgb

from fovea.media import ImageStore, MediaConfig, image_id_for, is_image_id
from fovea.media.errors import ImageTooLarge, MalformedImage


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def images(n: int) -> list[bytes]:
    """``n`` distinct small PNGs."""
    return [encode(rgb(8, 8, seed=i), "PNG") for i in range(n)]


def sized_store(budget_images: int, ttl: float = 100.0, n: int = 6) -> tuple[ImageStore, Clock, list[bytes]]:
    blobs = images(n)
    biggest = max(len(b) for b in blobs)
    config = MediaConfig(max_image_bytes=biggest, store_max_bytes=biggest * budget_images, store_ttl_s=ttl)
    clock = Clock()
    return ImageStore(config, clock=clock), clock, blobs


def test_id_is_sha256_prefix() -> None:
    data = encode(rgb(), "PNG")
    expected = "img-" + hashlib.sha256(data).hexdigest()[:32]
    assert image_id_for(data) == expected and is_image_id(expected)
    stored = ImageStore(MediaConfig()).put(data)
    assert stored.id == expected
    assert stored.metadata() == {"id": expected, "object": "image", "width": 37, "height": 23,
                                 "bytes": len(data), "created": stored.created}


@pytest.mark.parametrize("bad", ["img-" + "A" * 32, "img-" + "0" * 31, "img-" + "0" * 33, "image-" + "0" * 32,
                                 " img-" + "0" * 32, "img-" + "g" * 32])
def test_is_image_id_is_strict(bad: str) -> None:
    assert not is_image_id(bad)


def test_same_bytes_same_id_stored_once() -> None:
    store = ImageStore(MediaConfig())
    data = encode(rgb(), "PNG")
    assert store.put(data).id == store.put(data).id
    assert len(store) == 1 and store.total_bytes == len(data)


def test_undecodable_bytes_are_not_stored() -> None:
    store = ImageStore(MediaConfig())
    assert type(refusal(store.put, b"not an image")) is MalformedImage
    assert type(refusal(store.put, encode(rgb(), "PNG")[:100])) is MalformedImage
    assert len(store) == 0 and store.total_bytes == 0


def test_oversized_bytes_are_refused_before_decoding() -> None:
    store = ImageStore(MediaConfig(max_image_bytes=10))
    assert type(refusal(store.put, encode(rgb(), "PNG"))) is ImageTooLarge


def test_get_and_delete() -> None:
    store = ImageStore(MediaConfig())
    stored = store.put(encode(rgb(), "PNG"))
    assert store.get(stored.id) == stored and store.get(stored.id).data == encode(rgb(), "PNG")
    assert store.delete(stored.id) is True
    assert store.get(stored.id) is None and store.delete(stored.id) is False
    assert len(store) == 0 and store.total_bytes == 0


def test_lru_eviction_by_total_bytes() -> None:
    store, clock, blobs = sized_store(budget_images=3)
    ids = [store.put(b).id for b in blobs[:3]]
    assert len(store) == 3
    clock.now += 1
    assert store.get(ids[0]) is not None  # touch the oldest: now ids[1] is least recently used
    store.put(blobs[3])
    assert store.get(ids[1]) is None
    assert store.get(ids[0]) is not None and store.get(ids[2]) is not None
    assert store.total_bytes <= store._config.store_max_bytes
    assert store.total_bytes == sum(store.get(i).bytes for i in (ids[0], ids[2], image_id_for(blobs[3])))


def test_eviction_frees_as_many_as_needed() -> None:
    store, _, blobs = sized_store(budget_images=2)
    for blob in blobs:
        store.put(blob)
    assert 1 <= len(store) <= 2
    assert store.get(image_id_for(blobs[-1])) is not None


def test_entries_expire_after_ttl() -> None:
    store, clock, blobs = sized_store(budget_images=6, ttl=100)
    first = store.put(blobs[0])
    clock.now += 60
    second = store.put(blobs[1])
    clock.now += 50  # first is 110 s old, second 50 s
    assert store.get(first.id) is None
    assert store.get(second.id) is not None
    assert len(store) == 1 and store.total_bytes == second.bytes
    clock.now += 50
    assert len(store) == 0 and store.total_bytes == 0


def test_reupload_restarts_the_ttl() -> None:
    store, clock, blobs = sized_store(budget_images=6, ttl=100)
    first = store.put(blobs[0])
    clock.now += 90
    again = store.put(blobs[0])
    assert again.id == first.id and again.created == first.created + 90
    clock.now += 50
    assert store.get(first.id) is not None


def test_concurrent_puts_and_gets_keep_accounting_exact() -> None:
    store, _, blobs = sized_store(budget_images=4, n=12)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(30):
                blob = blobs[(i + offset) % len(blobs)]
                store.put(blob)
                store.get(image_id_for(blob))
                if i % 7 == 0:
                    store.delete(image_id_for(blobs[(i * 3) % len(blobs)]))
        except BaseException as exc:  # noqa: BLE001 - surfaced below: a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    live = [store.get(image_id_for(b)) for b in blobs]
    assert store.total_bytes == sum(s.bytes for s in live if s is not None)
    assert store.total_bytes <= store._config.store_max_bytes
