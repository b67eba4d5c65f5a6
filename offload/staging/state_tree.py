"""The shape of a nested state dict, and fast code to take it apart and rebuild it.

The stager needs, on every save, the leaves of a state dict (a tree of dicts,
lists and tuples over tensors and small immutable values) in a fixed order, and a
new tree of the same shape whose tensor leaves are host copies. See Note [generated
tree code].
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, List, Optional, Tuple

import torch

from ..core.checks import check_has_data
from .object_scan import dict_values, types_equal

_is_meta = attrgetter("is_meta")
_layout = attrgetter("layout")

# Leaves that are copied by reference: immutable, so a later change in the
# caller's dict cannot reach the staged copy.
SCALAR_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.memory_format,
    torch.layout,
)
_SCALAR_NAMES = "None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size"

# Note [generated tree code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Walking the tree with a recursive Python function costs a Python call per node,
# host time on every save that grows with the optimizer state. A `StateTree` is
# built once per shape by that slow walk (which also checks every leaf); from the
# second save with the same shape on, it runs straight-line code generated for
# that shape (the idea torch.fx uses for its graph code): one subscript per node,
# with a type and length check per container so any change of shape is detected
# and sends the caller back to the slow walk. Keys and types enter the generated
# code as indices into constant tuples, never as source text.

# A structure seen this many times in a row gets generated code; the first save
# of a new shape (often the only one, e.g. before the optimizer state exists)
# does not pay for compiling it.
COMPILE_AFTER = 2
# A container with at least this many children, none of them a container (a
# model's flat state dict), is taken apart and rebuilt by C-speed calls over key
# slices (`map(d.__getitem__, K[a:b])`, `dict(zip(K[a:b], T[s:e]))`) instead of
# one subscript per child: for thousands of tensors that is both faster to run
# and far faster to compile. Below it a display of single subscripts is cheaper.
WIDE = 8


class Mismatch(Exception):
    """The state dict does not have the shape this tree was built for."""


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_container(obj) -> bool:
    if isinstance(obj, torch.Tensor) or isinstance(obj, torch.Size):
        return False
    return isinstance(obj, (Mapping, list, tuple))


def _describe_path(path: Tuple) -> str:
    return "state_dict" + "".join(f"[{k!r}]" for k in path)


def dtensor_type() -> Optional[type]:
    """torch.distributed.tensor.DTensor, or None where torch has no distributed support."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.distributed.tensor import DTensor

        return DTensor
    except Exception:  # pragma: no cover - builds without distributed
        return None


