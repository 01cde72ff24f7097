"""The local encoder pool's transport: tensors in shared memory, waiting submissions batched,
one image's refusal failing that image only, and nothing left in /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scene_helpers import fresh_scene

from fovea.demo import scenes
from fovea.disagg import wire
from fovea.disagg.encoder_pool import EncoderPool
from fovea.disagg.handoff import HandoffMismatch, checksum
from fovea.disagg.shared_segment import Segment
from fovea.loading.contract import check_contract
from fovea.loading.prompt import encode_prompt, render_chat


def images_of(model, seeds):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    return [encode_prompt(model, render_chat(model, messages), [scenes.render(fresh_scene(s))]).images[0]
            for s in seeds]


@pytest.fixture(scope="module")
def pool(demo_model):
    contract = check_contract(demo_model)
    pool = EncoderPool(demo_model.path, workers=1, device="cpu", dtype="float32", model_id=contract.model_fingerprint,
                       recipe_fingerprint=contract.recipe_fingerprint, hidden=contract.lm_hidden, batch_images=8)
    pool.start()
    yield pool
    pool.stop()


def test_tensors_cross_in_shared_memory_not_through_the_pipe(pool, demo_model):
    images = images_of(demo_model, range(70_000, 70_004))
    sent: list[int] = []
    channel = pool.workers[0].channel
    send = channel._send  # the bytes down the pipe are what this test measures
    channel._send = lambda data, timeout: (sent.append(len(data)), send(data, timeout))[1]
    try:
        rows = pool.encode(images)
    finally:
        channel._send = send
    reference = demo_model.adapter.vision_forward(demo_model)(images)
    assert all(torch.equal(got, want) for got, want in zip(rows, reference, strict=True))
    pixel_bytes = sum(image.pixels.numel() * image.pixels.element_size() for image in images)
    assert sent and sent[0] < pixel_bytes / 10  # headers only: the pixels went through the segment
    assert channel.incoming.segment.capacity >= sum(r.numel() * r.element_size() for r in rows)


def test_waiting_submissions_are_sent_together(pool, demo_model):
    images = images_of(demo_model, range(71_000, 71_017))
    before = pool.workers[0].batches
    futures = [pool.submit([image]) for image in images]  # all queued while the first is encoded
    rows = [future.result(timeout=120)[0] for future in futures]
    reference = demo_model.adapter.vision_forward(demo_model)(images)
    assert all(torch.equal(got, want) for got, want in zip(rows, reference, strict=True))
    batches = pool.workers[0].batches - before
    assert batches <= 4, f"{len(images)} single-image submissions took {batches} batches of at most 8"


def test_one_images_refusal_fails_that_image_only(pool, demo_model):
    images = images_of(demo_model, range(72_000, 72_003))
    real = pool.workers[0].channel.round_trip

    def corrupt_second(items, reply_bytes, timeout):
        reply = real(items, reply_bytes, timeout)
        reply[2][1][5] ^= 0x01  # one bit of the second image's rows, in the shared segment
        return reply

    pool.workers[0].channel.round_trip = corrupt_second
    try:
        first, second, third = pool.encode_each(images)
    finally:
        pool.workers[0].channel.round_trip = real
    assert isinstance(second, HandoffMismatch) and second.reason == "checksum"
    assert isinstance(first, torch.Tensor) and isinstance(third, torch.Tensor)


def test_the_pool_leaves_nothing_in_dev_shm(demo_model):
    contract = check_contract(demo_model)
    pool = EncoderPool(demo_model.path, workers=1, device="cpu", dtype="float32", model_id=contract.model_fingerprint,
                       recipe_fingerprint=contract.recipe_fingerprint, hidden=contract.lm_hidden).start()
    pool.encode(images_of(demo_model, [73_000]))
    channel = pool.workers[0].channel
    names = [channel.outgoing.segment.name, channel.incoming.segment.name]
    assert all((Path("/dev/shm") / name.lstrip("/")).exists() for name in names)
    pool.stop()
    assert not any((Path("/dev/shm") / name.lstrip("/")).exists() for name in names)


def test_the_checksum_sees_a_changed_swapped_or_shifted_word():
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    words = data.view(-1).view(torch.int16)
    base = int(checksum(data))
    changed = words.clone()
    changed[100] += 1
    swapped = words.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    shifted = torch.roll(words, 1)
    assert len({base, int(checksum(changed)), int(checksum(swapped)), int(checksum(shifted))}) == 4
    assert int(checksum(data.clone())) == base


def test_a_message_carries_tensors_in_a_segment_or_inline():
    segment = Segment(1024)
    try:
        small, large = torch.arange(10, dtype=torch.float32), torch.arange(400, dtype=torch.float32)
        message = wire.encode([({"k": "batch"}, None), ({"n": 1}, small), ({"n": 2}, large)], segment)
        items = wire.decode(message, lambda name: segment)
        assert items[0] == ({"k": "batch"}, None)
        assert torch.equal(items[1][1].view(torch.float32), small)  # in the segment
        assert torch.equal(items[2][1].view(torch.float32), large)  # 1,600 bytes: no room left, inline
        assert len(message) > large.numel() * 4 > len(wire.encode([({"n": 1}, small)], segment))
    finally:
        segment.close()


def test_a_batch_the_worker_could_not_encode_is_a_server_error_not_the_clients(pool):
    from fovea.disagg.encode_worker import error_item
    from fovea.disagg.encoder_pool import EncoderFailed

    with pytest.raises(EncoderFailed) as info:
        pool._verify([error_item(RuntimeError("CUDA out of memory"))], "batch", [])
    assert info.value.status == 500 and info.value.code == "encoder_failed"
    assert "out of memory" in info.value.message
