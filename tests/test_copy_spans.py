"""copy_spans_to_host: byte spans of device storages copied to given offsets of one host
block (given, or acquired from the pool by the call), and the spans it refuses.
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch

import offload
from _copy_helpers import random_tensor


def _storage_bytes(t, lo, n):
    """Bytes [lo, lo + n) of t's storage, on the host."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (n,)).cpu()


def test_copy_spans_to_host_lands_each_span_at_its_offset(backend, device):
    from offload.core.copy import copy_spans_to_host

    base = random_tensor((64, 100), torch.bfloat16, device)
    tensors = [base, base.t(), base[3:9, 10:], random_tensor((5000,), torch.int32, device)]
    starts = [0, 256, 3 * 200 + 20, 4]
    sizes = [64 * 100 * 2, 512, 6 * 200 - 20, 5000 * 4 - 4]
    offsets = [0, 12800 + 512, 12800 + 1536, 12800 + 1536 + 1536]
    pool = offload.default_host_pool()
    out = pool.acquire(offsets[-1] + sizes[-1])
    out.fill_(7)
    for t in tensors:
        t.add_(1)  # queued on the current stream before the call: the copy must see it
    handle = copy_spans_to_host(tensors, starts, sizes, out, offsets, pool=pool, chunk_bytes=4096)
    handle.wait()
    assert handle.nbytes == sum(sizes)
    for t, lo, n, at in zip(tensors, starts, sizes, offsets):
        assert torch.equal(out[at : at + n], _storage_bytes(t, lo, n))
    assert torch.equal(out[12800 : 12800 + 512], torch.full((512,), 7, dtype=torch.uint8))  # gaps untouched


def test_copy_spans_to_host_many_spans_of_odd_sizes_and_offsets(backend, device):
    """A layer's worth of spans and more: odd starts, odd sizes, empty spans, unaligned
    offsets, pieces of a chunk size that splits some of them. On CUDA they go as one
    batched copy call, whose copies run in any order among themselves."""
    from offload.core.copy import copy_spans_to_host

    gen = torch.Generator().manual_seed(3)
    source = random_tensor((1 << 16,), torch.uint8, device)
    starts, sizes, offsets = [], [], []
    at = 0
    for i in range(300):
        size = 0 if i % 37 == 0 else int(torch.randint(1, 3000, (1,), generator=gen))
        start = int(torch.randint(0, source.numel() - size, (1,), generator=gen))
        starts.append(start)
        sizes.append(size)
        offsets.append(at)
        at += size + int(torch.randint(0, 7, (1,), generator=gen))
    pool = offload.default_host_pool()
    out = pool.acquire(at)
    out.fill_(0)
    handle = copy_spans_to_host([source] * len(sizes), starts, sizes, out, offsets, pool=pool, chunk_bytes=1000)
    handle.wait()
    assert handle.nbytes == sum(sizes)
    host_source = source.cpu()
    expected = torch.zeros(at, dtype=torch.uint8)
    for lo, n, dst in zip(starts, sizes, offsets):
        expected[dst : dst + n] = host_source[lo : lo + n]
    assert torch.equal(out, expected)


def test_copy_spans_to_host_into_a_block_it_acquires(backend, device):
    """out given as a byte count: the call takes the block from the pool itself; the
    handle's one tensor is that block, it returns to the pool with the handle, and a timed
    copy reports its seconds."""
    from offload.core.copy import copy_spans_to_host

    pool = offload.HostPool()
    t = random_tensor((3000,), torch.float32, device)
    handle = copy_spans_to_host([t, t], [0, 4000], [4000, 8000], 12800, [0, 4096], pool=pool, timing=True)
    (block,) = handle.wait()
    assert block.dtype == torch.uint8 and block.numel() == 12800 and pool.owns(block)
    assert torch.equal(block[:4000], _storage_bytes(t, 0, 4000))
    assert torch.equal(block[4096 : 4096 + 8000], _storage_bytes(t, 4000, 8000))
    seconds = handle.copy_seconds()
    assert isinstance(seconds, float) and 0.0 < seconds < 1.0  # 12 KiB: well under a second
    assert pool.stats()["in_use_bytes"] == pool.block_bytes(12800)
    del handle, block
    assert pool.stats()["in_use_bytes"] == 0


def test_copy_spans_to_host_rejects_bad_spans(backend, device):
    from offload.core.copy import copy_spans_to_host

    t = random_tensor((100,), torch.float32, device)
    pool = offload.default_host_pool()
    out = pool.acquire(1024)
    with pytest.raises(ValueError, match="one entry per span, got 1, 2, 1 and 1"):
        copy_spans_to_host([t], [0, 4], [8], out, [0], pool=pool)
    with pytest.raises(ValueError, match=r"span 0 is bytes \[300, 500\) of a storage of 400 bytes"):
        copy_spans_to_host([t], [300], [200], out, [0], pool=pool)
    with pytest.raises(ValueError, match=r"span 0 goes to bytes \[1000, 1100\) of out, which has 1024"):
        copy_spans_to_host([t], [0], [100], out, [1000], pool=pool)
    with pytest.raises(ValueError, match=r"span 0 goes to bytes \[0, 100\) of out, which has 64"):
        copy_spans_to_host([t], [0], [100], 64, [0], pool=pool)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(TypeError, match=r"out must be a HostPool block \(a uint8 tensor\) or its size in bytes"):
            copy_spans_to_host([t], [0], [100], bad, [0], pool=pool)
    if backend == "native" and pool.native:
        with pytest.raises(ValueError, match="out must be a block of the pool"):
            copy_spans_to_host([t], [0], [100], torch.empty(1024, dtype=torch.uint8), [0], pool=pool)
