"""copy_to_host / copy_to_device: bitwise round trips for every dtype and layout,
batching of many small tensors, reuse of host buffers, and the errors a user can hit.
Each test runs on the compiled core and on the pure-PyTorch path (`backend`)."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import offload
from offload.core import _device

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128, torch.uint16, torch.uint32, torch.uint64]
# Newer bit formats, where this torch has them (moved as bytes like every other dtype).
DTYPES += [getattr(torch, name) for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
           if hasattr(torch, name)]


def random_tensor(shape, dtype, device, generator=None):
    """Random bits of `dtype` (every bit pattern a copy must preserve, NaNs included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool().to(device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape).to(device)


def bits(t):
    # A fresh 1-D tensor, not t.contiguous(): a tensor whose sizes are all 1 counts
    # as contiguous whatever its strides (e.g. x[::2] of a length-2 x, stride 2),
    # and a byte view of it would be refused.
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.cpu().reshape(-1))
    return flat.view(torch.uint8) if t.dtype != torch.bool else flat


def assert_bitwise(expected, actual):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(bits(expected), bits(actual))


def layouts(device, dtype):
    base = random_tensor((6, 10), dtype, device)
    return {
        "contiguous": base,
        "transposed": base.t(),
        "sliced": base[1:5, ::3],
        "expanded": random_tensor((10,), dtype, device).expand(4, 10),
        "scalar": random_tensor((), dtype, device),
        "empty": random_tensor((0, 7), dtype, device),
        "odd": random_tensor((1023,), dtype, device),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_round_trip_is_bitwise_for_every_dtype_and_layout(backend, device, dtype):
    sources = layouts(device, dtype)
    handle = offload.copy_to_host(list(sources.values()))
    host = handle.wait()
    for (name, src), h in zip(sources.items(), host):
        assert h.device.type == "cpu", name
        assert_bitwise(src, h)
    back = offload.copy_to_device(handle, device).wait()
    for (name, src), b in zip(sources.items(), back):
        assert b.device == src.device, name
        assert_bitwise(src, b)
        assert b.stride() == src.stride(), f"{name}: strides {b.stride()} != {src.stride()}"


def test_copy_synchronize_completes_the_transfer_without_the_tensor_list(backend, device):
    sources = list(layouts(device, torch.float32).values())
    handle = offload.copy_to_host(sources)
    assert handle.synchronize() is None
    assert handle.ready()
    for src, h in zip(sources, handle.tensors):
        assert_bitwise(src, h)
    back = offload.copy_to_device(handle, device)
    back.synchronize()
    assert back.ready()
    for src, b in zip(sources, back.tensors):
        assert_bitwise(src, b)


def test_copy_lazy_conj_and_neg_views_move_their_values(backend, device):
    # A conj/neg view shares its base's bytes and carries a flag; its values are what must arrive.
    z = random_tensor((5, 7), torch.complex64, device)
    x = random_tensor((9, 3), torch.float32, device)
    sources = {"conj": z.conj(), "conj_transposed": z.t().conj(), "neg": torch._neg_view(x),
               "neg_sliced": torch._neg_view(x)[::2], "plain": x}
    for small_bytes in (1 << 20, 0):  # packed with the others, and each alone
        handle = offload.copy_to_host(list(sources.values()), small_bytes=small_bytes)
        for src, h in zip(sources.values(), handle.wait()):
            assert_bitwise(src, h)  # bits() copies, and a copy resolves the flags: values compared
        for src, b in zip(sources.values(), offload.copy_to_device(handle, device).wait()):
            assert_bitwise(src, b)
    hosts = [t.cpu() for t in sources.values()]  # host conj/neg views going up
    for src, b in zip(sources.values(), offload.copy_to_device(hosts, device, require_pinned=False).wait()):
        assert_bitwise(src, b)


def test_copy_outputs_carry_no_autograd_graph(backend, device):
    w = torch.randn(4, 5, device=device, requires_grad=True)
    sources = [w, w * 2, w.t()]  # a leaf, an op output, a view
    handle = offload.copy_to_host(sources)
    for src, h in zip(sources, handle.wait()):
        assert h.grad_fn is None and not h.requires_grad
        assert_bitwise(src.detach(), h)
    for b in offload.copy_to_device(handle, device).wait():
        assert b.grad_fn is None and not b.requires_grad


def test_copy_many_tiny_tensors_and_large_ones_mixed(backend, device):
    gen = torch.Generator().manual_seed(0)
    sources = [random_tensor((int(n),), torch.float32, device, gen)
               for n in torch.randint(1, 40, (2000,), generator=gen)]
    sources.insert(500, random_tensor((300_000,), torch.float32, device, gen))  # above small_bytes
    handle = offload.copy_to_host(sources, small_bytes=64 << 10, chunk_bytes=256 << 10)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)
    assert handle.nbytes == sum(t.numel() * 4 for t in sources)
    for src, b in zip(sources, offload.copy_to_device(handle, device).wait()):
        assert_bitwise(src, b)


