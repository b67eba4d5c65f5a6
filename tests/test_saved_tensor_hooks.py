"""The activation engine's hooks in the core against the Python ones.

The core decides in C which saved tensors may be offloaded and what bytes they read
(`offload_extent`); the Python path without the core decides with `saved_tensors.offload_extent`. They
must agree on every kind of tensor autograd saves, on the CPU and on the accelerator.
"""

import contextlib

import pytest
import torch
from torch import nn

from offload.core import _backend, _device
from offload.activation import api, saved_tensors
from offload.activation import engine as act
from _activation_helpers import use_schedule

pytestmark = pytest.mark.native

DEVICES = ["cpu"] + ([str(_device.current_device())] if _device.accelerator_type() is not None else [])


def _cases(device):
    """Tensors as autograd saves them, by what they are."""
    leaf = torch.randn(6, 8, device=device, requires_grad=True)
    a = leaf * 2
    c_leaf = torch.randn(4, 4, dtype=torch.complex64, device=device, requires_grad=True)
    c = c_leaf * 2
    return {
        "activation": a,
        "transpose": a.t(),
        "slice": a[1:, 2:],
        "offset rows": a[2:],
        "expand": a[:1].expand(4, -1),
        "as_strided": a.as_strided((3, 3), (1, 2), 2),
        "dtype view": a.view(torch.int32)[1:, 3:],
        "empty": a[:0],
        "leaf requiring grad": leaf,
        "view of such a leaf": leaf[1:],
        "parameter": nn.Parameter(torch.randn(8, 8, device=device)),
        "leaf without grad": torch.randn(6, 8, device=device),
        "view of a leaf without grad": torch.randn(6, 8, device=device)[1:],
        "view of a frozen parameter": nn.Parameter(torch.randn(6, 8, device=device), requires_grad=False).t(),
        "frozen parameter's detached alias": nn.Parameter(torch.randn(6, 8, device=device), requires_grad=False).detach(),
        "bool (no grad_fn)": a > 0,
        "int (no grad_fn)": (a > 0).long(),
        "cast of an activation": a.to(torch.float64),
        "cast of a leaf (autocast's)": leaf.to(torch.float64),
        "complex": c,
        "conjugated view": c.conj(),
        "negated view": torch._neg_view(c),
        "sparse": a.detach().to_sparse(),
        "on another device": torch.empty(6, 8, device="meta"),
    }


STAYS = {"empty", "leaf requiring grad", "view of such a leaf", "parameter", "view of a frozen parameter",
         "cast of a leaf (autocast's)", "conjugated view", "negated view", "sparse", "on another device"}


@pytest.mark.parametrize("device", [pytest.param(d, marks=() if d == "cpu" else pytest.mark.not_standin(
    "the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")) for d in DEVICES])
@pytest.mark.parametrize("min_bytes", [0, 100, 1 << 30])
def test_offload_extent_core_equals_python(device, min_bytes):
    core = _backend.core()
    device = torch.device(device)
    for name, t in _cases(device).items():
        native = core.offload_extent(t, min_bytes, device)
        python = saved_tensors.offload_extent(t, min_bytes, device)
        assert native == python, name
        big_enough = t.numel() * t.element_size() >= min_bytes
        assert (native is None) == (name in STAYS or not big_enough), name


@pytest.mark.parametrize("device", DEVICES)
def test_offload_extent_reads_the_views_bytes(device):
    """The extent is the bytes the view reads in its storage, and whether it may be a parameter's."""
    device = torch.device(device)
    a = torch.randn(6, 8, device=device, requires_grad=True) * 2
    ptr = a.untyped_storage().data_ptr()
    core = _backend.core()
    assert core.offload_extent(a[2:, 1:5], 0, device) == (ptr, (2 * 8 + 1) * 4, (5 * 8 + 4 + 1) * 4, False)
    assert core.offload_extent(a.t(), 0, device) == (ptr, 0, 48 * 4, False)
    free = torch.randn(6, 8, device=device)
    assert core.offload_extent(free[1:], 0, device)[3] is True  # no grad_fn: checked against parameters


def test_offload_extent_in_backward_stays():
    """A tensor saved while backward runs (a checkpoint's recompute) stays."""
    core = _backend.core()
    a = torch.randn(6, 8, requires_grad=True) * 2
    seen = []
    y = a * 3
    y.register_hook(lambda grad: seen.append((core.offload_extent(a, 0, a.device),
                                              saved_tensors.offload_extent(a, 0, a.device))))
    assert core.offload_extent(a, 0, a.device) is not None
    y.sum().backward()
    assert seen == [(None, None)]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


# The counters a step on the native path and on the pure-PyTorch path must give alike.
_SAME_STATS = ("tensors_kept", "tensors_offloaded", "groups_offloaded", "layers_offloaded", "d2h_bytes", "h2d_bytes",
               "groups_fetched", "groups_prefetched")


@pytest.mark.parametrize("mode,listen", [("async", "always"), ("sync", "always"), ("async", "never"),
                                         ("async", "after_forward"), ("async", "scheduled"),
                                         ("async", "scheduled_pieces")])
