"""offload: move tensors between accelerator memory and pinned host memory at bus speed.

The public API, nothing else; see README.md.
"""

from ._backend import native_available
from .activation import ActivationOffload, activation_offload, enable_activation_offload
from ._copy import CopyHandle, copy_to_device, copy_to_host
from ._pool import HostPool, default_host_pool

__version__ = "0.1.0"

__all__ = [
    "ActivationOffload",
    "activation_offload",
    "enable_activation_offload",
    "CopyHandle",
    "HostPool",
    "copy_to_device",
    "copy_to_host",
    "default_host_pool",
    "native_available",
    "__version__",
]
