"""Activation offload: saved activations go to pinned host memory during forward and come
back ahead of backward. See docs/activation.md.

Modules: api (the user API and its handle), engine and backward (the saved-tensor hooks,
groups' copies out and back), groups (the data model), saved_tensors (per-tensor helpers),
layers (layer discovery and wrapping), planner (auto mode's measuring and probes), schedule
(auto mode's plan as pure functions), budget (keep / offload / recompute per layer for a memory
budget, pure functions), budget_run (the budget plan's inputs and its check against timed steps),
ranks (auto mode's measurements combined across a process group's ranks).
"""

from .api import ActivationOffload, activation_offload, enable_activation_offload

__all__ = ["ActivationOffload", "activation_offload", "enable_activation_offload"]
