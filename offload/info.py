"""`python -m offload.info`: what offload is running on and what is active, and why.

Prints the package's version and folder, torch's version, the CUDA or CANN runtime, the device, the
backend of each operation (native core or pure PyTorch, with the reason), the build target and
which host-memory pinner it registered, what has been verified on which hardware, and the build
information recorded at build time, with a warning when the running torch is not the one offload
was built against.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from . import __version__
from .core import _backend, _device


# What has run where; docs/ascend.md says how the Ascend path is exercised.
VERIFIED = {
    "cuda": "built, tested and measured on NVIDIA GPUs (benchmarks/RESULTS.md names each run's device)",
    "ascend": "built against stub ACL headers and tested on a stand-in npu device in CI "
              "(the suite's second run, OFFLOAD_TEST_DEVICE=npu); not measured on an NPU",
    "to measure": "python -m benchmarks from a clone (bash scripts/bench.sh) on the machine; "
                  "it runs on the npu device where torch_npu sees one",
}

_PINNERS = {"cuda": "cudaHostRegister", "npu": "ACL aclrtHostRegisterV2 (ACL_HOST_REG_PINNED)"}


def host_pinner(core, target: Optional[str]) -> str:
    """Which call pins the native pool's slabs in this build, or why none does."""
    if core is None:
        return "none: no compiled core (host buffers come from torch's pinned allocator)"
    if target not in _PINNERS:
        return f"none: a {target or 'cpu'} build pins nothing (slabs stay pageable)"
    registered = getattr(core, "host_pinner_registered", None)
    if registered is None:
        return f"{_PINNERS[target]}: not reported by this core"
    if registered(target):
        probed = "; checked against the device when the first pool is made" if target == "npu" else ""
        return f"{_PINNERS[target]}, registered{probed}"
    if target == "npu":
        return ("none: the CANN this core was built with lacks ACL_HOST_REG_PINNED "
                "(host buffers come from torch_npu's pinned allocator)")
    return f"none: {_PINNERS[target]} is not registered"


def collect() -> dict:
    versions = _device.runtime_versions()
    native = _backend.native_available()
    info = _backend.build_info()
    features = set(info.get("features", []))
    backend = "native" if native else "pure PyTorch"

    def backend_of(feature: str) -> str:
        return "native" if native and any(f.endswith(feature) for f in features) else "pure PyTorch"

    return {
        "offload": __version__,
        "location": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda runtime": versions.get("cuda"),
        "torch_npu": versions.get("torch_npu"),
        "cann": versions.get("cann"),
        "device": f"{_device.device_name()} ({_device.current_device()})",
        "pinned memory": _device.pinned_memory_supported(),
        "core": backend + ("" if native else f" ({_backend.why_not()})"),
        "operations": {
            "host pool": backend_of("host_pool"),
            "copy engine": backend_of("copy_engine"),
            "bucket packing": backend_of("buckets"),
        },
        "build target": info.get("target", "none (no compiled core)"),
        "host pinner": host_pinner(_backend.loaded_core(), info.get("target")),
        "verified": dict(VERIFIED),
        "build": info or "no compiled core",
        "warning": _backend.torch_mismatch(),
    }


def main() -> int:
    data = collect()
    width = max(len(k) for k in data)
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{key.ljust(width)} :")
            for k, v in value.items():
                print(f"{'':{width}}   {k}: {v}")
        elif value is not None:
            print(f"{key.ljust(width)} : {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
