"""Loops over thousands of Python objects (a state dict's leaves) that the stager runs per save.

The compiled core runs them in C (csrc/python/object_scan.cpp says what each saves);
without it, the same in Python.
The choice is made once, at import, so that a reference-count baseline and the
sums compared with it always come from the same function.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Tuple

import torch

from ..core import _backend


def _refcount_sum(objects: List[Any]) -> int:
    return sum(map(sys.getrefcount, objects))


def _types_equal(objects: List[Any], types: List[type]) -> bool:
    return list(map(type, objects)) == types


def _dict_values(d: dict, keys: tuple) -> List[Any]:
    if tuple(d) == keys:
        return list(d.values())
    return list(map(d.__getitem__, keys))


def _storage_bytes(tensors: List[Any]) -> Tuple[int, int]:
    storages: Dict[int, list] = {}  # storage address -> [its bytes, bytes of its tensors]
    largest = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            continue
        largest = max(largest, nbytes)
        storage = t.untyped_storage()
        seen = storages.get(storage.data_ptr())
        if seen is None:
            storages[storage.data_ptr()] = [storage.nbytes(), nbytes]
        else:
            seen[1] += nbytes
    return sum(min(whole, used) for whole, used in storages.values()), largest


def _storage_addresses(tensors: List[torch.Tensor]) -> List[int]:
    return [t.untyped_storage().data_ptr() if t.numel() else 0 for t in tensors]


def _views_over(tensors: List[torch.Tensor], aliases: Dict[int, torch.Tensor]) -> List[torch.Tensor]:
    typed: Dict[Tuple, torch.Tensor] = {}  # (address, dtype) -> the whole alias as dtype: one as_strided a tensor
    out = []
    for t in tensors:
        if not t.numel():
            out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
            continue
        address, dtype = t.untyped_storage().data_ptr(), t.dtype
        base = typed.get((address, dtype))
        if base is None:
            alias = aliases[address]
            usable = alias.numel() // dtype.itemsize * dtype.itemsize  # a block may end mid-element
            base = typed[(address, dtype)] = alias[:usable].view(dtype)
        out.append(base.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


_core = _backend.loaded_core()
# A sum of reference counts, only ever compared with another sum from this same function.
refcount_sum = _core._refcount_sum if _core is not None else _refcount_sum
# Whether each object's type is exactly the type at its position (lists of equal length).
types_equal = _core._types_equal if _core is not None else _types_equal
# [d[k] for k in keys] for a dict holding exactly those keys (KeyError if one is missing).
dict_values = _core._dict_values if _core is not None else _dict_values
# (bytes, largest): the bytes of the tensors' storages a first save copies (each storage
# once, never more of it than its tensors' bytes add up to) and the largest tensor's bytes.
storage_bytes = _core._storage_bytes if _core is not None else _storage_bytes
# The address of each tensor's storage; 0 for a tensor with no elements.
storage_addresses = _core._storage_addresses if _core is not None else _storage_addresses
# Each host tensor's dtype and layout over the storage of aliases[its storage's address]
# (a uint8 tensor whose storage starts at the same byte); a new empty tensor where it has no elements.
views_over = _core._views_over if _core is not None else _views_over