def test_copy_large_tensor_moves_in_chunks(backend, device):
    src = random_tensor((3, 1_000_003), torch.int16, device)
    (host,) = offload.copy_to_host([src], chunk_bytes=1 << 20).wait()
    assert_bitwise(src, host)
    (back,) = offload.copy_to_device([host], device, chunk_bytes=1 << 20).wait()
    assert_bitwise(src, back)


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
    assert isinstance(seconds, float) and seconds >= 0.0
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


def test_copy_handle_waits_per_tensor_and_reports(backend, device):
    sources = [random_tensor((100,), torch.float32, device), random_tensor((300_000,), torch.float32, device)]
    handle = offload.copy_to_host(sources, small_bytes=1 << 16)
    assert len(handle) == 2
    handle.wait_stream()
    for i in range(2):
        assert_bitwise(sources[i], handle.wait_tensor(i))
    assert handle.ready()
    assert "2 tensors" in repr(handle)
    with pytest.raises(IndexError, match="out of range"):
        handle.wait_tensor(2)


def test_copy_of_no_tensors(backend, device):
    handle = offload.copy_to_host([])
    assert handle.wait() == [] and handle.nbytes == 0
    assert offload.copy_to_device(handle, device).wait() == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.sampled_from(DTYPES[:8]),
                  st.sampled_from(["plain", "t", "slice", "expand"])),
        min_size=1, max_size=12),
    small=st.sampled_from([0, 64, 4096, 1 << 20]),
)
@example(specs=[([2], torch.float32, "slice")], small=0)  # one element, stride 2: contiguous by torch's rule
def test_copy_round_trip_fuzzed(backend, device, specs, small):
    sources = []
    for shape, dtype, form in specs:
        t = random_tensor(tuple(shape), dtype, device)
        if form == "t" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif form == "slice" and t.dim() >= 1 and t.shape[0] > 1:
            t = t[::2]
        elif form == "expand" and t.dim() >= 1:
            t = t[:1].expand(3, *t.shape[1:]) if t.shape[0] > 0 else t
        sources.append(t)
    handle = offload.copy_to_host(sources, small_bytes=small, chunk_bytes=1 << 12)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)
    for src, b in zip(sources, offload.copy_to_device(handle, device, small_bytes=small).wait()):
        assert_bitwise(src, b)
        assert b.stride() == src.stride()


# ---------------------------------------------------------------- errors


def test_copy_rejects_a_single_tensor_or_non_tensors(backend, device):
    t = torch.zeros(3, device=device)
    with pytest.raises(TypeError, match="list of tensors, got a single tensor"):
        offload.copy_to_host(t)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor, got int"):
        offload.copy_to_host([t, 3])
    with pytest.raises(TypeError, match="pool must be an offload.HostPool"):
        offload.copy_to_host([t], pool="big")


@pytest.mark.not_standin("the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")
def test_copy_rejects_meta_and_sparse_tensors(backend, device):
    with pytest.raises(ValueError, match=r"tensors\[0\] is a meta tensor"):
        offload.copy_to_host([torch.empty(3, device="meta")])
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"tensors\[0\] (has layout|is on)"):
        offload.copy_to_host([sparse.to(device)])