def test_engine_uses_the_core_hooks_and_counts_as_python(mode, listen):
    """An engine hooks through the core where it is loaded; the same steps on the pure-PyTorch
    path (what OFFLOAD_FORCE_FALLBACK=1 gives a user) hook through the Python methods, and give
    bitwise the same gradients, the same counters and the same group events in the same order.

    Without a listener (mode async) the core also runs each group's cycle (group_cycle.h), under
    auto mode's schedule too (a cap, a layer in parts, release points, fetch points, a layer
    fetched in pieces), without calling the Python split or fetch once; with a listener added
    between a step's forward and its backward, the Python backward takes up the groups the
    forward left. `scheduled_pieces`: layers in several parts, one span past several part ends,
    groups fetched in two and three pieces, the rest of one fetched on demand."""
    device = _device.current_device()
    x = torch.randn(8, 16, device=device)
    results = {}
    core = _backend.core()
    for native in (True, False):
        with contextlib.nullcontext() if native else _backend.force_fallback():
            model = _Net().to(device)
            handle = api.enable_activation_offload(model, mode, min_tensor_bytes=0, min_group_bytes=0, keep_last=0,
                                                   verbose=False)
            hooks = []  # the pack hook on top of the stack inside an offloaded layer
            model.blocks[1][0].register_forward_pre_hook(
                lambda *_: hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(False)[0]))
            events = []

            def listener(e):
                events.append((e.kind, e.layer, e.part, e.nbytes, e.offset, e.block_bytes))

            if listen == "always":
                handle.add_listener(listener)
            if listen == "scheduled":
                use_schedule(handle.engine, 4, caps=[None, 2048, None, None], release_at={0: [2, 3], 1: 4, 2: 5, 3: 5},
                             fetch_at={3: [2, 1], 2: [1, 0]}, fetch_at_start=[3], split_at={0: [512]},
                             fetch_share={(3, 1): 0.5})
            if listen == "scheduled_pieces":
                # Layer 0's first span passes all its part ends; layers 3, 2 and 0 come back in
                # pieces whose rest no point fetches: their first unpack fetches it.
                use_schedule(handle.engine, 4, release_at={0: [1, 2, 2, 3], 1: [3, 4], 2: 5, 3: 5},
                             fetch_at={3: [2, 1], 2: [1, 0], 1: [0]}, fetch_at_start=[3, 2],
                             split_at={0: [512, 1024, 2048], 1: [2048]},
                             fetch_share={(5, 3): 0.5, (5, 2): 0.3, (3, 2): 0.6, (3, 1): 0.25, (2, 0): 0.2,
                                          (1, 0): 0.5})
            python_calls = {"split": 0, "fetch": 0}
            engine = handle.engine

            def counted(key, call):
                def count(*args):
                    python_calls[key] += 1
                    return call(*args)
                return count

            # What the hooks and the core call (the engine's attributes) and what the Python
            # backward calls itself (its own method).
            engine._split = counted("split", engine._split)
            engine.backward.fetch = engine._fetch_group = counted("fetch", engine.backward.fetch)
            assert engine.native_cycle == (native and mode == "async" and listen != "always")
            steps = []
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                loss = model(x).sum()
                if listen == "after_forward":
                    handle.add_listener(listener)
                    assert not handle.engine.native_cycle
                loss.backward()
                if listen == "after_forward":
                    handle.remove_listener(listener)
                    assert handle.engine.native_cycle == native
                stats = handle.stats()
                steps.append(([p.grad.clone() for p in model.parameters()], {k: stats[k] for k in _SAME_STATS}))
            assert all((getattr(pack, "func", None) is core.pack_saved_tensor) == native for pack in hooks)
            if listen.startswith("scheduled"):  # parts and pieces: in the core's cycle, none in Python
                assert (python_calls["split"] == 0) == native and (python_calls["fetch"] == 0) == native
            results[native] = (steps, events)
            handle.disable()
    (steps_n, events_n), (steps_p, events_p) = results[True], results[False]
    for (grads_n, stats_n), (grads_p, stats_p) in zip(steps_n, steps_p):
        assert stats_n == stats_p and stats_n["tensors_offloaded"] > 0 and stats_n["tensors_kept"] > 0
        assert stats_n["groups_fetched"] > 0 and stats_n["h2d_bytes"] > 0
        assert all(torch.equal(g, h) for g, h in zip(grads_n, grads_p))
        if listen == "scheduled_pieces":  # parts, and pieces whose rest came at an unpack
            assert stats_n["groups_offloaded"] > stats_n["layers_offloaded"]
            assert 0 < stats_n["groups_prefetched"] < stats_n["groups_fetched"]
    assert events_n == events_p and (listen == "never" or listen.startswith("scheduled")) == (not events_n)


def test_core_unpack_raises_for_a_kept_tensor_modified():
    """A kept tensor modified in place after it was saved raises autograd's error through the core's unpack."""
    device = _device.current_device()
    net = _Net().to(device)
    handle = api.enable_activation_offload(net, "async", verbose=False)  # 1 MiB: every tensor stays
    loss = net(torch.randn(8, 16, device=device)).sum()
    with torch.no_grad():
        net.blocks[1][0].weight.add_(1.0)  # saved by its matmul; kept (a parameter)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    handle.disable()


def test_core_hooks_check_their_arguments():
    """Called other than as autograd calls them (table bound, one tensor), the hooks raise a
    TypeError that names them; bound to something other than a PackTable too."""
    core = _backend.core()
    with pytest.raises(TypeError, match="offload._C hook: expected 2 arguments"):
        core.pack_saved_tensor(torch.ones(2))
    with pytest.raises(TypeError, match="offload._C hook: expected 2 arguments"):
        core.unpack_saved_tensor()
    engine = act.ActivationEngine("async", min_tensor_bytes=0)
    with pytest.raises(TypeError, match="pack_saved_tensor: table must be an offload._C.PackTable, got "):
        core.pack_saved_tensor(engine, torch.ones(2, requires_grad=True) * 2)


def test_core_table_refuses_a_group_that_is_not_the_cores():
    """The core's table opens only the core's groups (what its pack writes into)."""
    engine = act.ActivationEngine("async", min_tensor_bytes=0)
    with pytest.raises(TypeError, match=r"open_group: expected a group of the core \(offload._C.ActivationGroup\) "
                                        "or None, got object"):
        engine.open_group = object()
