"""What torch offers offload under a whole-model torch.compile, and the partitioner's place in
inductor's configuration.

Served: inductor (the default backend) on a torch whose inductor takes a custom partitioner
(`torch._inductor.config.custom_partitioner_fn`, a `CustomPartitionerFn`). Not served, said
at `enable_activation_offload` where it is known then (a model already compiled with another
backend, a torch without the hook) and otherwise when the first unserved graph runs (ops.py's
`compiled_step`): another backend (aot_eager, eager, cudagraphs, a custom one that does not
call inductor).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import ops

_lock = threading.Lock()
_installed = {"partitioner": None}  # the OffloadPartitioner in inductor's config, while a handle needs it

_WHAT_TO_DO = ("compile the model with the inductor backend (torch.compile(model), model.compile()), "
               "compile its layers instead (layer.compile()), or run it eagerly")


def partitioner_hook() -> Optional[str]:
    """None where this torch's inductor takes a custom partitioner, else why not."""
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: F401
    except ImportError as exc:
        return f"this torch ({torch.__version__}) has no inductor custom partitioner hook ({exc})"
    if not hasattr(config, "custom_partitioner_fn"):
        return f"this torch ({torch.__version__}) has no torch._inductor.config.custom_partitioner_fn"
    return None


def install() -> None:
    """Put offload's partitioner in inductor's config (once; the one there before is chained)."""
    from torch._inductor import config

    from .partitioner import OffloadPartitioner

    with _lock:
        current = config.custom_partitioner_fn
        if _installed["partitioner"] is not None and current is _installed["partitioner"]:
            return
        partitioner = OffloadPartitioner(previous=current)
        config.custom_partitioner_fn = partitioner
        _installed["partitioner"] = partitioner


def uninstall_if_unused() -> None:
    """Restore the partitioner offload replaced once no handle needs it, unless someone set
    another since (then offload's stays in their chain, passing graphs through)."""
    from torch._inductor import config

    from .partitioner import owners_left

    with _lock:
        ours = _installed["partitioner"]
        if ours is None or owners_left():
            return
        if config.custom_partitioner_fn is ours:
            config.custom_partitioner_fn = ours.previous
        _installed["partitioner"] = None


def backend_name(model: torch.nn.Module) -> Optional[str]:
    """The backend `model` was compiled with (torch.compile(model) or model.compile()), or None
    when it is not compiled or the backend cannot be read (a custom callable)."""
    callback = None
    ctx = getattr(model, "dynamo_ctx", None)
    if ctx is not None:
        callback = getattr(ctx, "callback", None)
    compiled = getattr(model, "_compiled_call_impl", None)
    if callback is None and compiled is not None:
        for cell in getattr(compiled, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if hasattr(value, "_torchdynamo_orig_backend"):
                callback = value
                break
    if callback is None:
        return None
    backend = callback
    for _ in range(16):  # the wrappers dynamo puts around a backend, innermost last
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    name = getattr(backend, "compiler_name", None)
    return name if isinstance(name, str) else None


def check_served(fn: str, model: torch.nn.Module) -> None:
    """RuntimeError where `model` is compiled in a way offload cannot serve, naming what to do."""
    name = backend_name(model)
    if name is not None and name != "inductor":
        raise RuntimeError(f"{fn}: model is compiled with backend {name!r}; activation offload of a model compiled "
                           f"whole needs the inductor backend: {_WHAT_TO_DO}")
    if name is not None:
        why = partitioner_hook()
        if why is not None:
            raise RuntimeError(f"{fn}: model is compiled whole, and {why}; {_WHAT_TO_DO}")


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile(model) wraps (an OptimizedModule's `_orig_mod`), else `model`:
    offload wraps the forwards dynamo traces, and names layers as the user's model does."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and getattr(model, "dynamo_ctx", None) is not None else model


def unserved_reason() -> str:
    why = partitioner_hook()
    if why is not None:
        return f"{why.capitalize()}: {_WHAT_TO_DO}."
    return f"Its backend is not inductor (or does not call inductor's partitioner): {_WHAT_TO_DO}."


ops.set_unserved_reason(unserved_reason())