def test_copy_rejects_a_wrong_destination(backend, device):
    src = [torch.zeros(4, 4, device=device)]
    with pytest.raises(ValueError, match=r"out\[0\] has shape \[4, 3\] and dtype float32 but tensors\[0\] has shape"):
        offload.copy_to_host(src, out=[torch.zeros(4, 3)], require_pinned=False)
    with pytest.raises(ValueError, match=r"out\[0\] has shape \[4, 4\] and dtype float16"):
        offload.copy_to_host(src, out=[torch.zeros(4, 4, dtype=torch.float16)], require_pinned=False)
    with pytest.raises(ValueError, match="out has 2 tensors but tensors has 1"):
        offload.copy_to_host(src, out=[torch.zeros(4, 4), torch.zeros(4, 4)], require_pinned=False)
    handle = offload.copy_to_host([torch.zeros(5, device=device)])
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        offload.copy_to_host([torch.zeros(6, device=device)], out=handle)


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


def test_copy_rejects_bad_sizes(backend, device):
    with pytest.raises(ValueError, match="group_bytes must be an int >= 1, got 0"):
        offload.copy_to_host([torch.zeros(2, device=device)], group_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1, got 0"):
        offload.copy_to_host([torch.zeros(2, device=device)], chunk_bytes=0)
    with pytest.raises(ValueError, match="small_bytes must be an int >= 0, got -1"):
        offload.copy_to_device([torch.zeros(2)], small_bytes=-1)


@pytest.mark.cuda
def test_copy_rejects_host_tensors_where_device_tensors_are_expected(backend, device):
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu but a cuda tensor is expected"):
        offload.copy_to_host([torch.zeros(2, device=device), torch.zeros(2)])
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cuda:0 but a cpu tensor is expected"):
        offload.copy_to_device([torch.zeros(2, device=device)], device)


@pytest.mark.cuda
def test_copy_rejects_unpinned_memory_where_pinned_is_required(backend, device):
    with pytest.raises(ValueError, match=r"out\[0\] is not pinned"):
        offload.copy_to_host([torch.zeros(8, device=device)], out=[torch.zeros(8)])
    with pytest.raises(ValueError, match=r"tensors\[0\] is not pinned"):
        offload.copy_to_device([torch.zeros(8)], device)
    (result,) = offload.copy_to_device([torch.arange(8.0)], device, require_pinned=False).wait()
    assert torch.equal(result.cpu(), torch.arange(8.0))


@pytest.mark.multi_gpu
def test_copy_rejects_tensors_on_two_devices(backend):
    a, b = torch.zeros(2, device="cuda:0"), torch.zeros(2, device="cuda:1")
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cuda:1 but tensors\[0\] is on cuda:0"):
        offload.copy_to_host([a, b])


# ---------------------------------------------------------------- streams (GPU)


@pytest.mark.cuda
def test_copy_sees_work_queued_before_the_call(backend, device):
    x = torch.zeros(1 << 22, device=device)
    _device.spin(device, 100_000_000)
    x.fill_(3.0)  # queued behind the spin on the current stream
    (host,) = offload.copy_to_host([x]).wait()
    assert bool((host == 3.0).all())


@pytest.mark.cuda
def test_copy_sources_freed_early_are_not_reused_mid_copy(backend, device):
    x = torch.randn(1 << 22, device=device)
    expected = x.cpu()
    _device.spin(device, 200_000_000)  # the copy stream waits behind this
    handle = offload.copy_to_host([x])
    del x
    y = torch.full((1 << 22,), 7.0, device=device)  # would reuse x's memory without record_stream
    (host,) = handle.wait()
    assert torch.equal(host, expected)
    del y


@pytest.mark.cuda
def test_copy_release_sources_returns_memory_in_stream_order(backend, device):
    x = torch.randn(1 << 22, device=device)
    expected = x.cpu()
    ptr = x.data_ptr()
    _device.spin(device, 200_000_000)  # the copy stream waits behind this, so the copy is still to run
    handle = offload.copy_to_host([x])
    handle.release_sources()  # the current stream waits for the copy on the device; no host wait
    assert not handle.ready()
    del x
    y = torch.full((1 << 22,), 7.0, device=device)  # queued after the wait, in x's memory if it was let go
    if backend == "native":  # the core let go of x at once; the fallback's record_stream keeps it until done
        assert y.data_ptr() == ptr
    (host,) = handle.wait()
    assert torch.equal(host, expected)
    assert bool((y == 7.0).all())


def test_copy_release_sources_on_the_host_is_a_plain_copy(backend, device):
    x = torch.randn(1000, device=device)
    handle = offload.copy_to_host([x])
    handle.release_sources()
    (host,) = handle.wait()
    assert torch.equal(host, x.cpu())


@pytest.mark.cuda
def test_copy_consumer_waits_on_the_device_not_the_host(backend, device):
    hosts = offload.copy_to_host([torch.randn(1 << 20, device=device)]).wait()
    _device.spin(device, 50_000_000)
    handle = offload.copy_to_device(hosts, device)
    handle.wait_stream()  # device-side: returns at once
    (result,) = handle.tensors
    copied = result.clone()  # ordered after the copy on the current stream
    assert torch.equal(copied.cpu(), hosts[0])


@pytest.mark.cuda
def test_copy_both_directions_at_once(backend, device):
    down = [torch.randn(1 << 22, device=device) for _ in range(4)]
    up_src = offload.copy_to_host([torch.randn(1 << 22, device=device) for _ in range(4)]).wait()
    h_down = offload.copy_to_host(down)
    h_up = offload.copy_to_device(up_src, device)
    for src, h in zip(down, h_down.wait()):
        assert torch.equal(src.cpu(), h)
    for h, d in zip(up_src, h_up.wait()):
        assert torch.equal(h, d.cpu())


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


# ---------------------------------------------------------------- deferred enqueue (defer=True)


def _refill_handle(device, count=6, numel=700):
    """Sources and a first copy of them, to refill with defer=True."""
    sources = [random_tensor((numel + i,), torch.bfloat16, device) for i in range(count)]
    first = offload.copy_to_host(sources)
    first.wait()
    return sources, first


def test_copy_defer_needs_a_handle(backend, device):
    sources = [torch.ones(3, device=device)]
    with pytest.raises(ValueError, match=r"offload.copy_to_host: defer=True needs out=<CopyHandle>.*got none"):
        offload.copy_to_host(sources, defer=True)
    with pytest.raises(ValueError, match=r"offload.copy_to_host: defer=True needs out=<CopyHandle>.*got list"):
        offload.copy_to_host(sources, out=[torch.empty(3)], defer=True, require_pinned=False)


def test_copy_defer_refills_a_handle_bitwise(backend, device):
    sources, first = _refill_handle(device)
    ptrs = [t.data_ptr() for t in first.tensors]
    for t in sources:
        t.add_(1)  # queued before the call: the deferred copy must see it
    second = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, second.wait()):
        assert_bitwise(src, h)
    assert [t.data_ptr() for t in second.tensors] == ptrs
    assert second.ready()
    if device.type == "cpu":  # host sources: nothing to defer, done on return
        assert second.nbytes == sum(t.numel() * 2 for t in sources)
    core = offload.core._backend.core()
    if backend == "native" and core is not None:
        from offload.core import copy as _copy

        assert _copy._worker_waited_at_exit  # the worker is waited for at exit
        core.wait_copy_worker()  # nothing pending: returns at once


