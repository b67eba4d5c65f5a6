"""offload: move tensors between accelerator memory and pinned host memory at bus speed.

The public API, nothing else; see README.md.
"""

from ._backend import native_available
from ._copy import CopyHandle, copy_to_device, copy_to_host
from ._pool import HostPool, default_host_pool
from .activation import ActivationOffload, activation_offload, enable_activation_offload
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
from .staging import AsyncStager
from .weight_sync import WeightReceiver, WeightSender

__version__ = "0.1.0"

__all__ = [
    "ActivationOffload",
    "AsyncStager",
    "BucketEntry",
    "BucketPlan",
    "CopyHandle",
    "HostPool",
    "PackedBucket",
    "WeightReceiver",
    "WeightSender",
    "activation_offload",
    "copy_to_device",
    "copy_to_host",
    "default_bucket_bytes",
    "default_host_pool",
    "enable_activation_offload",
    "native_available",
    "offload_params",
    "pack_buckets",
    "params_offloaded",
    "plan_buckets",
    "reload_params",
    "unpack_bucket",
    "__version__",
]
