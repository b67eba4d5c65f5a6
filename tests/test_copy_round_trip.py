"""copy_to_host / copy_to_device round trips: bitwise for every dtype and layout (lazy
conj/neg views, no autograd graph), many small tensors batched with large ones, large
tensors in chunks, and the handle's waits.
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import offload
from _copy_helpers import assert_bitwise, random_tensor


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128, torch.uint16, torch.uint32, torch.uint64]
# Newer bit formats, where this torch has them (moved as bytes like every other dtype).
DTYPES += [getattr(torch, name) for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
           if hasattr(torch, name)]


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
    # Host sources that require grad, going up with and without out: copies, not ops.
    hosts = [torch.randn(4, 5, requires_grad=True), torch.randn(3, requires_grad=True)]
    out = [torch.empty(4, 5, device=device), torch.empty(3, device=device)]
    for up in (offload.copy_to_device(hosts, device, require_pinned=False),
               offload.copy_to_device(hosts, device, out=out, require_pinned=False)):
        for src, b in zip(hosts, up.wait()):
            assert b.grad_fn is None and not b.requires_grad
            assert_bitwise(src.detach().to(device), b)


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
