"""A handle's side of a whole-model compile: the marker its model's forward records while
dynamo traces it, the partition of the graphs that hold that marker, and the counters of the
compiled steps.

Made by `enable_activation_offload` for every handle (the partitioner must be in inductor's
configuration before a later `torch.compile` traces the model); costs nothing while the model
runs eagerly.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from ...core import _device
from . import costs, ops, partitioner, support
from .layer_map import LayerMatcher, map_layers
from .plan import CompiledPlan, SavedBytes, StepCosts, budget_plan, hidden_plan
from .rewrite import (RewriteOptions, choose_groups, rewrite_backward, rewrite_forward, saved_tensors,
                      window_tail)
from .transport import GroupTransport


@dataclass(frozen=True)
class BindingOptions:
    """What a compiled graph's plan and rewrite need of the handle's options."""

    names: Sequence[str]  # the layers, as the handle names them (relative to its model)
    mode: str
    resident_groups: int
    min_tensor_bytes: int
    memory_budget_bytes: Optional[int]
    timing: bool


class CompiledBinding:
    """Ties one handle to the compiled graphs of its model."""

    def __init__(self, options: BindingOptions, pool, keep: Callable[[], List[bool]],
                 offloaded: Callable[[], List[bool]], classes: Callable[[], list] = list):
        why = support.partitioner_hook()
        self.options = options
        self._keep = keep  # per layer: kept on the device whatever the plan
        self._offloaded = offloaded  # per layer: the handle's current offload mask
        self._classes = classes  # per layer: its module's class (None where it is gone)
        self.transport = GroupTransport(pool, options.timing)
        self.runtime = self.transport.id
        self.plan: Optional[CompiledPlan] = None  # of the last graph partitioned
        self.graphs = 0  # graphs of this model partitioned with offload
        self.served = why is None
        if self.served:
            partitioner.register_owner(self.runtime, self)
            support.install()

    # ------------------------------------------------------------ tracing

    def traced_forward(self, model, original, args, kwargs):
        """The model's forward while dynamo traces it: the marker, then the forward itself.
        Nothing else of offload's runs in the trace, so nothing breaks the graph. The marker
        only where autograd will record a backward (a parameter or an input requires grad):
        AOTAutograd compiles any other graph without a partition, which would leave it unserved.
        The checks read as dynamo guards."""
        if any(p.requires_grad for p in model.parameters()) or any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in itertools.chain(args, kwargs.values())):
            ops.compiled_step(self.runtime, False, "")
        return original(*args, **kwargs)

    # ------------------------------------------------------------ partition

    def partition(self, partition_fn, gm: fx.GraphModule, joint_inputs, kwargs):
        """Partition `gm` (a joint graph of this handle's model) and rewrite the result."""
        names = list(self.options.names)
        matcher = LayerMatcher(names, self._classes())
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        budget = self.options.memory_budget_bytes if self.options.mode == "auto" else None
        pristine = _copy_graph_module(gm) if budget is not None else None
        fw, bw = partition_fn(gm, joint_inputs, **kwargs)
        keep = self._keep()
        device = _offload_device()
        rewrite = RewriteOptions(self.runtime, 1 if self.options.mode == "sync" else self.options.resident_groups,
                                 self.options.min_tensor_bytes, device)
        if budget is None and self.options.mode == "auto":
            plan = self._hidden_plan(fw, bw, num_fwd_outputs, matcher, keep, rewrite)
        elif budget is None:
            plan = CompiledPlan(list(self._offloaded()), [False] * len(names))
        else:
            saved = _saved_bytes(fw, num_fwd_outputs, map_layers(fw.graph, matcher), len(names), rewrite)
            plan = budget_plan(saved, keep, budget, _base_bytes(device), rewrite.resident_groups)
            if any(plan.recompute):
                gm = pristine
                partitioner.tag_recompute(gm, map_layers(gm.graph, matcher), plan.recompute)
                fw, bw = partition_fn(gm, joint_inputs, **kwargs)
        if plan.release_after is not None:
            rewrite = dataclasses.replace(rewrite, release_after=plan.release_after, first_fetch_at=plan.first_fetch_at)
        layers = map_layers(fw.graph, matcher)
        groups, staying = window_tail(choose_groups(fw, num_fwd_outputs, layers, plan.offload, rewrite), rewrite)
        if staying:
            plan.notes.append(f"{', '.join(names[g.layer] for g in staying)} stay on the device: the resident window "
                              "would let them go at the forward's end and bring them back as backward starts")
        if groups:
            hosts = rewrite_forward(fw, num_fwd_outputs, groups, layers, rewrite, staying)
            rewrite_backward(bw, groups, hosts, rewrite, map_layers(bw.graph, matcher, backward=True))
        marker = partitioner.marker_of(fw.graph)
        if marker is not None:
            recomputed = [i for i, on in enumerate(plan.recompute) if on]
            marker.args = (self.runtime, True, ops.plan_text([g.layer for g in groups], recomputed))
            fw.recompile()
        self.plan = plan
        self.graphs += 1
        return fw, bw

    def _hidden_plan(self, fw, bw, num_fwd_outputs, matcher, keep, rewrite: RewriteOptions) -> CompiledPlan:
        """Auto mode without a budget: the layers whose copies hide under the graphs' estimated
        compute (plan.hidden_plan). On the host a copy is synchronous, so none hides."""
        count = len(self.options.names)
        if not _device.is_accelerator(rewrite.device):
            plan = CompiledPlan([False] * count, [False] * count)
            plan.notes.append("on the host every copy is synchronous: no layer's copy hides under compute")
            return plan
        fw_layers = map_layers(fw.graph, matcher)
        saved = _saved_bytes(fw, num_fwd_outputs, fw_layers, count, rewrite)
        compute = costs.graph_compute(fw.graph, bw.graph, fw_layers, map_layers(bw.graph, matcher, backward=True),
                                      count)
        rate, d2h_bps, h2d_bps = costs.measured(rewrite.device, compute.dtype)
        step = StepCosts(saved.per_layer, [f / rate for f in compute.forward], [f / rate for f in compute.backward],
                         compute.forward_rest / rate, compute.backward_rest / rate, d2h_bps, h2d_bps)
        offloaded = self._offloaded()
        eligible = [offloaded[i] and not keep[i] for i in range(count)]
        return hidden_plan(eligible, step)

    def _plan_dict(self) -> Optional[dict]:
        """The plan of the last compiled forward, as its graph carries it; the budget's estimate
        where this process partitioned the graph (not for a graph from the compile cache)."""
        if not self.transport.steps_served:
            return None
        offloaded, recomputed = self.transport.graph_layers
        count = len(self.options.names)
        out = {"offload": [i in offloaded for i in range(count)], "recompute": [i in recomputed for i in range(count)],
               "device_bytes": None, "budget": None, "notes": []}
        if self.plan is not None:
            estimate = self.plan.to_dict()
            out.update({k: estimate[k] for k in ("device_bytes", "budget", "notes")})
        return out

    def cache_key(self) -> str:
        """What a graph's rewrite depends on besides the graph: the options and the current plan's
        inputs (part of the partitioner's uuid, so compiled graphs are cached per plan)."""
        device = _offload_device()
        base = _base_bytes(device) if self.options.memory_budget_bytes is not None else 0
        return repr((self.options, self._keep(), self._offloaded(), base))

    # ------------------------------------------------------------ handle

    def add_stats(self, out: dict) -> None:
        """Into the handle's `stats()`: once compiled steps ran, their counters replace the eager
        engine's (which then saw none of the step), and the compiled plan is added."""
        out["compiled_steps"] = self.transport.steps_served
        out["compiled_plan"] = self._plan_dict()
        if self.transport.steps_served:
            out.update(self.transport.counters_dict())

    def close(self) -> None:
        """The handle is disabled: its graphs no longer find it (they run on, see transport_for)."""
        if self.served:
            partitioner.unregister_owner(self.runtime)
            support.uninstall_if_unused()


def bind(handle, classes: Sequence[type], memory_budget_bytes) -> CompiledBinding:
    """The binding of `handle` (api.py's ActivationOffload), from its public interface and its
    engine's options; `classes`: each layer's module class."""
    engine = handle.engine
    names = list(handle.layers)
    options = BindingOptions(names, engine.mode, engine.resident_groups, engine.min_tensor_bytes, memory_budget_bytes,
                             engine.timing)

    def offloaded() -> List[bool]:
        chosen = set(handle.offloaded_layers())
        return [name in chosen for name in names]

    classes = list(classes)
    return CompiledBinding(options, engine.pool, lambda: handle.keep, offloaded, lambda: classes)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with nodes of its own (their meta dicts copied, the values in them shared):
    the partitioner edits the graph it is given."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _offload_device() -> torch.device:
    """The device whose saved tensors a graph offloads: the one offload's transport copies from
    (the current accelerator, else the CPU). Tensors elsewhere stay: on a host with an
    accelerator, a model compiled on the CPU holds host memory already, which the eager engine
    leaves alone too."""
    return _device.current_device()


def _base_bytes(device: torch.device) -> int:
    """Device memory in use as the graph compiles (parameters, optimizer state, the batch): the
    budget plan's estimate starts from it."""
    return _device.memory_allocated(device) if _device.is_accelerator(device) else 0


def _saved_bytes(fw, num_fwd_outputs, layers, count, rewrite) -> SavedBytes:
    """What the partitioned forward saves, per layer (what may be offloaded) and the rest."""
    groups = choose_groups(fw, num_fwd_outputs, layers, [True] * count, rewrite)
    per_layer = [0] * count
    for group in groups:
        per_layer[group.layer] = group.nbytes
    total = 0
    for node in saved_tensors(fw, num_fwd_outputs):
        val = node.meta["val"]
        # Graph inputs (parameters, the batch) are in the base bytes already.
        if node.op != "placeholder" and all(type(n) is int for n in val.shape):
            total += val.numel() * val.element_size()
    return SavedBytes(per_layer, max(0, total - sum(per_layer)))
