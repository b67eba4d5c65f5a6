"""benchmarks/bare_copies.py: plain copies of layers' saved tensors change nothing a step
computes, copy exactly the chosen layers' saved activations, and undo their hooks."""

import gc
import weakref

import pytest
import torch

from benchmarks.bare_copies import BareCopies


class _Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def _model(layers=3, width=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Block(width) for _ in range(layers)])


def _grads(model, x, context=None):
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(x).square().sum()
        loss.backward()
    else:
        with context():
            loss = model(x).square().sum()
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("count,back", [(1, False), (1, True), (2, True), (3, True)])
def test_bare_copies_leave_the_step_bitwise_unchanged(count, back):
    model = _model()
    x = torch.randn(4, 16)
    loss, grads = _grads(model, x)
    bare = BareCopies(model, list(model), count, back, min_tensor_bytes=0)
    bare_loss, bare_grads = _grads(model, x, bare.active)
    assert torch.equal(loss, bare_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, bare_grads))


def test_bare_copies_copy_the_chosen_layers_saved_activations():
    model = _model()
    x = torch.randn(4, 16)
    bare = BareCopies(model, list(model), 2, back=True, min_tensor_bytes=0)
    _grads(model, x, bare.active)
    # Each block saves its input (for the weight's gradient) and the linear's output (for
    # gelu's); its weight is a parameter, left out.
    first = model[0].linear(x)
    second_in = torch.nn.functional.gelu(first)
    second = model[1].linear(second_in)
    expected = {(0, 0): x, (0, 1): first, (1, 0): second_in, (1, 1): second}
    assert sorted(bare._host) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(bare._host[key], value.detach())
        assert torch.equal(bare._scratch[key], value.detach())  # the copy back
    assert bare.bytes_per_step == sum(v.numel() * v.element_size() for v in expected.values())


def test_bare_copies_leave_small_tensors_and_inactive_steps_alone():
    model = _model()
    x = torch.randn(4, 16)
    bare = BareCopies(model, list(model), 1, back=True, min_tensor_bytes=4 * 16 * 4 + 1)
    _grads(model, x, bare.active)
    assert bare.bytes_per_step == 0 and not bare._host
    bare = BareCopies(model, list(model), 1, back=True, min_tensor_bytes=0)
    _grads(model, x)  # hooks in place, not active
    assert bare.bytes_per_step == 0 and not bare._host


def test_bare_copies_remove_their_hooks_and_let_their_buffers_go():
    model = _model()
    bare = BareCopies(model, list(model), 2, back=True, min_tensor_bytes=0)
    assert any(block._forward_hooks for block in model)
    _grads(model, torch.randn(4, 16), bare.active)
    host = weakref.ref(bare._host[(0, 0)])
    bare.remove()
    assert not any(block._forward_hooks or block._forward_pre_hooks for block in model)
    # The benchmark makes one per case and shape: none may keep its pinned and device buffers.
    alive = weakref.ref(bare)
    del bare
    gc.collect()
    assert alive() is None and host() is None


@pytest.mark.parametrize("count", [0, 4])
def test_bare_copies_reject_a_count_outside_the_layers(count):
    model = _model()
    with pytest.raises(ValueError, match=rf"BareCopies: count must be within 1\.\.3 .*got {count}"):
        BareCopies(model, list(model), count)
