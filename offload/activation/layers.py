"""Find the layers of a model to group activations by, and wrap their forwards.

Which modules are "layers", in order of preference:
1. the names the user gives;
2. FSDP units (FSDP1 `FullyShardedDataParallel`, FSDP2 `fully_shard` modules) below the root,
   the innermost where units nest;
3. the elements of the model's repeated `nn.ModuleList` (the transformer blocks, e.g. Hugging
   Face `model.model.layers`), the list holding the most parameters.

A layer's forward is replaced by an instance attribute that marks a group boundary and
then calls the original. Wrapping `forward` (not `__call__`) keeps the boundary outside
checkpoint wrappers that checkpoint `forward` (Hugging Face >= 5, FSDP2's
`checkpoint_wrapper` as a list element) and inside FSDP2's pre-forward hook, so a layer's
unsharded parameters exist when its group opens. FSDP1 unshards inside its own forward,
so its inner `_fsdp_wrapped_module` is the module wrapped. A copy of a wrapped module
(deepcopy, pickle) gets a plain forward of its own (`_WrappedForward`), not the wrapper.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

from torch import nn


def _fsdp_classes():
    classes = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        classes.append(FullyShardedDataParallel)
    except Exception:  # pragma: no cover - torch built without distributed
        pass
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(where, fromlist=["FSDPModule"])
            classes.append(module.FSDPModule)
            break
        except Exception:
            continue
    return tuple(classes)


def _fsdp_units(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The innermost FSDP units below the root (units that hold no other unit).

    Nested units (`fully_shard` on each block, then on a module holding the blocks) are the
    usual way to shard: the blocks are the layers, and the outer unit's own modules (a final
    norm) run inside the span of the last block before them.
    """
    classes = _fsdp_classes()
    if not classes:
        return []
    units = [(name, module) for name, module in model.named_modules()
             if module is not model and isinstance(module, classes)]
    return [(name, module) for name, module in units
            if not any(inner.startswith(name + ".") for inner, _ in units)]


def _repeated_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    best, best_params = [], -1
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best_params = params
            best = [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(module)]
    return best


