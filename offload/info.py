"""`python -m offload.info`: what offload is running on and what is active, and why.

Prints the package's version and folder, torch's version, the CUDA or CANN runtime, the device, the
backend of each operation (native core or pure PyTorch, with the reason), and the
build information recorded at build time, with a warning when the running torch
is not the one offload was built against.
"""

from __future__ import annotations

import os
import sys

import torch

from . import __version__
from .core import _backend, _device


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
        "build": info or "no compiled core",
        "warning": _backend.torch_mismatch(),
    }


def main() -> int:
    data = collect()
    width = max(len(k) for k in data)
    for key, value in data.items():
        if key == "operations":
            print(f"{key.ljust(width)} :")
            for op, where in value.items():
                print(f"{'':{width}}   {op}: {where}")
        elif key == "build" and isinstance(value, dict):
            print(f"{key.ljust(width)} :")
            for k, v in value.items():
                print(f"{'':{width}}   {k}: {v}")
        elif value is not None:
            print(f"{key.ljust(width)} : {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