def test_copy_defer_checks_every_tensor_before_returning(backend, device):
    sources, first = _refill_handle(device)
    stale = list(sources)
    stale[3] = torch.ones(5, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"offload.copy_to_host: .*tensors\[3\]"):
        offload.copy_to_host(stale, out=first, defer=True)
    with pytest.raises(ValueError, match=r"out has 6 tensors but tensors has 5"):
        offload.copy_to_host(sources[:5], out=first, defer=True)
    with pytest.raises(ValueError, match=r"tensors\[2\] is a meta tensor"):
        offload.copy_to_host(sources[:2] + [torch.empty(5, device="meta")] + sources[3:], out=first, defer=True)


def test_copy_defer_of_sources_that_need_a_new_tensor_runs_at_once(backend, device):
    base = random_tensor((8, 10), torch.float32, device)
    waves = random_tensor((5,), torch.complex64, device)
    sources = [base[:, ::3], waves.conj(), torch.ones(4, device=device)]  # a gapped slice, a lazy conj
    first = offload.copy_to_host(sources)
    first.wait()
    base.mul_(2)
    waves.mul_(3)
    second = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, second.wait()):
        assert_bitwise(src, h)


def _copied_with_a_gapped_source(device, at: int):
    """41 sources of 256 KiB copied four a group (group_bytes 1 MiB: eleven groups), source
    `at` a dense copy of a gapped slice; returns (sources, the slice's base, the handle)."""
    sources = [random_tensor((64 << 10,), torch.float32, device) for _ in range(41)]
    base = random_tensor((64, 2048), torch.float32, device)
    sources[at] = base[:, ::2].contiguous()
    first = offload.copy_to_host(sources, group_bytes=1 << 20)
    first.wait()
    return sources, base, first