class StateTree:
    """One shape of state dict: its leaves' paths and types, and how to rebuild it.

    `leaves(state_dict)` returns the leaves in a fixed order (raising `Mismatch`
    when the shape differs); `build(S, T)` makes a new tree whose tensor leaves
    are `T` and whose other leaves are `S`, each in leaf order: T[j] is the leaf
    at `tensor_pos[j]`, S[j] the one at `scalar_pos[j]`.
    """

    def __init__(self, fn: str, root):
        if not isinstance(root, Mapping):
            raise TypeError(f"{fn}: state_dict must be a dict (a Mapping), got {type(root).__name__}")
        self._fn = fn
        self._dtensor = dtensor_type()
        self.paths: List[Tuple] = []  # per leaf: the keys and indices leading to it
        self.leaf_types: List[type] = []
        self.tensor_pos: List[int] = []  # leaf indices holding tensors, in leaf order
        self.scalar_pos: List[int] = []  # leaf indices holding anything else, in leaf order
        self.dtensor_slots: List[int] = []  # tensor slots (indices into tensor_pos) holding DTensors
        self._keys: List[Any] = []
        self._wide_keys: List[Tuple] = []  # per wide dict: its keys in order (W of the generated extract)
        self._types: List[type] = []
        self._lens: List[int] = []  # per container, in walk order
        self._check_lines: List[str] = []
        self._items: List[str] = []
        self._var = 0
        self._on_path: set = set()
        out_expr = self._scan(root, "c0", ())
        self._out_expr = out_expr
        self._build = self._compile_build()
        self._extract = None
        self._hits = 0

    # ------------------------------------------------------------ the slow walk

    def _scan(self, obj, var: str, path: Tuple) -> str:
        """Check `obj` (held in generated variable `var`); return its rebuild expression."""
        if id(obj) in self._on_path:
            raise ValueError(f"{self._fn}: {_describe_path(path)} contains itself; a state dict must be a tree")
        self._on_path.add(id(obj))
        try:
            ti = len(self._types)
            self._types.append(type(obj))
            if isinstance(obj, Mapping):
                items = list(obj.items())
                open_, close, named = "{", "}", False
            else:
                items = list(enumerate(obj))
                named = _is_namedtuple(obj)
                open_, close = ("C[%d](" % ti, ")") if named else (("[", "]") if isinstance(obj, list) else ("(", ",)"))
            self._lens.append(len(items))
            self._check_lines.append(f"    if type({var}) is not C[{ti}] or len({var}) != {len(items)}: raise M")
            if len(items) >= WIDE and not any(_is_container(child) for _, child in items):
                return self._scan_wide(obj, var, path, items, ti, named)
            parts = []
            for key, child in items:
                ki = len(self._keys)
                self._keys.append(key)
                access = f"{var}[K[{ki}]]"
                if _is_container(child):
                    self._var += 1
                    child_var = f"c{self._var}"
                    self._check_lines.append(f"    {child_var} = {access}")
                    expr = self._scan(child, child_var, path + (key,))
                else:
                    expr = self._leaf(child, access, path + (key,))
                parts.append(f"K[{ki}]: {expr}" if isinstance(obj, Mapping) else expr)
            if isinstance(obj, tuple) and not named and not parts:
                return "()"
            return open_ + ", ".join(parts) + close
        finally:
            self._on_path.discard(id(obj))

    def _scan_wide(self, obj, var: str, path: Tuple, items, ti: int, named: bool) -> str:
        """A wide container of leaves: one starred item to extract, slices to rebuild."""
        k0 = len(self._keys)
        self._keys.extend(key for key, _ in items)
        k1 = len(self._keys)
        first_item = len(self._items)
        exprs = self._plain_tensor_leaves(items, path)
        if exprs is None:
            exprs = [self._leaf(child, "", path + (key,)) for key, child in items]
        del self._items[first_item:]
        if type(obj) in (dict, OrderedDict):
            # dict_values: the values in one pass when the keys come in the order
            # seen (the usual case), else a lookup per key.
            wi = len(self._wide_keys)
            self._wide_keys.append(tuple(self._keys[k0:k1]))
            self._items.append(f"*V({var}, W[{wi}])")
        elif isinstance(obj, Mapping):
            self._items.append(f"*map({var}.__getitem__, K[{k0}:{k1}])")
        else:  # list or tuple: its items in order, after the length check above
            self._items.append(f"*{var}")
        values = _slices(exprs)
        if isinstance(obj, Mapping):
            return f"dict(zip(K[{k0}:{k1}], {values}))"
        if named:
            return f"C[{ti}](*{values})"
        return f"list({values})" if isinstance(obj, list) else f"tuple({values})"

    def _plain_tensor_leaves(self, items, path: Tuple) -> Optional[List[str]]:
        """_leaf for a wide run of plain dense tensors, each attribute read by a
        C-level map; None (nothing recorded) when any item needs _leaf's checks."""
        values = [child for _, child in items]
        types = set(map(type, values))
        if not types <= {torch.Tensor, torch.nn.Parameter}:
            return None
        if any(map(_is_meta, values)) or set(map(_layout, values)) != {torch.strided}:
            return None
        index, slot = len(self.paths), len(self.tensor_pos)
        self.paths.extend([path + (key,) for key, _ in items])
        self.leaf_types.extend(map(type, values))
        self._items.extend([""] * len(values))
        self.tensor_pos.extend(range(index, index + len(values)))
        return [f"T[{i}]" for i in range(slot, slot + len(values))]

    def _leaf(self, value, access: str, path: Tuple) -> str:
        index = len(self.paths)
        self.paths.append(path)
        self.leaf_types.append(type(value))
        self._items.append(access)
        if isinstance(value, torch.Tensor):
            self._check_tensor(value, path)
            slot = len(self.tensor_pos)
            self.tensor_pos.append(index)
            if self._dtensor is not None and isinstance(value, self._dtensor):
                self.dtensor_slots.append(slot)
            return f"T[{slot}]"
        if not isinstance(value, SCALAR_TYPES):
            raise TypeError(
                f"{self._fn}: {_describe_path(path)} is a {type(value).__module__}.{type(value).__qualname__}; "
                f"a staged state dict holds dicts, lists and tuples of tensors, DTensors and immutable "
                f"values ({_SCALAR_NAMES}); convert it, e.g. to a tensor or a str, before saving"
            )
        self.scalar_pos.append(index)
        return f"L[{len(self.scalar_pos) - 1}]"

    def _check_tensor(self, t: torch.Tensor, path: Tuple) -> None:
        is_dtensor = self._dtensor is not None and isinstance(t, self._dtensor)
        if not is_dtensor and type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"{self._fn}: {_describe_path(path)} is a tensor subclass {type(t).__qualname__}; only plain "
                "tensors, parameters and DTensors can be staged"
            )
        local = t._local_tensor if is_dtensor else t
        if local.is_meta:
            raise ValueError(f"{self._fn}: {_describe_path(path)} is a meta tensor, which has no data to stage")
        if local.layout != torch.strided:
            raise ValueError(
                f"{self._fn}: {_describe_path(path)} has layout {local.layout}; only strided (dense) tensors "
                "can be staged"
            )

    def check_tensors(self, locals_: List[torch.Tensor]) -> None:
        """_check_tensor's dense-data checks for every tensor leaf (`locals_`, in
        slot order, DTensors as their local shards), made by C-level maps; a tensor
        that fails gets the message the first save would have given it. For a
        cached tree, whose `leaves()` compares only the leaves' types. Then that each
        storage holds its tensor's elements (a parked parameter's holds none): once per
        plan, as a save whose sources moved plans again."""
        if any(map(_is_meta, locals_)) or not set(map(_layout, locals_)) <= {torch.strided}:
            for slot, t in enumerate(locals_):
                self._check_tensor(t, self.paths[self.tensor_pos[slot]])
        for slot, t in enumerate(locals_):
            check_has_data(self._fn, _describe_path(self.paths[self.tensor_pos[slot]]), t)

    # ------------------------------------------------------------ generated code

    def _compile_build(self):
        source = f"def build(L, T, K, C):\n    return {self._out_expr}\n"
        return _compile(source, "build", self._keys, self._types)

    def _compile_extract(self):
        body = "\n".join(self._check_lines)
        source = f"def extract(c0, K, C, M, W, V):\n{body}\n    return [{', '.join(self._items)}]\n"
        return _compile(source, "extract", self._keys, self._types, self._wide_keys)

    def leaves(self, root) -> List[Any]:
        """The leaves of `root` in this tree's order; raises Mismatch if the shape differs."""
        if self._extract is None:
            self._hits += 1
            if self._hits < COMPILE_AFTER:
                return self._walk(root)
            self._extract = self._compile_extract()
        try:
            leaves = self._extract(root)
        except Mismatch:
            raise
        except (KeyError, IndexError, TypeError, AttributeError):
            raise Mismatch() from None
        if not types_equal(leaves, self.leaf_types):
            raise Mismatch()
        return leaves

    def _walk(self, root) -> List[Any]:
        """The leaves by a plain walk, checking what the generated code checks."""
        out: List[Any] = []
        try:
            _plain_leaves(root, self._types, self._lens, iter(range(len(self._types))), iter(self._keys), out)
        except (KeyError, IndexError, TypeError, AttributeError, StopIteration):
            raise Mismatch() from None
        if not types_equal(out, self.leaf_types):
            raise Mismatch()
        return out

    def build(self, scalars: List[Any], tensors: List[Any]):
        """A new tree of this shape: `scalars` are the leaves at scalar_pos, `tensors` those at tensor_pos."""
        return self._build(scalars, tensors)


