"""Random tensors and a bitwise comparison shared by the copy tests (tests/test_copy_*.py)."""

import torch


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
