"""The user API of activation offload: `enable_activation_offload(model)` and its handle
`ActivationOffload`, the `activation_offload()` context for custom loops, and the checks
that pass a forward through untouched (no grad, eval, torch.compile tracing the model).

Auto mode (auto/) is built on this runtime and imports it; the one import the other way is
auto/planner.py's `AutoPlanner`, inside `ActivationOffload.__init__` when mode='auto' (so the
runtime loads, and runs the other modes, without auto mode's modules).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..core.checks import check_bool, check_int, is_int, parse_bytes
from ..core.pool import HostPool
from . import layers as _layers
from .engine import DEFAULT_MIN_TENSOR_BYTES, ActivationEngine, check_options
from .groups import ActivationEvent  # noqa: F401 (the listeners' record, exported by offload.activation)
from .saved_tensors import input_tensors, other_hooks_active

_is_compiling = torch.compiler.is_compiling  # read once: the model's forward asks it every step

# Note [recompute]: a layer auto mode's budget plan recomputes runs its (unwrapped) forward
# under torch's non-reentrant checkpoint, inside the layer's group: the checkpoint saves the
# layer's inputs through the hooks below its own (so they are offloaded with the group) and
# keeps none of the layer's activations; backward runs the forward again with the RNG state
# of the first run (`preserve_rng_state`), so dropout draws the same masks and gradients are
# bitwise those without it. The recomputation runs in backward, outside any capture. A
# layer's key/value cache argument (Hugging Face) is dropped for a recomputed layer, as
# Hugging Face's own gradient checkpointing turns the cache off in training: the second run
# would append its keys and values to the cache again and attend over both.

# Note [torch.compile]: a compiled layer's activations are saved at run time by
# AOTAutograd's autograd function, so they are offloaded like any other (the boundaries are
# opaque to dynamo, `not_traced`). A model compiled whole is traced through the model's
# wrapper, which then records only the handle's marker (compiled/binding.py); offload's
# partitioner rewrites the graphs that hold it (docs/design/compile.md).


def _check_common(fn, mode, min_tensor_bytes, resident_groups, memory_budget_bytes):
    if memory_budget_bytes is not None:
        if isinstance(memory_budget_bytes, (int, float)) and not isinstance(memory_budget_bytes, bool) \
                and memory_budget_bytes < 0:
            raise ValueError(f"{fn}: memory_budget_bytes must be >= 0 bytes, got {memory_budget_bytes}")
        memory_budget_bytes = parse_bytes(memory_budget_bytes, f"{fn}: memory_budget_bytes")
        if mode != "auto":
            raise ValueError(
                f"{fn}: memory_budget_bytes is used by mode='auto' (which chooses the layers to offload "
                f"to meet it), got mode={mode!r}"
            )
    return memory_budget_bytes


def check_process_group(fn: str, group, mode: str):
    """`group` for auto mode's agreement (Note [ranks agree] in auto/ranks.py), checked; None for
    one rank alone."""
    if group is None:
        return None
    if mode != "auto":
        raise ValueError(f"{fn}: process_group is used by mode='auto' (whose plan the ranks agree on), "
                         f"got mode={mode!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: process_group was given but torch.distributed is not initialized; "
                           "call dist.init_process_group first")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{fn}: process_group must be a torch.distributed ProcessGroup (dist.group.WORLD or "
                        f"one from dist.new_group), got {type(group).__name__}")
    return group


class ActivationOffload:
    """What `enable_activation_offload` returns: `.stats()`, `.disable()`, `.paused()`, `.layers`, `.plan`,
    `.add_listener(callback)` / `.remove_listener(callback)` (group events, `ActivationEvent`).

    Note [handle interface]: what auto mode's planner (auto/planner.py) uses of the handle:
    `engine`, `layers` (names), `keep` (per layer: kept on the device whatever the plan),
    `set_offloaded(mask)` (per layer: offloaded from the next forward on),
    `set_recomputed(mask)` (per layer: its forward checkpointed from the next forward on,
    Note [recompute]), `checkpointed` (per layer: the user checkpoints it already) and
    `set_layers_wrapped(on)` (wrap the layers' forwards, or restore them while a plan offloads
    and recomputes nothing). The layer wrappers report each layer's input bytes to the
    planner's `layer_inputs(index, nbytes)` while it measures. `planner` gives auto mode's
    planner (None in the other modes).
    """

    def __init__(self, model, layers, engine, keep, memory_budget_bytes, verbose, process_group=None):
        # The model and its layers are held weakly: their wrapped forwards hold this handle, so
        # strong references back would make a cycle that keeps a dropped model's memory alive
        # until the cyclic collector runs.
        self._model = weakref.ref(model)
        self.engine = engine
        # Layers and the model's output mark every point the engine needs: hooks only where a
        # group is open (Note [hooks in groups only] in engine.py).
        engine.hooks_in_groups_only = True
        self.layers = [name for name, _ in layers]
        self._modules = [weakref.ref(module) for _, module in layers]
        self._keep = keep  # per layer: kept on the device whatever the mode
        self._offload = [not k for k in keep]  # per layer: offloaded in the current plan
        self._recompute = [False] * len(keep)  # per layer: checkpointed by the current plan
        self._enabled = True
        self._paused = False  # inside paused(): forwards run as without offload
        self._auto = None
        if engine.mode == "auto":
            from .auto.planner import AutoPlanner  # the runtime's one import of auto mode (see above)

            self._auto = AutoPlanner(self, memory_budget_bytes, verbose, process_group)
        self._wrapped = []  # weak references to the modules whose forward is wrapped
        # The model compiled whole (Note [torch.compile]).
        self._compiled = _bind_compiled(self, [type(module) for _, module in layers], memory_budget_bytes)
        self._layer_targets = [weakref.ref(_wrap_target(module)) for _, module in layers]
        self._layers_wrapped = False
        try:
            self.set_layers_wrapped(True)
            _layers.wrap_forward(model, self._model_forward)
            self._wrapped.append(weakref.ref(model))
        except Exception:
            self.disable()
            raise

    @property
    def model(self):
        """The model (None once it was freed)."""
        return self._model()

    @property
    def plan(self):
        """Auto mode's plan for the current input shape (a dict), or None in the other modes or
        before the shape is planned.

        A new dict each read, a snapshot of the plan (auto/plan.py's `Plan.to_dict`): the plan
        goes on changing while its probe or budget check runs, so read `handle.plan` again
        after later steps. A snapshot, not a live view, because the planner keeps the plan as
        a typed record and a dict that tracked it would have to mimic every dict operation
        (copying, JSON, comparison) over it; `stats()` gives its counters the same way.
        """
        if self._auto is None:
            return None
        plan = self._auto.current_plan()
        return None if plan is None else plan.to_dict()

    @property
    def planner(self):
        """Auto mode's planner (`auto.planner.AutoPlanner`), or None in the other modes."""
        return self._auto

    @property
    def keep(self) -> List[bool]:
        """Per layer: kept on the device whatever the mode (keep_first, keep_last)."""
        return list(self._keep)

    def set_offloaded(self, mask) -> None:
        """Per layer: whether the next forwards offload it (auto mode's plan, a probe's choice)."""
        self._offload = _check_mask("offload.ActivationOffload.set_offloaded", mask, len(self._keep))

    def set_recomputed(self, mask) -> None:
        """Per layer: whether the next forwards run it under a checkpoint (auto mode's budget plan)."""
        self._recompute = _check_mask("offload.ActivationOffload.set_recomputed", mask, len(self._keep))

    @property
    def checkpointed(self) -> List[bool]:
        """Per layer: the user checkpoints it already (Hugging Face's gradient checkpointing, torch's
        checkpoint_wrapper): its forward's activations are recomputed whatever the plan."""
        return [_layers.user_checkpointed(ref()) for ref in self._modules]

    def recomputed_layers(self) -> List[str]:
        """The names of the layers the current plan recomputes (besides those the user checkpoints)."""
        return [name for name, on in zip(self.layers, self._recompute) if on]

    def offloaded_layers(self) -> List[str]:
        return [name for name, on in zip(self.layers, self._offload) if on]

    def _model_forward(self, original):
        engine = self.engine

        def forward(*args, **kwargs):
            # A disabled or paused handle's step pays this one test (traced or not: under a
            # compile it reads as a dynamo guard).
            if self._paused or not self._enabled:
                return original(*args, **kwargs)
            if _is_compiling():  # traced whole (Note [torch.compile]); the checks below read as dynamo guards
                model = self._model()
                if torch.is_grad_enabled() and model is not None:
                    return self._compiled.traced_forward(model, original, args, kwargs)
                return original(*args, **kwargs)
            model = self._model()
            if (
                not torch.is_grad_enabled()
                or torch.is_inference_mode_enabled()
                or not model.training
                or torch._C._current_graph_task_id() != -1
                or (not engine.capturing and other_hooks_active())
            ):
                return original(*args, **kwargs)
            if self._auto is not None and self._auto.before_forward(args, kwargs):
                # The plan offloads nothing: run exactly as without offload (no hooks, whose
                # per-tensor cost would otherwise be the only overhead left).
                engine.pass_through_step()
                return original(*args, **kwargs)
            # Walked only where a saved tensor needs it (Note [parameter walk] in engine.py). The
            # forward's own inputs stay too: the caller holds them through the forward, so a copy
            # would free nothing.
            with engine.capture(input_tensors(args, kwargs), model):  # the inputs walked first (Note [parameter walk])
                out = original(*args, **kwargs)
            if engine.hooks_in_groups_only:
                engine.backward.mark_backward_start(out)
            return out

        return forward

    def set_layers_wrapped(self, on: bool) -> None:
        """Wrap the layers' forwards (group boundaries), or restore them while auto mode's plan
        for the current shape offloads nothing (then a step runs the layers' own forwards)."""
        check_bool("offload.ActivationOffload.set_layers_wrapped", "on", on)
        if on == self._layers_wrapped or not self._enabled:
            return
        self._layers_wrapped = on
        for index, ref in enumerate(self._layer_targets):
            target = ref()
            if target is None:
                continue
            if on:
                _layers.wrap_forward(target, functools.partial(self._layer_forward, index))
                self._wrapped.append(ref)
            else:
                _layers.unwrap_forward(target)
        if not on:
            self._wrapped = [ref for ref in self._wrapped if ref not in self._layer_targets]

    def _layer_forward(self, index, original):
        engine = self.engine
        last = len(self._modules) - 1
        name = self.layers[index]

        def forward(*args, **kwargs):
            # Not skipped while dynamo traces a compiled layer: the boundary below breaks the graph
            # and runs eagerly, and the compiled region's saved tensors reach the hooks at run time.
            if not engine.capturing or torch._C._current_graph_task_id() != -1:
                return original(*args, **kwargs)
            offload = self._offload[index]
            # The layer's own parameters (FSDP's unsharded ones exist only inside it) stay.
            engine.boundary(name, offload, index, self._modules[index]() if offload else None)
            if engine.observer is not None and self._auto is not None:
                self._auto.layer_inputs(index, _input_bytes(args, kwargs))
            if self._recompute[index]:
                # Note [recompute]
                kwargs = _without_cache(kwargs)
                out = checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
            else:
                out = original(*args, **kwargs)
            schedule = engine.schedule
            if schedule is not None and index in schedule.fetch_at:
                engine.backward.fetch_when_backward_reaches(out, schedule.fetch_at[index], schedule.shares_at(index))
            if index == last:
                engine.boundary(None, layer=last + 1)  # the point after the last layer (auto mode's schedule)
            return out

        return forward

    def add_listener(self, callback) -> None:
        """Call `callback(event)` with an `ActivationEvent` each time a group's copy to the host is
        issued ("closed"), its device tensors are let go ("released"), a copy back is issued
        ("fetched") and backward first reads it back ("restored"). Nothing is made for events
        while no listener is added (Note [events] in engine.py)."""
        self.engine.add_listener(callback)

    def remove_listener(self, callback) -> None:
        """Stop calling `callback` (ValueError if it was not added)."""
        self.engine.remove_listener(callback)

    def stats(self) -> dict:
        """Counters of the current or last step (see ActivationEngine.stats), plus the plan."""
        out = self.engine.stats()
        out["layers"] = list(self.layers)
        out["offloaded_layers"] = self.offloaded_layers()
        out["recomputed_layers"] = self.recomputed_layers()
        out["plan"] = self.plan
        self._compiled.add_stats(out)
        return out

    @contextlib.contextmanager
    def paused(self):
        """Training forwards inside run exactly as without offload (no hooks); the handle, its
        statistics and auto mode's plans stay as they were for the steps after it (a probe of
        auto mode's that was running warms up again). For passes that should not be offloaded,
        and to time a step without offload next to one with it.

            with handle.paused():
                model(batch).loss.backward()
        """
        if self._paused:
            raise RuntimeError("offload.ActivationOffload.paused: already paused (not reentrant)")
        if self._auto is not None:
            self._auto.forget_step_start()
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    def disable(self) -> None:
        """Restore every wrapped forward; saved tensors already offloaded still come back."""
        self._enabled = False
        self._compiled.close()
        for ref in self._wrapped:
            module = ref()
            if module is not None:
                _layers.unwrap_forward(module)
        self._wrapped = []
        self._layers_wrapped = False

    def __repr__(self) -> str:
        return (f"ActivationOffload(mode={self.engine.mode!r}, {len(self.offloaded_layers())} of "
                f"{len(self.layers)} layers offloaded, enabled={self._enabled})")


def _check_mask(fn: str, mask, count: int) -> List[bool]:
    """`mask` as a list of `count` flags, one per layer: True/False (a bool tensor's too)."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 1:
        mask = mask.tolist()
    if isinstance(mask, (str, bytes, dict, torch.Tensor)) or not hasattr(mask, "__len__"):
        raise TypeError(f"{fn}: mask must be a list of True/False, one per layer ({count}), "
                        f"got {type(mask).__name__}")
    if len(mask) != count:
        raise ValueError(f"{fn}: mask must have one entry per layer ({count}), got {len(mask)}")
    flags = []
    for i, on in enumerate(mask):
        if not (isinstance(on, bool) or (is_int(on) and on in (0, 1))):
            raise TypeError(f"{fn}: mask[{i}] must be True or False, got {type(on).__name__} {on!r}")
        flags.append(bool(on))
    return flags


# Keyword arguments through which a Hugging Face layer reads and writes its key/value cache.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(kwargs):
    """A recomputed layer's keyword arguments without its key/value cache (Note [recompute])."""
    if not any(kwargs.get(name) is not None for name in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return kwargs
    kwargs = dict(kwargs)
    for name in _CACHE_KWARGS:
        if name in kwargs:
            kwargs[name] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _input_bytes(args, kwargs) -> int:
    """Bytes of the distinct storages of a layer's tensor inputs: what a checkpoint of it saves."""
    seen, total = set(), 0
    for t in input_tensors(args, kwargs):
        if type(t) is not torch.Tensor:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _bind_compiled(handle, classes, memory_budget_bytes):
    from .compiled import bind

    return bind(handle, classes, memory_budget_bytes)


def _check_params(fn: str, params) -> tuple:
    """`params` (an iterable of tensors never to offload, such as `model.parameters()`) read
    once at the call, so that a wrong element is refused here rather than at the first saved
    tensor; a single tensor stands for itself."""
    if isinstance(params, torch.Tensor):
        return (params,)
    if isinstance(params, (str, bytes, dict)):
        raise TypeError(f"{fn}: params must be an iterable of tensors (model.parameters()), "
                        f"got {type(params).__name__}")
    try:
        params = tuple(params)
    except TypeError:
        raise TypeError(f"{fn}: params must be an iterable of tensors (model.parameters()), "
                        f"got {type(params).__name__}") from None
    for index, item in enumerate(params):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{fn}: params must hold tensors, got {type(item).__name__} at index {index}")
    return params


def _wrap_target(module):
    return _layers.forward_target(module)


def _compiled_root(fn: str, model):
    """The module to wrap: `model`, or the module torch.compile(model) wraps; RuntimeError where
    `model` is compiled in a way offload cannot serve (compiled/support.py)."""
    from .compiled.support import check_served, uncompiled

    check_served(fn, model)
    return uncompiled(model)


def _check_not_enabled(fn: str, model, layers) -> None:
    """RuntimeError where a handle already offloads `model`, or one of its `layers` (a handle of
    a model nested in this one, or of one that shares the layer): one handle per forward."""
    if _layers.forward_wrapped(model):
        raise RuntimeError(f"{fn}: model ({type(model).__name__}) already has activation offload enabled; call "
                           ".disable() on the handle the first enable_activation_offload(model) returned, then "
                           "enable it again (with other options)")
    for name, module in layers:
        if _layers.forward_wrapped(_wrap_target(module)):
            raise RuntimeError(f"{fn}: layer {name!r} ({type(module).__name__}) of model ({type(model).__name__}) "
                               "already has activation offload enabled by another handle (of a model that holds "
                               "it); call .disable() on that handle first")


def enable_activation_offload(
    model: torch.nn.Module,
    mode: str = "async",
    *,
    layers=None,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    min_group_bytes: Optional[int] = None,
    resident_groups: int = 2,
    memory_budget_bytes=None,
    keep_first: int = 0,
    keep_last: int = 1,
    pool: Optional[HostPool] = None,
    timing: bool = True,
    nvtx: bool = False,
    verbose: bool = True,
    process_group=None,
    verify: bool = False,
) -> ActivationOffload:
    """Offload the activations autograd saves in `model`'s layers to pinned host memory.

    Args:
        model: the module whose forward runs a training step (its root is hooked).
        mode: 'async' (copies overlapped with compute, `resident_groups` layers on the device),
            'sync' (each layer's copies waited for; for debugging and comparison) or 'auto'
            (measures the first steps, then offloads what the bus can copy out before backward
            starts, earliest layers first, freed and fetched back at planned points; checked
            against timed steps without offload and backed off while the plan costs over 3%;
            or as few layers as meet `memory_budget_bytes`).
        layers: names (or modules) of the layers to group by; default: FSDP units, else the
            elements of the model's repeated `nn.ModuleList`.
        min_tensor_bytes: saved tensors smaller than this stay on the device.
        min_group_bytes: modes 'async' and 'sync' copy a layer whose offloaded bytes are below
            this together with the layers after it, until the group holds this much (default
            32 x min_tensor_bytes: a group's copies and waits cost host time of their own, more
            than a checkpoint's small input takes on the bus); 0: one group per layer.
        resident_groups: how many groups (layers, or runs of small layers: min_group_bytes)
            may have their activations on the device at once (>= 1).
        memory_budget_bytes: device-memory budget for mode='auto' (int or '20GiB').
        keep_first, keep_last: how many of the first and last layers stay on the device (the
            last layer's activations are needed at once when backward starts); a budget plan
            may still recompute them, their inputs kept on the device.
        process_group: for mode='auto' under FSDP or DDP (e.g. `dist.group.WORLD`): the ranks
            plan from their combined measurements and settle on the same plan at the same step,
            since a copy one rank does not hide stalls them all at the next collective. Every
            rank must then run the same input shapes in the same order (docs/activation.md).
        verify: checksum each offloaded group on the device as it leaves and when it is back, and
            raise `offload.activation.verify.ActivationMismatch` naming the layer and the tensor on
            a difference (a debugging aid: a host wait per group in backward).

    Forwards under no_grad, inference_mode or in eval mode pass through untouched.

        handle = offload.enable_activation_offload(model)            # async, every layer but the last
        handle = offload.enable_activation_offload(model, "auto")    # only what hides under compute
        loss = model(batch).loss; loss.backward(); print(handle.stats())
        handle.disable()
    """
    fn = "offload.enable_activation_offload"
    check_bool(fn, "verbose", verbose)
    engine = ActivationEngine(mode, min_tensor_bytes=min_tensor_bytes, resident_groups=resident_groups,
                              pool=pool, timing=timing, nvtx=nvtx, fn=fn, min_group_bytes=min_group_bytes,
                              verify=verify)
    memory_budget_bytes = _check_common(fn, mode, min_tensor_bytes, resident_groups, memory_budget_bytes)
    process_group = check_process_group(fn, process_group, mode)
    model = _compiled_root(fn, model)
    found = _layers.find_layers(model, layers, fn)
    _check_not_enabled(fn, model, found)
    check_int(fn, "keep_first", keep_first, 0)
    check_int(fn, "keep_last", keep_last, 0)
    count = len(found)
    keep = [i < keep_first or i >= count - keep_last for i in range(count)]
    if all(keep):
        names = [name for name, _ in found]
        warnings.warn(
            f"{fn}: nothing will be offloaded: keep_first={keep_first} + keep_last={keep_last} keep all "
            f"{count} layer(s) found ({', '.join(names[:4])}{', ...' if count > 4 else ''}) on the device; "
            "lower keep_first/keep_last or name finer layers with layers=[...]",
            stacklevel=2,
        )
    # Compiled layers and models compiled whole are supported (Note [torch.compile]).
    return ActivationOffload(model, found, engine, keep, memory_budget_bytes, verbose, process_group)


class activation_offload:  # noqa: N801 - used as a context manager, like torch's save_on_cpu
    """`with offload.activation_offload() as ao:` offloads what autograd saves in the block.

    Groups are explicit: the block starts one group; `ao.boundary()` closes it and starts
    the next (call it between layers or pipeline micro-batches); `ao.boundary(offload=False)`
    starts a span whose tensors stay on the device. Backward may run after the block.
    `params`: tensors never to offload; pass the model's parameters and buffers when some
    are frozen (parameters that require grad, and views of them, are recognised anyway).

        with offload.activation_offload(params=model.parameters()) as ao:
            for block in model.blocks:
                ao.boundary()
                x = block(x)
        loss_fn(x).backward()
    """

    def __init__(self, mode: str = "async", *, min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
                 resident_groups: int = 2, pool: Optional[HostPool] = None, params=(), timing: bool = True,
                 nvtx: bool = False, engine: Optional[ActivationEngine] = None, verify: bool = False):
        fn = "offload.activation_offload"
        # Every option is checked here, also those an explicit `engine` makes unused.
        check_options(fn, mode, min_tensor_bytes, resident_groups, None, pool, timing, nvtx, verify)
        if mode == "auto":
            raise ValueError(f"{fn}: mode='auto' needs layers to measure; use enable_activation_offload(model, "
                             "mode='auto'), or mode='async' or 'sync' here")
        if engine is not None and not isinstance(engine, ActivationEngine):
            raise TypeError(f"{fn}: engine must be an ActivationEngine or None, got {type(engine).__name__}")
        params = _check_params(fn, params)
        if engine is None:
            engine = ActivationEngine(mode, min_tensor_bytes=min_tensor_bytes, resident_groups=resident_groups,
                                      pool=pool, timing=timing, nvtx=nvtx, fn=fn, verify=verify)
        self.engine = engine
        self._params = params
        self._count = 0
        self._capture = None

    def __enter__(self):
        if self._capture is not None:
            raise RuntimeError("offload.activation_offload: this context is already active; create a new one")
        self._capture = self.engine.capture(self._params)
        self._capture.__enter__()
        self.boundary()
        return self

    def boundary(self, name=None, offload: bool = True) -> None:
        """Close the current group and start the next one."""
        fn = "offload.activation_offload.boundary"
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{fn}: name must be a str or None, got {type(name).__name__}")
        check_bool(fn, "offload", offload)
        if self._capture is None:
            raise RuntimeError(f"{fn}: call it inside the `with` block")
        self.engine.boundary(f"group{self._count}" if name is None else name, offload=offload)
        self._count += 1

    def __exit__(self, *exc):
        capture, self._capture = self._capture, None
        capture.__exit__(*exc)
        return False

    def stats(self) -> dict:
        return self.engine.stats()

    def add_listener(self, callback) -> None:
        """As `ActivationOffload.add_listener`: `callback(event)` for each group event."""
        self.engine.add_listener(callback, "offload.activation_offload.add_listener")

    def remove_listener(self, callback) -> None:
        self.engine.remove_listener(callback, "offload.activation_offload.remove_listener")
