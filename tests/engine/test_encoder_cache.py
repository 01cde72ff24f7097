"""The encoder cache: LRU by bytes, and the bytes it counts are the bytes it holds."""

import torch

from fovea.engine.vision.encoder_cache import EncoderCache


def test_views_of_a_larger_block_are_cached_as_compact_copies():
    block = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)  # one batch's rows, 4 images of 1 row
    views = list(torch.split(block, 1))
    cache = EncoderCache(max_bytes=10_000)
    for i, view in enumerate(views):
        cache.put(f"img{i}", view)
    for i in range(4):
        cached = cache.get(f"img{i}")
        assert torch.equal(cached, block[i:i + 1])
        # The entry holds its own 32 bytes, not the 128-byte block, so the count is what is held.
        assert cached.untyped_storage().nbytes() == cached.numel() * 4
    assert cache.bytes == 4 * 8 * 4


def test_the_least_recently_used_entries_go_first_once_the_bound_is_passed():
    cache = EncoderCache(max_bytes=3 * 64)
    for i in range(3):
        cache.put(f"img{i}", torch.zeros(16))
    assert cache.get("img0") is not None  # img1 is now the least recently used
    cache.put("img3", torch.zeros(16))
    assert cache.get("img1") is None and cache.get("img0") is not None and cache.get("img3") is not None
    assert cache.bytes == 3 * 64 and len(cache) == 3
    cache.put("huge", torch.zeros(1000))  # larger than the whole bound: not cached, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3
