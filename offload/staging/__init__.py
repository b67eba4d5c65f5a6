"""Async checkpoint staging for torch.distributed.checkpoint. See docs/staging.md, and
docs/design/staging.md for how a save runs.

Modules:
- stager: `AsyncStager`, a save from the state dict to its future (Note [how a save runs]).
- plan: the copy plan of a state dict: units, batches, what a save compares itself (`CopyPlan`).
- ring: the ring of host buffer sets, and how a set knows whether anyone still reads it.
- future: `StagingFuture`, the host state dict of one save.
- growth: the first save's pool growth, on a worker thread.
- host_copy: the copies run on the caller's thread (host sources, tensors past limit_bytes).
- metrics: the per-save records of `AsyncStager.metrics()`.
- state_tree: the shape of a nested state dict, taken apart and rebuilt by generated code.
- object_scan: the per-leaf loops over Python objects (twins of the compiled core's).
"""

from .stager import AsyncStager

__all__ = ["AsyncStager"]
