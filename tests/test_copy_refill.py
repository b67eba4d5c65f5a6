"""Copies into given or reused host buffers: out= a list of tensors or an earlier
CopyHandle, packed groups kept by a refill, the checks a refill makes (shapes, strides,
same_sources).
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch

import offload
from _copy_helpers import assert_bitwise, random_tensor


def test_copy_to_host_reuses_a_handles_buffers(backend, device):
    sources = [random_tensor((n,), torch.bfloat16, device) for n in (5, 700, 40_000)]
    first = offload.copy_to_host(sources, small_bytes=10_000)
    first_ptrs = [t.data_ptr() for t in first.wait()]
    for t in sources:
        t.add_(1)  # queued on the current stream: the next copy must see it
    second = offload.copy_to_host(sources, out=first, small_bytes=10_000)
    for src, h in zip(sources, second.wait()):
        assert_bitwise(src, h)
    assert [t.data_ptr() for t in second.tensors] == first_ptrs


def test_copy_into_given_host_tensors(backend, device):
    pool = offload.HostPool(slab_bytes=4 << 20)
    sources = [random_tensor((4, 9), torch.float32, device), random_tensor((3, 8), torch.int64, device).t()]
    out = [pool.empty(tuple(s.shape), s.dtype) for s in sources]
    handle = offload.copy_to_host(sources, out=out, pool=pool)
    result = handle.wait()
    assert all(r is o or r.data_ptr() == o.data_ptr() for r, o in zip(result, out))
    for src, o in zip(sources, out):
        assert_bitwise(src, o)


def test_copy_to_device_into_given_tensors(backend, device):
    hosts = offload.copy_to_host([random_tensor((n,), torch.float16, device) for n in (3, 1000, 70_000)]).wait()
    out = [torch.empty_like(h, device=device) for h in hosts]
    result = offload.copy_to_device(hosts, device, out=out).wait()
    for h, o, r in zip(hosts, out, result):
        assert_bitwise(h, o)
        assert r.data_ptr() == o.data_ptr()


def test_copy_group_bytes_sets_tensors_per_dma(backend, device):
    """Small tensors share one host block per packed group; groups start at 1 MiB
    (the first DMA starts early) and double up to group_bytes."""
    sources = [random_tensor((16 << 10,), torch.float32, device) for _ in range(64)]  # 64 KiB each, 4 MiB
    blocks = {}
    for group_bytes in (1 << 20, 8 << 20):
        handle = offload.copy_to_host(sources, small_bytes=1 << 17, group_bytes=group_bytes)
        hosts = handle.wait()
        for src, host in zip(sources, hosts):
            assert_bitwise(src, host)
        blocks[group_bytes] = len({h.untyped_storage().data_ptr() for h in hosts})
        refilled = offload.copy_to_host(sources, out=handle).wait()  # a handle keeps its groups
        assert [h.data_ptr() for h in refilled] == [h.data_ptr() for h in hosts]
    if backend == "native":  # the fallback moves each tensor by itself
        assert blocks == {1 << 20: 4, 8 << 20: 3}  # 1+1+1+1 MiB; 1+2 MiB and the last 1 MiB


def test_copy_handle_with_larger_groups_refills(backend, device):
    """A handle made with group_bytes above the default keeps its groups when
    refilled by a call with the default: each packed group still fits its staging."""
    sources = [random_tensor((64 << 10,), torch.float32, device) for _ in range(96)]  # 256 KiB each, 24 MiB
    handle = offload.copy_to_host(sources, group_bytes=32 << 20)
    handle.wait()
    for src in sources:
        src.add_(1)
    refilled = offload.copy_to_host(sources, out=handle).wait()
    for src, host in zip(sources, refilled):
        assert_bitwise(src, host)


def test_copy_to_host_reuses_a_handle_made_from_given_tensors(backend, device):
    sources = [torch.arange(6.0, device=device), torch.arange(300_000.0, device=device)]
    out = [torch.empty(6), torch.empty(300_000)]
    first = offload.copy_to_host(sources, out=out, require_pinned=False)
    first.wait()
    for t in sources:
        t.add_(10)
    second = offload.copy_to_host(sources, out=first, require_pinned=False)
    for src, h, o in zip(sources, second.wait(), out):
        assert_bitwise(src, h)
        assert h.data_ptr() == o.data_ptr()


def test_copy_to_host_checks_every_tensor_against_a_reused_handle(backend, device):
    first = offload.copy_to_host([torch.ones(3, device=device), torch.ones(0, device=device)])
    first.wait()
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        offload.copy_to_host([torch.ones(3, device=device), torch.ones(2, device=device)], out=first)
    with pytest.raises(ValueError, match=r"tensors\[1\] is a meta tensor"):
        offload.copy_to_host([torch.ones(3, device=device), torch.empty(5, device="meta")])


def test_copy_to_host_refill_checks_strides_as_well_as_sizes(backend, device):
    """A refill is checked against how each buffer was laid out, not only its sizes: a
    dense transposed source and a contiguous one of the same shape move different bytes.
    The core refills buffers byte for byte, so it refuses; the fallback copies element
    by element, so its values are right."""
    base = torch.arange(24, dtype=torch.float32, device=device)
    for made_from, refilled_with in ((base.view(6, 4).t(), base.view(4, 6)), (base.view(4, 6), base.view(6, 4).t())):
        first = offload.copy_to_host([made_from, torch.ones(3, device=device)])
        first.wait()
        if backend == "native":
            with pytest.raises(ValueError, match=r"tensors\[0\] now has shape \[4, 6\].*strides"):
                offload.copy_to_host([refilled_with, torch.ones(3, device=device)], out=first)
        else:
            refill = offload.copy_to_host([refilled_with, torch.ones(3, device=device)], out=first)
            refill.wait()
            assert torch.equal(refill.tensors[0], refilled_with.cpu())


@pytest.mark.parametrize("defer", [False, True])
def test_copy_to_host_same_sources(backend, device, defer):
    """same_sources=True refuses a source at another address than the buffers' last fill;
    a refill without it moves that origin."""
    sources = [torch.randn(300 + i, device=device) for i in range(5)]
    first = offload.copy_to_host(sources)
    first.wait()
    again = offload.copy_to_host(sources, out=first, same_sources=True, defer=defer)
    again.wait()
    assert all(torch.equal(h, s.cpu()) for h, s in zip(again.tensors, sources))
    before = [h.clone() for h in first.tensors]
    moved = list(sources)
    moved[3] = sources[3] + 1  # same shape and dtype, other memory
    with pytest.raises(ValueError, match=r"same_sources=True, but tensors\[3\] is at 0x[0-9a-f]+ while the buffers"):
        offload.copy_to_host(moved, out=first, same_sources=True, defer=defer)
    assert all(torch.equal(h, b) for h, b in zip(first.tensors, before))  # one group, checked before it was queued: nothing copied
    refill = offload.copy_to_host(moved, out=first, defer=defer)  # not checked: the new origin
    refill.wait()
    assert torch.equal(refill.tensors[3], moved[3].cpu())
    offload.copy_to_host(moved, out=refill, same_sources=True, defer=defer).wait()  # any handle of the buffers
    with pytest.raises(ValueError, match=r"same_sources=True, but tensors\[3\]"):
        offload.copy_to_host(sources, out=first, same_sources=True, defer=defer)
    with pytest.raises(ValueError, match=r"same_sources=True needs out=<CopyHandle>.*got none"):
        offload.copy_to_host(sources, same_sources=True)
    given = offload.copy_to_host(sources, out=[torch.empty_like(s, device="cpu") for s in sources],
                                 require_pinned=False)
    given.wait()
    with pytest.raises(ValueError, match=r"same_sources=True needs out=<CopyHandle>.*made with an out list"):
        offload.copy_to_host(sources, out=given, same_sources=True)
