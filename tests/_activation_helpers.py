"""Models, fixtures and spies shared by the CPU tests of activation offload (tests/test_activation_*.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.activation.auto.planner import MIN_MEASURED_WITHOUT_OFFLOAD

MODES = ["sync", "async", "auto"]
# Steps auto mode measures a shape before its plan runs, where a step without offload fits: the
# first offloads every eligible layer, the others offload nothing.
AUTO_MEASURING_STEPS = 1 + MIN_MEASURED_WITHOUT_OFFLOAD


class Block(nn.Module):
    """Saves transposes, slices, expands, as_strided and overlapping views, a tensor twice,
    int and bool tensors, and views of one storage in several shapes."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.table = nn.Embedding(11, d)

    def forward(self, x):
        h = self.norm(x)
        a = F.gelu(self.up(h))
        y = self.down(a)
        t = (x * 3).t()  # a transposed view is saved by the matmul below
        z = (t @ h).sum() * 1e-3
        s = a[1:, ::2]  # a strided slice
        e = x[:1].expand(x.shape[0], -1)  # a broadcast view
        w = torch.sin(s).sum() * 1e-2 + torch.cos(e)
        flat = y.reshape(-1)
        o = flat.as_strided((flat.numel() - 3, 2), (1, 1))  # overlapping windows of one storage
        o = (o * o).sum() * 1e-2  # the same tensor saved twice
        idx = (x.abs() * 7).long() % 11  # int saved by embedding backward
        emb = self.table(idx[:, 0])
        mask = x > 0  # bool saved by where
        m = torch.where(mask, y, y * 0.5)
        return m + w + emb + z + o


class Model(nn.Module):
    """`mask`: each block's output is multiplied by one mask built without grad, which every
    block's product saves (as every layer saves a padded batch's attention mask)."""

    def __init__(self, d=16, n=4, ckpt=None, mask=False):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.ckpt = ckpt
        self.mask = mask

    def forward(self, x):
        x = self.embed(x)
        mask = (x.detach() > 0).to(x.dtype) if self.mask else None
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            if mask is not None:
                x = x * mask
        return self.head(x).square().mean()


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    return Model(**kw)


def grads_of(model):
    """The gradients of the model's parameters that take one (frozen ones have none)."""
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def settled_budget_plan(handle, step, steps: int = 40):
    """`handle` (auto mode with a memory budget) once its plan's check has settled, running
    `step` (one training step) until then; fails after `steps` steps."""
    for _ in range(steps):
        if handle.plan is not None and handle.plan["check"]["settled"]:
            return handle
        step()
    raise AssertionError(f"the budget plan did not settle in {steps} steps: {handle.plan}")


def train_step(model, *inputs):
    model.zero_grad(set_to_none=True)
    loss = sum(model(x) for x in inputs)
    loss.backward()
    return loss.detach(), grads_of(model)


def predicted_peak_keeping_all(model, x, pool):
    """The peak device memory auto mode predicts for `model` keeping every layer (a budget
    above it), measured on a copy: the yardstick the budget tests scale their budgets by."""
    probe_model = copy.deepcopy(model)
    probe = offload.enable_activation_offload(probe_model, "auto", min_tensor_bytes=0, pool=pool,
                                              memory_budget_bytes=1 << 40, verbose=False)
    for _ in range(3):
        train_step(probe_model, x)
    plan = probe.plan
    probe.disable()
    assert plan["kinds"] == ["keep"] * len(plan["kinds"]) and plan["budget_met"]
    return plan["predicted_peak_bytes"]


def log_layer_backward(model, log, tag):
    """Append (tag, i) to `log` when backward reaches block i's output (a hook on its gradient,
    registered after each forward, as FSDP2 registers its own)."""
    def after_forward(index):
        def hook(module, args, out):
            out.register_hook(lambda grad: log.append((tag, index)))
        return hook

    for index, block in enumerate(model.blocks):
        block.register_forward_hook(after_forward(index))


def assert_step_matches(model, x, reference):
    """One training step of `model` on `x`: loss and gradients bitwise `reference`'s (a train_step result)."""
    loss, grads = train_step(model, x)
    assert torch.equal(loss, reference[0])
    assert_bitwise_equal(grads, reference[1])


@pytest.fixture
def pool():
    return offload.HostPool()


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one intra-op thread is faster and steadier on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def steps_to_run(mode):
    """Steps to run: auto measures two steps, then times its plan and then steps without offload
    (its layers unwrapped): on the CPU, 10 steps cover all three."""
    return 10 if mode == "auto" else 1


class InplaceAfterSave(nn.Module):
    def __init__(self, d, late):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.late = late

    def forward(self, pair):
        x, aux = pair
        y = self.lin(x)
        s = y.exp()  # saves its result
        if self.late is None:
            s.mul_(2)  # in the same layer, after the save
        elif self.late == "next":
            aux.mul_(2)  # the previous layer saved aux
        return s + x, s


class PairModel(nn.Module):
    def __init__(self, late):
        super().__init__()
        self.blocks = nn.ModuleList([InplaceAfterSave(8, None if late == "same" else "save"),
                                     InplaceAfterSave(8, "next"), InplaceAfterSave(8, "save")])
        if late == "same":
            self.blocks[0].late = None
            self.blocks[1].late = "save"

    def forward(self, x):
        pair = (x, x)
        for block in self.blocks:
            pair = block(pair)
        return pair[0].sum()