def _slices(exprs: List[str]) -> str:
    """One expression for the values `exprs` ("T[3]", "L[7]", ...): runs of
    consecutive indices into one list become slices."""
    runs: List[list] = []  # [name, first index, last index]
    for expr in exprs:
        name, index = expr[0], int(expr[2:-1])
        if runs and runs[-1][0] == name and runs[-1][2] + 1 == index:
            runs[-1][2] = index
        else:
            runs.append([name, index, index])
    pieces = [f"{name}[{a}:{b + 1}]" for name, a, b in runs]
    return pieces[0] if len(pieces) == 1 else "[" + ", ".join("*" + p for p in pieces) + "]"


def _plain_leaves(obj, types, lens, container_iter, key_iter, out) -> None:
    index = next(container_iter)
    if type(obj) is not types[index] or len(obj) != lens[index]:
        raise Mismatch()
    for _ in range(lens[index]):
        child = obj[next(key_iter)]
        if _is_container(child):
            _plain_leaves(child, types, lens, container_iter, key_iter, out)
        else:
            out.append(child)


def _compile(source: str, name: str, keys, types, wide_keys=()):
    namespace: dict = {}
    exec(compile(source, f"<offload staging {name}>", "exec"), namespace)  # noqa: S102 - generated above
    fn = namespace[name]
    keys, types, wide_keys = tuple(keys), tuple(types), tuple(wide_keys)
    if name == "extract":
        return lambda root: fn(root, keys, types, Mismatch, wide_keys, dict_values)
    return lambda L, T: fn(L, T, keys, types)
