"""``handoff.checksum`` for a whole batch of images in one Triton kernel.

The PD side lands an E/PD batch in a client thread that shares the GIL with the engine thread
and the event loop. Every torch call releases and retakes the GIL, and with busy neighbours
retaking it can wait a whole switch interval: per-image checksums (seven torch calls each)
made the landing 15x slower under load than idle (docs/benchmarks.md, E/PD). This kernel reads
each image where it landed (a table of addresses, no gather copy), so a batch costs three
calls however many images it holds, and allocates nothing but the table and the sums.

Bit-identical to ``checksum``: the same 16-bit words (sign-extended), times the same odd
weights ``i * STRIDE + 1``, summed modulo 2**64. The arithmetic is unsigned in the kernel, so
wrapping is defined; the partial sums meet by atomic adds, whose order cannot change a sum
modulo 2**64.
"""

from __future__ import annotations

import torch

BLOCK = 1024
BLOCKS_PER_IMAGE = 64  # programs per image; each strides over its image's words


def usable() -> bool:
    """triton imports (the caller is on a GPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def checksum_many_kernel(addresses, words, out, stride, BLOCK: tl.constexpr):
        image = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        count = tl.load(words + image)
        base = tl.load(addresses + image).to(tl.pointer_type(tl.int16))
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for start in range(part * BLOCK, count, parts * BLOCK):
            index = start + tl.arange(0, BLOCK)
            mask = index < count
            word = tl.load(base + index, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
            weight = index.to(tl.uint64) * stride.to(tl.uint64) + 1
            acc += word * weight  # masked words are 0
        tl.atomic_add(out + image, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))

    return checksum_many_kernel


_COMPILED = None


def checksum_many(flats: list[torch.Tensor], stride: int) -> torch.Tensor:
    """[len(flats)] int64 on the flats' (CUDA) device: ``checksum`` of each flat uint8 tensor
    of even length, with ``stride`` the checksum's weight stride. Nothing is read back."""
    return checksum_table([f.data_ptr() for f in flats], [f.numel() // 2 for f in flats], flats[0].device, stride)


def checksum_table(addresses: list[int], words: list[int], device: torch.device, stride: int) -> torch.Tensor:
    """``checksum_many`` of the images at ``addresses`` (device memory that stays alive until
    the kernel has run), each ``words`` 16-bit words long: no tensor per image is needed, so a
    batch costs the same few torch calls however many images it holds."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _kernel()
    # Row 0: each image's address; row 1: its length in 16-bit words (both rows contiguous).
    table = torch.tensor([addresses, words], dtype=torch.int64)
    if device.type == "cuda":  # (the CPU case is triton's interpreter, in the tests)
        table = table.pin_memory().to(device, non_blocking=True)
    out = torch.zeros(len(addresses), dtype=torch.int64, device=device)
    parts = max(1, min(BLOCKS_PER_IMAGE, -(-max(words) // BLOCK)))
    _COMPILED[(len(addresses), parts)](table[0], table[1], out, stride, BLOCK=BLOCK)
    return out
