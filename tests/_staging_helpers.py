"""State dicts, a model and a bitwise comparison shared by the staging tests (tests/test_staging_*.py)."""

import collections

import torch


def snapshot(obj):
    """A deep copy of a nested state dict, tensors cloned (the expected staged values)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [snapshot(v) for v in obj]
        return type(obj)(*items) if hasattr(type(obj), "_fields") else type(obj)(items)
    return obj


def assert_same(actual, expected, path="sd"):
    """Bitwise equality of nested state dicts; tensors compared as raw bytes on the host."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, path
        assert torch.equal(actual.cpu().contiguous().view(-1).view(torch.uint8),
                           expected.cpu().contiguous().view(-1).view(torch.uint8)), path
        return
    if isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
        return
    assert actual == expected, path


def tensors_in(obj):
    """The tensors of a nested state dict in order, a tensor as often as it appears."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for v in values for t in tensors_in(v)]


def model_and_optimizer(device):
    """A small model with BatchNorm buffers, and its AdamW optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, device):
    """A forward, backward and optimizer step: every parameter, buffer and state tensor changes."""
    model(torch.randn(4, 16, device=device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def rich_state(device):
    """Tied tensors, overlapping and transposed views, a gapped slice, empty and scalar tensors,
    several dtypes and nested containers of other leaves."""
    base = torch.arange(64, dtype=torch.float32, device=device).view(8, 8)
    tied = torch.randn(5, 3, device=device)
    return {
        "tied_a": tied,
        "tied_b": tied,
        "matrix": base,
        "rows": base[2:5],  # overlaps `matrix`
        "transposed": base.t(),  # same memory, other layout
        "gappy": torch.randn(6, 10, device=device)[:, ::3],  # not dense
        "empty": torch.empty(0, 4, device=device),
        "scalar": torch.tensor(3.5, device=device),
        "dtypes": [torch.randn(7, device=device).to(dt) for dt in (torch.bfloat16, torch.float16, torch.float64)]
        + [torch.randint(-5, 5, (9,), device=device), torch.rand(11, device=device) > 0.5],
        "fp8": torch.randn(13, device=device).to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None,
        "nested": collections.OrderedDict(
            lst=[1, 2.5, "s", None, (True, b"x")],
            tup=(torch.ones(2, device=device), {"deep": torch.zeros(3, 2, device=device)}),
        ),
    }