def _assert_gapped_then_dense_refills(sources, base, first, at: int) -> None:
    """A deferred refill whose source `at` is the gapped slice itself (not dense: made
    contiguous on the copy stream), then one of the dense sources: both bitwise."""
    gapped = list(sources)
    gapped[at] = base[:, ::2]
    torch._foreach_add_(sources, 1.0)
    base.add_(1.0)
    handle = offload.copy_to_host(gapped, out=first, defer=True, timing=True)
    for src, h in zip(gapped, handle.wait()):
        assert_bitwise(src, h)
    assert isinstance(handle.copy_seconds(), float)
    torch._foreach_mul_(sources, 2.0)
    handle = offload.copy_to_host(sources, out=first, defer=True, timing=True)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)
    assert handle.copy_seconds() > 0


def test_copy_defer_late_groups_are_checked_while_the_first_copy(backend, device):
    """A deferred refill's later groups are queued by the worker as the calling thread
    checks them: a stale source in the last group still raises before the call returns
    (the worker stopped after the groups before it), a last-group source that needs a
    new tensor is copied at once by the calling thread, and every copy (and the next
    refill of the same buffers) is bitwise."""
    sources, base, first = _copied_with_a_gapped_source(device, at=40)  # in the last group
    stale = sources[:40] + [torch.ones(5, device=device)]
    with pytest.raises(ValueError, match=r"tensors\[40\]"):
        offload.copy_to_host(stale, out=first, defer=True, timing=True)
    _assert_gapped_then_dense_refills(sources, base, first, at=40)


def test_copy_defer_second_group_source_that_needs_a_new_tensor(backend, device):
    """A source that needs a new tensor in the second group: the first group (queued
    by the calling thread) stays queued, the worker stops before the second, and the
    calling thread copies the rest at once, all bitwise, and the next refill too."""
    sources, base, first = _copied_with_a_gapped_source(device, at=5)  # in the second group
    _assert_gapped_then_dense_refills(sources, base, first, at=5)


def test_copy_seconds_of_a_timed_copy(backend, device):
    sources, first = _refill_handle(device)
    with pytest.raises(ValueError, match=r"offload.CopyHandle.copy_seconds: this copy was not timed"):
        first.copy_seconds()
    timed = offload.copy_to_host(sources, out=first, defer=True, timing=True)
    timed.wait()
    seconds = timed.copy_seconds()
    assert isinstance(seconds, float) and seconds >= 0.0
    plain = offload.copy_to_host(sources, timing=True)  # without defer as well
    plain.wait()
    assert isinstance(plain.copy_seconds(), float)
    back = offload.copy_to_device(plain, device, timing=True)  # and the copy back
    back.wait()
    seconds_back = back.copy_seconds()
    assert isinstance(seconds_back, float) and seconds_back >= 0.0
    timer = back.copy_timer()  # the timing apart from the handle and its buffers
    del back
    assert timer.seconds() == seconds_back
    untimed = offload.copy_to_device(plain, device)
    untimed.wait()
    with pytest.raises(ValueError, match=r"offload.CopyHandle.copy_timer: this copy was not timed"):
        untimed.copy_timer()
    with pytest.raises(ValueError, match=r"not timed; pass timing=True to offload.copy_to_host or "
                       r"offload.copy_to_device"):
        untimed.copy_seconds()


