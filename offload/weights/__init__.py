"""Weights on the move: bucket packing, trainer-to-rollout weight sync, parameter offload."""

from .buckets import (
    BucketEntry,
    BucketPlan,
    PackedBucket,
    default_bucket_bytes,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)
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
