"""Saved-tensor helpers of activation offload: which tensors may be offloaded, what they read,
the in-place check that replaces autograd's, and the tensors a forward must keep.

`offload_extent` is the per-tensor test of the Python pack hook; the core's hooks
(csrc/python/saved_tensor_hooks.cpp) make the same test in C, and a test holds the two equal.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import weakref
from collections.abc import Mapping

import torch

# Note [version counter]: with saved-tensor hooks installed autograd no longer checks that a
# saved tensor was not modified in place. The engine does it instead: each handle remembers
# the tensor's `_version`, and unpack raises autograd's error if it changed. Until the copy
# is confirmed complete the tensor itself is held; after that, for a tensor something else
# can still reach, an empty alias sharing its version counter (`drop_held`).

_KEY_DEPTH = 6  # containers nested deeper than this are not looked into


def modified_error(t_desc: str, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t_desc}] is at version {now}; expected version {saved} instead "
        "(offload.activation: the tensor was modified after autograd saved it)"
    )


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def offload_extent(t: torch.Tensor, min_bytes: int, device: torch.device):
    """Whether the engine may offload `t` (a plain tensor saved in a group), and what it reads.

    None where it stays on the device: below `min_bytes` or empty, on another device, not
    strided, saved while backward runs (a checkpoint's recompute), a leaf that requires grad
    (a parameter's data, a user's input) or a view of one, a view of a frozen parameter (an
    `nn.Parameter` that needs no grad) (alive anyway: copying them frees nothing), autocast's
    cached cast of a parameter (alive until the autocast region exits),
    a lazily conjugated or negated complex view. Else (storage data_ptr, first byte, end byte
    it reads, whether its base has no grad_fn: only then can it share a parameter's storage).
    The core's `offload_extent` is this function in C; a test holds the two equal.
    """
    numel = t.numel()
    itemsize = t.element_size()
    if numel * itemsize < min_bytes or numel == 0:
        return None
    if (
        t.device != device
        or t.layout != torch.strided
        or torch._C._current_graph_task_id() != -1  # saved while backward runs (a recompute)
    ):
        return None
    base = t._base
    if base is None:
        if t.requires_grad and t.is_leaf:
            return None
        base = t
    elif base.requires_grad and base.is_leaf:
        return None
    grad_fn = base.grad_fn
    if grad_fn is None and base is not t and issubclass(type(base), torch.nn.Parameter):
        return None  # a frozen parameter's view: known by its base's type, no walk (Note [parameter walk])
    if grad_fn is not None and type(grad_fn).__name__ == "ToCopyBackward0":
        source = grad_fn.next_functions[0][0]
        if source is not None and hasattr(source, "variable"):  # AccumulateGrad: a leaf's cast
            return None
    if t.is_complex() and (t.is_conj() or t.is_neg()):
        return None
    first = t.storage_offset() * itemsize
    last = first + itemsize
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride * itemsize
    return t.untyped_storage().data_ptr(), first, last, grad_fn is None


def top_pack_hook():
    """The pack hook on top of autograd's default saved-tensor hooks stack (None if empty)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def other_hooks_active() -> bool:
    """Saved-tensor hooks someone else installed (save_on_cpu, a checkpoint around the model)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False) is not None
    except TypeError:  # torch versions whose binding takes no argument
        return top() is not None


def when_gradient_of(output, target, call) -> None:
    """Run call(target) when backward computes the gradient of the first tensor in `output`
    that needs one (a hook on it; nothing if there is none): for a tensor an op made, after
    every hook registered on that tensor, even those registered later (Note [after FSDP2's
    hook]); for a leaf, among its tensor hooks."""
    anchor = first_grad_tensor(output)
    if anchor is None:
        return
    ref = weakref.ref(target)  # the hook lives as long as the graph: no cycle through it

    def hook(*_):
        this = ref()
        if this is not None:
            call(this)

    if anchor.grad_fn is not None:
        # The autograd engine runs a node's tensor hooks, then its own pre-hooks: either way
        # after the gradient is computed. A pre-hook of the node also costs the host less than a
        # tensor hook, which makes the tensor a dict of hooks and registers it with its node.
        anchor.grad_fn.register_prehook(hook)
    else:  # a leaf: only a tensor hook sees its gradient
        anchor.register_hook(hook)


def first_grad_tensor(value, depth: int = 0):
    """The first tensor in a layer's output (a tensor, or one inside a tuple, list or dict,
    such as a Hugging Face ModelOutput) whose gradient backward computes; None if none."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if depth >= 3:
        return None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_grad_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _loop_refs() -> int:
    """What `sys.getrefcount` adds, in `drop_held`'s loop, to a tensor held only by its slot
    (`t` and the call's argument: 2 on CPython 3.11-3.13; measured, as interpreters differ)."""
    held = [(object(), 0)]
    for _, (t, _version) in enumerate(held):
        return sys.getrefcount(t) - 1


_LOOP_REFS = _loop_refs()


def _empty_like_storage(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of t's dtype and device (cached): what an alias's data is set to."""
    key = (t.dtype, t.device)
    empty = _EMPTIES.get(key)
    if empty is None:
        empty = _EMPTIES[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return empty


_EMPTIES: dict = {}


def drop_held(group) -> None:
    """The group's device tensors are no longer needed (its host copy is complete).

    An in-place change to a saved tensor after this point must still raise at unpack, as
    autograd's own check would (Note [version counter]); but the tensor is usually freed
    before backward (a later layer modifies a tensor the previous layer saved, then drops
    it). So per slot
    the engine keeps a tensor that shares the saved tensor's version counter and no storage
    (a detached alias whose `.data` is then an empty tensor: setting `.data` keeps the
    alias's version counter and does not bump it, where `set_()` would bump the shared one),
    and the version it was saved at.

    Only for tensors something else may still change: ones the caller still references,
    and views (their base or sibling views may be alive). A tensor referenced only by the
    group dies with it, so nothing can change it. That keeps the alias (a few us) off the
    tensors that were local to the layer; a tensor already changed is recorded at once.
    """
    held = group.held
    if held is None:
        return
    group.held = None
    group.spans = None  # its entries reference the tensors too
    watch = [None] * len(held)
    modified = {}
    alias_slots = []
    slots_of = None  # id(tensor) -> slots holding it, counted only if some tensor needs it
    for slot, (t, version) in enumerate(held):
        now = t._version
        if now != version:
            modified[slot] = (describe(t), version, now)
        elif t._base is not None:
            alias_slots.append(slot)
        else:
            # References: the tuples of the slots holding it, plus what this loop adds.
            refs = sys.getrefcount(t)
            if refs > _LOOP_REFS + 1:
                if slots_of is None:
                    slots_of = collections.Counter(id(other) for other, _ in held)
                if refs > _LOOP_REFS + slots_of[id(t)]:
                    alias_slots.append(slot)
    for slot in alias_slots:
        t, version = held[slot]
        alias = t.detach()
        alias.data = _empty_like_storage(t)
        watch[slot] = (alias, version)
    group.watch = watch
    group.modified = modified


def module_tensors(root: torch.nn.Module):
    """The parameters and buffers of `root` and its submodules (repeats possible), read from
    the modules' own dicts: cheaper than parameters() + buffers(), whose walk builds a
    qualified name for every module and member, each step."""
    stack, seen = [root], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for t in module._parameters.values():
            if t is not None:
                yield t
        for t in module._buffers.values():
            if t is not None:
                yield t
        stack.extend(m for m in module._modules.values() if m is not None)


def tensor_leaves(value, out: list, depth: int = 0) -> None:
    """Append the tensors in `value`: lists, tuples, mappings (dict, a Hugging Face
    BatchEncoding, which is a UserDict) and dataclasses, in order. torch's pytree walks
    registered containers only, and a UserDict or a user's dataclass is not one."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return
    if depth >= _KEY_DEPTH or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, Mapping):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    else:
        return
    for item in items:
        tensor_leaves(item, out, depth + 1)


def input_tensors(args, kwargs):
    """The tensors among a forward's arguments, also inside containers (walked when iterated)."""
    leaves: list = []
    tensor_leaves([args, kwargs], leaves)
    yield from leaves


def storage_ptrs(tensors) -> set:
    ptrs = set()
    for p in tensors:
        local = getattr(p, "_local_tensor", None)  # DTensor: its local shard
        t = local if isinstance(local, torch.Tensor) else p
        try:
            ptrs.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # meta or fake tensors have no storage
            pass
    ptrs.discard(0)
    return ptrs


# Note [not traced, lazily]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.compiler.disable imports dynamo, over a second of every process's `import offload` (each
# rank, each worker) though most never compile. So a `not_traced` method is wrapped when the first
# activation engine is made (make_not_traced), before any forward could be traced: until then it
# is the plain method, and nothing can call it, as only an engine's forward does.
_NOT_YET_WRAPPED: list = []  # (class, name, function) of the not_traced methods defined so far


class not_traced:
    """Method decorator: the method opaque to dynamo (Note [not traced, lazily]). Inside a compiled
    layer it runs eagerly at a graph break, so the copies, events and pool stay out of the traced
    graph."""

    def __init__(self, fn):
        self.fn = fn

    def __set_name__(self, owner, name):
        _NOT_YET_WRAPPED.append((owner, name, self.fn))

    def __get__(self, obj, objtype=None):
        return self.fn.__get__(obj, objtype)


def make_not_traced() -> None:
    """Wrap the not_traced methods with torch.compiler.disable (once per method)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    while _NOT_YET_WRAPPED:
        owner, name, fn = _NOT_YET_WRAPPED.pop()
        setattr(owner, name, _eager_unless_compiling(fn, disable(fn)) if disable is not None else fn)


def _eager_unless_compiling(fn, disabled):
    """`fn` called as it is in eager mode, and through its disabled twin only while dynamo
    traces (where `is_compiling()` is True and the disabled call breaks the graph): the
    disabled wrapper swaps the interpreter's frame callback at every call, host time that
    an eager step pays per layer boundary for nothing."""
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def method(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return method