@pytest.mark.cuda
def test_copy_defer_of_many_small_tensors_is_bitwise(backend, device):
    sources = [random_tensor((2048 + i % 7,), torch.bfloat16, device) for i in range(4000)]
    first = offload.copy_to_host(sources, group_bytes=32 << 20)
    first.wait()
    for t in sources[::3]:
        t.neg_()
    handle = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)


@pytest.mark.cuda
def test_device_current_stream_follows_stream_contexts(device):
    """The device layer's current stream (read through a cache of stream objects) is the one
    a stream context makes current, and the default one again after it; on every device."""
    default = _device.current_stream(device)
    sides = [_device.new_stream(device) for _ in range(70)]  # more than the cache holds
    for side in sides:
        assert side != default
        with _device.stream_context(side):
            assert _device.current_stream(device) == side
            assert _device.current_stream(device.index) == side  # the slow path agrees
            assert _device.current_stream(None) == side
        assert _device.current_stream(device) == default


@pytest.mark.cuda
def test_copy_defer_sees_work_queued_before_the_call(backend, device):
    """On a side stream: the worker thread's own current stream is the default one, so a
    worker that ordered the copy after its thread's stream instead of the caller's would
    read the sources before the fills."""
    sources, first = _refill_handle(device, count=64, numel=1 << 14)
    side = _device.new_stream(device)
    side.wait_stream(_device.current_stream(device))
    with _device.stream_context(side):
        _device.spin(device, 100_000_000)
        for i, t in enumerate(sources):
            t.fill_(float(i))  # queued behind the spin on the caller's (side) stream, before the call
        handle = offload.copy_to_host(sources, out=first, defer=True)
    for i, h in enumerate(handle.wait()):
        assert bool((h == float(i)).all())


@pytest.mark.cuda
def test_copy_defer_sources_dropped_at_once_are_not_reused_mid_copy(backend, device):
    sources, first = _refill_handle(device, count=256, numel=1 << 14)
    expected = [t.cpu() for t in sources]
    _device.spin(device, 200_000_000)  # the copy stream waits behind this
    handle = offload.copy_to_host(sources, out=first, defer=True)
    del sources
    junk = [torch.full((1 << 14,), 7.0, device=device, dtype=torch.bfloat16) for _ in range(256)]
    for h, e in zip(handle.wait(), expected):
        assert_bitwise(e, h)
    del junk


@pytest.mark.cuda
def test_copy_defer_many_in_a_row_complete_in_call_order(backend, device):
    """Refills of one set of buffers land in call order, the last one winning: six deferred
    ones, then deferred ones followed at once by a synchronous one (which waits for the
    worker to queue them before queueing its own)."""
    sources, first = _refill_handle(device, count=300, numel=4096)
    values = [[torch.full_like(t, float(k)) for t in sources] for k in range(6)]
    _device.spin(device, 50_000_000)  # the device is busy while the copies are queued
    handle, deferred = first, []
    for k in range(6):
        handle = offload.copy_to_host(values[k], out=handle, defer=True, timing=True)
        deferred.append(handle)
    handle.wait()
    assert all(d.ready() for d in deferred)
    assert all(bool((t == 5.0).all()) for t in handle.tensors)
    for d in deferred:
        seconds = d.copy_seconds()  # complete once the handle is seen done
        assert isinstance(seconds, float) and seconds > 0.0
    _device.spin(device, 50_000_000)
    for k in range(3):
        handle = offload.copy_to_host(values[k], out=handle, defer=True)
    handle = offload.copy_to_host(values[4], out=handle)  # synchronous, after the deferred ones
    handle.wait()
    assert all(bool((t == 4.0).all()) for t in handle.tensors)


