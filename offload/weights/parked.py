"""What a parked module allows: its state dict read from the host mirror, and errors where it would
be read as if its storages held their values.

`offload_params` frees each storage under the module's tensors (`resize_(0)`) while every tensor
keeps its sizes and strides (Note [storages, not tensors] in param_offload.py). torch does not
check a tensor's extent against its storage, so an op on such a tensor reads freed memory: a
crash, or worse a wrong value that nothing reports. `ParkedGuard` stands between the module and
the readers it can see (Note [parked reads]).
"""

from __future__ import annotations

import ctypes
import functools
from itertools import chain
from typing import Dict, List

import torch

from .sources import is_dtensor

# Note [parked reads]
# ~~~~~~~~~~~~~~~~~~~
# While a module is parked:
# - `module.state_dict()` (and any submodule's) gives, for each parked tensor, a tensor of the
#   same dtype, sizes, strides and offset over the host mirror's copy of its storage: the true
#   values, with no reload and no copy. DCP (with any stager), torch.save, save_pretrained and
#   offload's own readers take the state dict and so get the real weights. Each such tensor has a
#   storage of its own that spans exactly its storage's bytes in the mirror (an alias made with
#   torch.frombuffer over that address range, holding the mirror's block alive): torch.save
#   writes those bytes once per storage, tied weights once, not the whole mirror block. The
#   tensors are views of the mirror, as a live model's state dict is of its parameters: they are
#   for reading, and a write lands in the mirror and comes back with the next reload.
# - Running the module (its forward or any submodule's) raises before anything reads, ahead of
#   the hooks that were there first (FSDP2's all-gather reads the parked shards).
# - `load_state_dict` raises: it would copy into empty storages.
# - A parked tensor read directly (`model.weight.sum()`, `print(model.weight)`) is out of reach:
#   torch gives it no hook. offload's own readers (copy_to_host, pack_buckets, AsyncStager,
#   WeightSender) check every tensor's extent against its storage (`check_has_data`) and name
#   reload_params.
# The guards are hooks on the module's submodules, added by offload_params and removed by
# reload_params: a module that is not parked carries none.


def _host_alias(block: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage of its own over block[offset : offset + nbytes], keeping `block` alive."""
    window = (ctypes.c_uint8 * nbytes).from_address(block.data_ptr() + offset)
    window.block = block  # the alias outlives neither the block nor this reference to it
    return torch.frombuffer(window, dtype=torch.uint8).untyped_storage()


class ParkedGuard:
    """The hooks of one parked module (Note [parked reads]); `remove()` takes them all away."""

    def __init__(self, module: torch.nn.Module, storages: List[torch.UntypedStorage], block: torch.Tensor,
                 offsets: List[int], sizes: List[int]):
        # Keyed by the storage implementation (`_cdata`): each tensor's untyped_storage() is a
        # new Python object, and a parked storage's data pointer is null for all of them.
        self._host: Dict[int, torch.UntypedStorage] = {
            s._cdata: _host_alias(block, o, n) for s, o, n in zip(storages, offsets, sizes)}
        self._model = type(module).__name__
        self._handles = []
        for sub in module.modules():
            self._handles.append(sub.register_forward_pre_hook(self._refuse_forward, prepend=True))
            self._handles.append(sub.register_load_state_dict_pre_hook(self._refuse_load))
            if sub._parameters or sub._buffers:
                # A function, not a bound method: torch marks the hook with an attribute.
                self._handles.append(sub.register_state_dict_post_hook(functools.partial(_host_state_dict, self)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._host = [], {}

    def host_value(self, value: torch.Tensor):
        """`value` (a tensor or DTensor of the parked module) over the host mirror, or None where
        its storage is not parked here."""
        local = value._local_tensor if is_dtensor(value) else value
        host = self._host.get(local.untyped_storage()._cdata)
        if host is None:
            return None
        alias = torch.empty(0, dtype=local.dtype).set_(host, local.storage_offset(), local.size(), local.stride())
        if local is value:
            return alias
        # The same placements and global shape: only the local shard's memory differs.
        return type(value)(alias, value._spec, requires_grad=False)

    def _refuse_forward(self, module, args):
        raise RuntimeError(f"offload: the parameters of this {self._model} are parked on the host by "
                           f"offload.offload_params, so its {type(module).__name__} cannot run; call "
                           "offload.reload_params(model) first")

    def _refuse_load(self, module, state_dict, prefix, *args):
        raise RuntimeError(f"offload: the parameters of this {self._model} are parked on the host by "
                           "offload.offload_params, so load_state_dict has nowhere to write; call "
                           "offload.reload_params(model) first")


def _host_state_dict(guard: ParkedGuard, module, state_dict, prefix, local_metadata) -> None:
    """A state dict post-hook: the module's own parked entries over the host mirror. Children's
    hooks run before their parent's, so each module mends only its own entries."""
    for name in chain(module._parameters, module._buffers):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            host = guard.host_value(value)
            if host is not None:
                state_dict[prefix + name] = host
