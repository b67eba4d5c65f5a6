"""offload: move tensors between accelerator memory and pinned host memory at bus speed.

The public API, nothing else; see README.md. Capabilities live in sub-packages over a
shared core: `offload.core` (device layer, pool, copy engine), `offload.activation`,
`offload.staging` and `offload.weights`.
"""

from .activation import ActivationOffload, activation_offload, enable_activation_offload
from .core import CopyHandle, HostPool, copy_to_device, copy_to_host, default_host_pool, native_available
from .staging import AsyncStager
from .weights import (
    BucketEntry,
    BucketPlan,
    PackedBucket,
    WeightReceiver,
    WeightSender,
    default_bucket_bytes,
    offload_params,
    pack_buckets,
    params_offloaded,
    plan_buckets,
    reload_params,
    unpack_bucket,
)

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