def _named_layers(model: nn.Module, layers, fn: str) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of each layer the user named (`layers`: names or submodules of
    `model`, or one of them), checked: each a submodule, none twice, none inside another."""
    if isinstance(layers, (str, nn.Module)):
        layers = [layers]
    else:
        try:
            layers = list(layers)
        except TypeError:
            raise TypeError(f"{fn}: layers must be a list of module names or modules (or one of them, or "
                            f"None), got {type(layers).__name__}") from None
    found = []
    by_module = {id(m): n for n, m in model.named_modules()}
    for item in layers:
        if isinstance(item, nn.Module):
            if id(item) not in by_module or item is model:
                raise ValueError(f"{fn}: layers contains a module that is not a submodule of model "
                                 f"({type(item).__name__})")
            found.append((by_module[id(item)], item))
        elif isinstance(item, str):
            try:
                module = model.get_submodule(item)
            except AttributeError:
                known = [n for n, _ in model.named_modules() if n][:8]
                raise ValueError(
                    f"{fn}: layers names {item!r}, which is not a submodule of model; "
                    f"names look like {known}"
                ) from None
            if module is model:
                raise ValueError(f"{fn}: layers may not name the model itself ({item!r})")
            found.append((item, module))
        else:
            raise TypeError(f"{fn}: layers must hold module names or modules, got {type(item).__name__}")
    if not found:
        raise ValueError(f"{fn}: layers is empty; pass None to find the layers automatically")
    if len({id(m) for _, m in found}) != len(found):
        raise ValueError(f"{fn}: layers names the same module twice")
    names = [n for n, _ in found]
    for outer in names:
        inner = [n for n in names if n.startswith(outer + ".")]
        if inner:
            raise ValueError(f"{fn}: layers names {outer!r} and {inner[0]!r} inside it; name only one of them")
    return found


def find_layers(
    model: nn.Module, layers: Optional[Sequence] = None, fn: str = "offload"
) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of each layer, in forward order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    if layers is not None:
        return _named_layers(model, layers, fn)
    if next(model.parameters(), None) is None and not list(model.children()):
        raise ValueError(f"{fn}: model has no submodules and no parameters, so there are no layers to offload")
    found = _fsdp_units(model) or _repeated_blocks(model)
    if not found:
        raise ValueError(
            f"{fn}: found no layers in {type(model).__name__}: no FSDP units and no nn.ModuleList of "
            "repeated blocks; name them with layers=['blocks.0', ...]"
        )
    return found


def user_checkpointed(module: Optional[nn.Module]) -> bool:
    """Whether the user checkpoints `module`'s forward already: Hugging Face's gradient
    checkpointing (a layer's `gradient_checkpointing` flag) or torch's `checkpoint_wrapper`."""
    if module is None:
        return False
    if getattr(module, "gradient_checkpointing", False) is True:
        return True
    return type(module).__name__ == "CheckpointWrapper"


def forward_target(module: nn.Module) -> nn.Module:
    """The module whose forward runs after the layer's parameters are unsharded."""
    inner = getattr(module, "_fsdp_wrapped_module", None)
    fsdp1 = _fsdp_classes()[:1]
    if inner is not None and fsdp1 and isinstance(module, fsdp1):
        return inner
    return module


class _PlainForward:
    """The forward of a module copied (deepcopy, pickle) while its forward was wrapped: its
    class's forward, reached through a weak reference (no cycle, as in `wrap_forward`).

    A copy's state dict keeps every key of the original's, so the copy cannot be left
    without a `forward` entry; this one behaves as the class's forward, and `wrap_forward`
    and `unwrap_forward` treat it as absent.
    """

    __slots__ = ("_module", "__weakref__")

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        module = self._module()
        return type(module).forward(module, *args, **kwargs)

    @property
    def __signature__(self):
        module = self._module()
        return inspect.signature(type(module).forward.__get__(module))

    def __deepcopy__(self, memo):
        return _PlainForward(copy.deepcopy(self._module(), memo))

    def __reduce__(self):
        return _PlainForward, (self._module(),)


def _identity(value):
    return value


class _WrappedForward:
    """What `wrap_forward` installs as `module.forward`: calls `call`, and remembers what
    `unwrap_forward` restores.

    A copy of the module is an ordinary module, not a second user of the original's
    handle: a deep copy gets the forward it had before wrapping, bound to the copy (the
    module is found through deepcopy's memo), and pickling stores that plain forward
    (the wrapper holds the handle, which does not pickle).
    """

    def __init__(self, call: Callable, module: nn.Module, previous):
        self._call = call
        self._module = weakref.ref(module)
        self._previous = previous  # someone else's instance forward, put back as it was; None: the class's

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __deepcopy__(self, memo):
        if self._previous is not None:
            return copy.deepcopy(self._previous, memo)
        module = self._module()
        return self if module is None else _PlainForward(copy.deepcopy(module, memo))

    def __reduce__(self):
        if self._previous is not None:
            return _identity, (self._previous,)
        return _PlainForward, (self._module(),)


def _own_forward(module: nn.Module):
    """The instance forward someone else installed, or None (a copy's `_PlainForward` is none)."""
    current = module.__dict__.get("forward")
    return None if current is None or isinstance(current, _PlainForward) else current


def forward_wrapped(module: nn.Module) -> bool:
    """Whether `wrap_forward` wrapped `module`'s forward (and `unwrap_forward` has not undone it)."""
    return isinstance(module.__dict__.get("forward"), _WrappedForward)


def wrap_forward(module: nn.Module, make: Callable[[Callable], Callable]) -> None:
    """Replace module.forward by make(original forward); `unwrap_forward` undoes it.

    The wrapper reaches the module through a weak reference (not a bound method), so the
    module does not refer to itself and is freed as soon as the last user reference goes,
    without waiting for the cyclic garbage collector (a model dropped without `disable()`
    would otherwise hold its device memory until the collector happens to run).
    """
    if forward_wrapped(module):
        raise RuntimeError(
            f"offload: {type(module).__name__} already has activation offload enabled; "
            "call disable() on the first handle before enabling it again"
        )
    own = _own_forward(module)
    if own is not None:  # someone else's instance forward: called as it is
        original = bound = own
    else:
        func, ref = type(module).forward, weakref.ref(module)
        bound = func.__get__(module)

        def original(*args, **kwargs):
            return func(ref(), *args, **kwargs)

    wrapper = _WrappedForward(make(original), module, own)
    functools.update_wrapper(wrapper, bound)
    del wrapper.__wrapped__  # it would hold the module; the signature below is what introspection needs
    signature = _signature(bound, None if own is not None else type(module).forward)
    if signature is not None:
        wrapper.__signature__ = signature
    module.forward = wrapper


# The signature of each class's forward, once: auto mode wraps its layers again in every other
# step of a probe, inspect.signature is most of what a wrap costs, and in a launch-bound step
# that host time would be counted against the probed offload.
_signatures: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _signature(bound, func):
    """inspect.signature(bound), cached by its class function `func` (None: not cached)."""
    signature = _signatures.get(func) if func is not None else None
    if signature is None:
        try:
            signature = inspect.signature(bound)
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            return None
        if func is not None:
            _signatures[func] = signature
    return signature


def unwrap_forward(module: nn.Module) -> None:
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, _WrappedForward):
        return
    if wrapper._previous is not None:
        module.forward = wrapper._previous
    else:
        del module.__dict__["forward"]