@pytest.mark.cuda
@pytest.mark.native
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("seen_by", ["synchronize", "ready"])
def test_copy_seen_complete_holds_no_source(device, defer, seen_by):
    """Once a copy is seen complete (synchronize(), or ready() true), the core holds none of
    its sources: their memory goes back as soon as the caller drops them. (The bindings wait
    without the GIL and drop the sources once they have it back.) The pure-PyTorch path holds
    none at any time (record_stream), so this is the core's."""
    sources, first = _refill_handle(device, count=32, numel=1 << 16)
    handle = offload.copy_to_host(sources, out=first, defer=defer)
    if seen_by == "synchronize":
        handle.synchronize()
    else:
        while not handle.ready():
            pass
    held = _device.memory_allocated(device)
    del sources
    assert _device.memory_allocated(device) <= held - 32 * (1 << 16) * 2


@pytest.mark.cuda
def test_copy_defer_release_sources_and_wait_stream(backend, device):
    sources, first = _refill_handle(device, count=32, numel=1 << 16)
    expected = [t.cpu() for t in sources]
    _device.spin(device, 100_000_000)
    handle = offload.copy_to_host(sources, out=first, defer=True)
    held = _device.memory_allocated(device)
    handle.release_sources()  # waits (host) only for the worker to queue, then on the device
    del sources
    # Neither the worker's finished job nor the in-flight registry keeps them.
    assert _device.memory_allocated(device) <= held - 32 * (1 << 16) * 2
    junk = [torch.full((1 << 16,), 5.0, device=device, dtype=torch.bfloat16) for _ in range(32)]
    handle.wait_stream()
    for h, e in zip(handle.wait(), expected):
        assert_bitwise(e, h)
    assert all(bool((j == 5.0).all()) for j in junk)


def test_copy_to_host_of_host_tensors_is_explicit(backend):
    """Host sources: refused, naming the index, where torch has an accelerator; on a
    CPU-only torch copied into the pool's host memory, which nothing can pin there."""
    pool = offload.HostPool()
    sources = [torch.arange(6.0), torch.arange(4, dtype=torch.int32)]
    if _device.accelerator_type() is not None:
        with pytest.raises(ValueError, match=r"offload.copy_to_host: tensors\[0\] is on cpu but a \w+ tensor is "
                                             r"expected \(data on an accelerator\)"):
            offload.copy_to_host(sources, pool=pool)
        return
    handle = offload.copy_to_host(sources, pool=pool)
    hosts = handle.wait()
    for h, s in zip(hosts, sources):
        assert torch.equal(h, s) and h.data_ptr() != s.data_ptr()
        assert pool.owns(h) and not h.is_pinned() and not pool.pinned


@pytest.mark.cuda
def test_copy_to_host_refuses_host_tensors_on_an_accelerator(backend, device):
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cpu but a cuda tensor is expected"):
        offload.copy_to_host([torch.zeros(2)])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: offload.copy_to_host([torch.zeros(2)], timing="yes"), TypeError,
         "offload.copy_to_host: timing must be True or False, got str"),
        (lambda: offload.copy_to_host([torch.zeros(2)], require_pinned=None), TypeError,
         "offload.copy_to_host: require_pinned must be True or False"),
        (lambda: offload.copy_to_host([torch.zeros(2)], stream=3), TypeError,
         "offload.copy_to_host: stream must be a stream of the accelerator or None, got int"),
        (lambda: offload.copy_to_device([torch.zeros(2)], device=""), ValueError,
         "offload.copy_to_device: device '' is not a device torch knows here"),
        (lambda: offload.copy_to_device([torch.zeros(2)], device=(1,)), TypeError,
         "offload.copy_to_device: device must be a torch.device, a device string, an index or None, got tuple"),
        (lambda: offload.copy_to_device([torch.zeros(2)], timing=1), TypeError,
         "offload.copy_to_device: timing must be True or False, got int"),
    ],
)
def test_copy_options_checked_with_the_functions_name(backend, call, error, message):
    with pytest.raises(error, match=message):
        call()
