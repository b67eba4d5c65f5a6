"""What every capability shares: the device layer, the compiled-core loader, the pinned
host pool, the copy engine (native or pure PyTorch), tensor layout rules and timing.

Features (`offload.activation`, `offload.staging`, `offload.weights`) import from here;
nothing here imports a feature.
"""

from ._backend import native_available
from .copy import CopyHandle, copy_to_device, copy_to_host
from .pool import HostPool, default_host_pool

__all__ = ["CopyHandle", "HostPool", "copy_to_device", "copy_to_host", "default_host_pool", "native_available"]