def log_fetch_and_restore(handle, log, key=lambda event: event):
    """Append ("fetch", key(event)) and ("restore", key(event)) to `log` as the runtime issues a
    copy back and first reads a group from it (its "fetched" and "restored" events; `handle`: an
    ActivationOffload or its engine). The key's default, the event, tells groups apart by `serial`."""
    kinds = {"fetched": "fetch", "restored": "restore"}

    def listen(event):
        if event.kind in kinds:
            log.append((kinds[event.kind], key(event)))

    handle.add_listener(listen)


def log_events(handle, log, kinds=("closed", "released", "fetched", "restored")):
    """Append the handle's (or engine's) events of `kinds` to `log`."""
    handle.add_listener(lambda event: log.append(event) if event.kind in kinds else None)


def use_schedule(engine, n, **kw):
    from offload.activation.auto.schedule import Schedule

    engine.use_plan(Schedule(n, kw.get("caps", [None] * n), kw.get("release_at", {}), kw.get("fetch_at", {}),
                             kw.get("fetch_at_start", []), kw.get("split_at", {}),
                             fetch_share=kw.get("fetch_share", {})))


class StepClock:
    """Stands in for the planner's clock once the plan exists: a step takes 1 s plus
    `overhead` s per offloaded layer (what the probes read), whatever the host does; times
    `slow` during the planner's odd-numbered probes (a machine another tenant slows down
    now and then)."""

    def __init__(self, handle, overhead, slow=1.0):
        self.handle, self.overhead, self.slow = handle, overhead, slow

    def mark(self):
        return None

    def done(self, mark):
        return True

    def seconds(self, a, b):
        probe = next(iter(self.handle.planner.prober.tuning.values()), None)  # the probe reading this step
        factor = self.slow if probe is not None and probe.serial % 2 else 1.0
        return factor * (1.0 + self.overhead * len(self.handle.offloaded_layers()))


class FakeEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self, stream):
        self.clock[0] += 1
        self.at = self.clock[0]
        stream.log.append("record")

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return float(other.at - self.at)


class FakeStream:
    def __init__(self, name):
        self.name, self.log = name, []

    def wait_stream(self, other):
        self.log.append(f"wait_stream {other.name}")

    def wait_event(self, event):
        self.log.append("wait_event")

    def synchronize(self):  # a stream has one; offload's checks look for it
        self.log.append("synchronize")


def async_logging_fetches(pool, **model_kw):
    """(model with an async handle whose fetches and restores go to `log`, handle, log, x,
    the reference gradients of a copy without offload)."""
    ref = small_model(**model_kw)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    log = []
    log_fetch_and_restore(handle, log)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    return model, handle, log, x, grads_ref


def _spy_on(monkeypatch, owner, name, before=None, after=None):
    """Replace `owner.name` (a function of a module, or a method of a class) by a call of it that
    gives `before(args)` what it is called with and `after(args, result)` what it returned."""
    real = getattr(owner, name)

    def spied(*args):
        if before is not None:
            before(args)
        result = real(*args)
        if after is not None:
            after(args, result)
        return result

    monkeypatch.setattr(owner, name, spied)


def _core_hooks():
    """The loaded core, whose hooks an engine binds when it is made (None: the Python hooks)."""
    from offload.core import _backend

    return _backend.loaded_core()


def spy_offloaded(monkeypatch, on_offload):
    """Call `on_offload(t)` for each saved tensor the engines made from now on offload, on either
    hooks' path: the core's pack hook (an engine binds it when made, so patched first) and the
    Python table's `pack_extent`. What they return for a tensor that stays is a (tensor, version)
    tuple; anything else is an offloaded tensor's handle."""
    from offload.activation.pack_table import PackTable

    core = _core_hooks()
    if core is not None:  # (table, tensor)
        _spy_on(monkeypatch, core, "pack_saved_tensor", after=lambda args, packed: on_offload(args[1])
                if type(packed) is not tuple and isinstance(args[1], torch.Tensor) else None)
    _spy_on(monkeypatch, PackTable, "pack_extent",  # (table, engine, tensor, *extent)
            after=lambda args, packed: on_offload(args[2]) if type(packed) is not tuple else None)


def spy_unpacked(monkeypatch, on_unpack):
    """Call `on_unpack(t)` with each tensor the engines made from now on give back to autograd:
    through the core's unpack hook (patched before an engine binds it) where the core is loaded,
    else the backward side's Python `unpack` (the core's hook calls that one too, for what it
    does not serve: patched only where it is the hook; an engine binds it when made)."""
    from offload.activation.backward import BackwardSide

    core = _core_hooks()
    owner, name = (core, "unpack_saved_tensor") if core is not None else (BackwardSide, "unpack")
    _spy_on(monkeypatch, owner, name, after=lambda args, t: on_unpack(t))


def spy_packs(monkeypatch, on_pack):
    """Call `on_pack(in_group)` for each saved tensor that reaches the engines' pack hook from
    now on (`in_group`: a group was open), on the hook's path as `spy_unpacked` picks it: the
    first argument is the core's table or the engine, both with `open_group`."""
    from offload.activation.engine import ActivationEngine

    core = _core_hooks()
    owner, name = (core, "pack_saved_tensor") if core is not None else (ActivationEngine, "pack")
    _spy_on(monkeypatch, owner, name, before=lambda args: on_pack(args[0].open_group is not None))
