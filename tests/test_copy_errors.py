"""The errors a user of copy_to_host / copy_to_device can hit: non-tensors, meta and sparse
tensors, a wrong destination, bad sizes and options, tensors on the wrong device (host
sources, which only a CPU-only torch copies) or in unpinned memory.
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch

import offload
from offload.core import _device


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
