"""Plain side-stream copies of some layers' saved tensors, with no engine: what moving those
bytes over the bus costs a model's step, the floor under any offload of the same layers.

`BareCopies` copies what autograd saves in the forward of the chosen layers (what the engine's
`offload_extent` lets it offload, each storage once, parameters and buffers left out) to
pinned host memory on a side stream, at each layer's forward end; with `back`, it copies them
into scratch device memory from the start of the model's last layer's backward, and the
compute stream waits for that copy before the chosen layer's backward, as an offload's
restore would. Nothing is freed: the saved tensors stay on the device and backward reads
them, so steps inside `active()` differ from plain steps only by the copies and that wait.

The frontier benchmark times these steps against plain ones, alternated, beside auto mode's
probes of the same layer counts: what the engine's plan costs beyond them is the engine's own,
not the bus contending with the model's compute.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Sequence, Tuple

import torch

from offload.activation.saved_tensors import module_tensors, offload_extent, storage_ptrs
from offload.core import _device


class BareCopies:
    """Bare copies of the saved tensors of `layers[:count]` (modules of `model`, in forward order).

    Streams: the compute stream (current at each hook) owns the saved tensors; the side
    stream reads them after waiting for the compute stream at the layer's end (each is
    `record_stream`ed on it, so the allocator does not reuse one a copy still reads), and
    alone uses the pinned and scratch buffers, which live as long as this object.
    """

    def __init__(self, model: torch.nn.Module, layers: Sequence[torch.nn.Module], count: int = 1,
                 back: bool = True, min_tensor_bytes: int = 1 << 20):
        if not 1 <= count <= len(layers):
            raise ValueError(f"BareCopies: count must be within 1..{len(layers)} (the layers given), got {count}")
        self.device = next(model.parameters()).device
        self.count, self.back, self.min_tensor_bytes = count, back, min_tensor_bytes
        self.side = _device.new_stream(self.device)  # None on the CPU: the copies run in place
        self._params = storage_ptrs(module_tensors(model))  # parameters' and buffers' storages
        self._on = False
        self._layer = None  # index of the chosen layer whose forward runs now
        self._saved: Dict[int, List[torch.Tensor]] = {}  # layer -> saved tensors of this forward
        self._seen: set = set()  # storages already taken in the running layer
        self._host: Dict[Tuple[int, int], torch.Tensor] = {}  # (layer, slot) -> pinned copy
        self._scratch: Dict[Tuple[int, int], torch.Tensor] = {}  # (layer, slot) -> device copy back
        self._returned = None  # event: the copy back is done (None: not launched this step)
        self.bytes_per_step = 0
        # The copy back's hook first: where the last layer is a chosen one, its output's
        # tensor hooks then launch the copy back before the wait for it.
        self._hooks = [layers[-1].register_forward_hook(self._on_output("_copy_back"))] if back else []
        for index, layer in enumerate(layers[:count]):
            self._hooks.append(layer.register_forward_pre_hook(self._layer_starts(index)))
            self._hooks.append(layer.register_forward_hook(self._layer_ends(index)))

    @contextlib.contextmanager
    def active(self):
        """Steps inside copy the chosen layers' saved tensors (and back, with `back`)."""
        self._on, self._returned, self.bytes_per_step = True, None, 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._on = False

    def remove(self) -> None:
        """Take the hooks off the layers and let the buffers go."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._host, self._scratch, self._saved, self._returned = {}, {}, {}, None

    # ---- forward
    def _pack(self, t):
        # The engine's own test of what it may offload (`offload_extent`), then its parameter check.
        extent = None if self._layer is None or type(t) is not torch.Tensor else \
            offload_extent(t, self.min_tensor_bytes, self.device)
        if extent is None:
            return t
        storage, _, _, may_share_a_parameter = extent
        if not (may_share_a_parameter and storage in self._params) and storage not in self._seen:
            self._seen.add(storage)
            self._saved[self._layer].append(t)
        return t

    def _layer_starts(self, index):
        def hook(module, args):
            if self._on:
                self._layer, self._seen = index, set()
                self._saved[index] = []
        return hook

    def _layer_ends(self, index):
        def hook(module, args, output):
            if not self._on:
                return
            self._layer = None
            self._copy_out(index, self._saved.pop(index, []))
            if self.back:
                self._on_output("_wait_back")(module, args, output)
        return hook

    def _copy_out(self, index, tensors) -> None:
        if self.side is not None:
            self.side.wait_stream(_device.current_stream(self.device))
        with _device.stream_context(self.side):
            for slot, t in enumerate(tensors):
                host = self._host.get((index, slot))
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=_device.pinned_memory_supported())
                    self._host[(index, slot)] = host
                    self._scratch.pop((index, slot), None)
                host.copy_(t, non_blocking=True)
                _device.record_stream(t, self.side)
                self.bytes_per_step += t.numel() * t.element_size()

    # ---- backward
    def _on_output(self, fn):
        """A forward hook that, in an active step, runs `fn` (a method's name) when backward
        reaches the module's output. The tensor hook holds this object weakly: autograd may keep
        a step's graph past the step, and with it, strongly held, this object's buffers."""
        ref = weakref.ref(self)

        def on_gradient(grad):
            this = ref()
            if this is not None:
                getattr(this, fn)()

        def hook(module, args, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if self._on and isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_gradient)
        return hook

    def _copy_back(self) -> None:
        if self.side is not None:
            self.side.wait_stream(_device.current_stream(self.device))
        with _device.stream_context(self.side):
            for key, host in self._host.items():
                scratch = self._scratch.get(key)
                if scratch is None:  # allocated on the side stream, its only user
                    scratch = self._scratch[key] = torch.empty_like(host, device=self.device)
                scratch.copy_(host, non_blocking=True)
        self._returned = _device.new_event(self.device)
        if self._returned is not None:
            self._returned.record(self.side)

    def _wait_back(self) -> None:
        if self._returned is not None:
            _device.current_stream(self.device).wait_event(self._returned)
