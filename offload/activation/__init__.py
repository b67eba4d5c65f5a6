"""Activation offload: saved activations go to pinned host memory during forward and come
back ahead of backward. See docs/activation.md.

The runtime (this package's modules): api (the user API and its handle), engine (the saved-tensor
hooks, the captures, statistics and events), forward (its forward side: groups opened and
closed at layer boundaries, the copies out, the window, auto mode's release points), backward
(its backward side: groups' copies back and their release in backward), groups (the data
model: the Python twin of the core's groups), pack_table (what the pack hook consults: the
Python twin of the core's table), saved_tensors (per-tensor helpers), layers (layer discovery
and wrapping), step_stats (per-step counters and the device timings that feed them), verify
(`verify=True`: each group's checksums out and back).

Auto mode (auto/, see its docstring for its modules: planner, shared, measure, memory, schedule,
probes, search, budget, budget_plan, budget_checks, ranks) is built on the runtime and
imports it; the runtime imports auto mode only where api.py builds its planner.

A model compiled whole (compiled/, see its docstring: ops, layout, transport, layer_map,
rewrite, plan, costs, partitioner, support, binding; docs/design/compile.md; its auto plan uses
auto mode's schedule margins and bus probe) is offloaded by offload's
partitioner and ops inside the compiled graphs; api.py binds each handle to it.
"""

from .api import ActivationEvent, ActivationOffload, activation_offload, enable_activation_offload

__all__ = ["ActivationEvent", "ActivationOffload", "activation_offload", "enable_activation_offload"]
