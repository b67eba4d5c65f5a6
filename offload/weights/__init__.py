"""Weights on the move: bucket packing, trainer-to-rollout weight sync, parameter offload.

Modules:
- bucket_plan: the plan's records (`BucketEntry`, `BucketPlan`): where each tensor lives, their
  plain-data form and their checks.
- bucket_planner: which tensors go in which bucket, at which offset, in which dtype
  (`plan_buckets`, `Planner`, `DtypePolicy`, the default bucket size).
- bucket_pack: tensors into buckets and back out (`pack_buckets`, `unpack_bucket`, `copy_spans`),
  and what a destination must be to receive in place.
- sync: `WeightSender` and the single-sender protocol (Note [bucket pipeline]).
- receiver: `WeightReceiver`, the receiving side of that protocol.
- sync_options: what sender and receiver share: defaults, argument checks, the double buffer of buckets.
- link: a sync's collectives over a process group, with bounded waits (Note [failed syncs]).
- sources: what a sync sends: (name, tensor) references and their checks.
- many_senders: every trainer rank sends what it owns (`ManySender`, Note [many senders]), and what
  its senders and receivers share (the groups, `Piece`, `SenderPlan`).
- many_receiver: a rollout rank's side of a many-sender sync (`ManyReceiver`): what it keeps of each
  sender's buckets, received round-robin.
- slices: what a receiver keeps of each tensor (`slices=`: a tensor-parallel rank's share).
- ipc: colocated sync through shared device buffers (`transport="ipc"`).
- colocated_many: colocated sync from many senders (`senders=` with `transport="ipc"`, Note
  [colocated senders]): each bucket all-gathered over the trainers into the IPC buffer.
- param_offload: `offload_params` / `reload_params`, a model parked in pinned host memory.
- parked: what a parked module allows, and the errors where it would be misread.
"""

from .bucket_pack import PackedBucket, pack_buckets, unpack_bucket
from .bucket_plan import BucketEntry, BucketPlan
from .bucket_planner import default_bucket_bytes, plan_buckets
from .param_offload import offload_params, params_offloaded, reload_params
from .receiver import WeightReceiver
from .sync import WeightSender

__all__ = [
    "BucketEntry",
    "BucketPlan",
    "PackedBucket",
    "WeightReceiver",
    "WeightSender",
    "default_bucket_bytes",
    "offload_params",
    "pack_buckets",
    "params_offloaded",
    "plan_buckets",
    "reload_params",
    "unpack_bucket",
]
