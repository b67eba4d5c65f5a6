"""The data model of activation offload: a group of saved tensors, what autograd holds for each,
and the events the runtime reports about groups to its listeners.

A group is the span of forward from one layer's start to the next layer's start (or the end
of the model's forward): every tensor autograd saves in that span belongs to it (Note
[groups] in engine.py). Its state moves OPEN -> COPYING -> HOST; a KEPT group (auto mode
measuring a layer it does not offload) only counts what its layer saves.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from ..core.copy import copy_spans_to_host
from .saved_tensors import describe, drop_held

# A group's states (ints: the core's ActivationGroup keeps the same numbers, activation_group.h).
OPEN, COPYING, HOST, KEPT = 0, 1, 2, 3

# The kinds of `ActivationEvent`, in the order a group meets them.
CLOSED, RELEASED, FETCHED, RESTORED = "closed", "released", "fetched", "restored"
EVENT_KINDS = (CLOSED, RELEASED, FETCHED, RESTORED)

# Numbers groups for the events: a group's serial tells apart the parts of one layer and
# the groups of successive steps, which share names and layers. The core's counter where it is
# loaded (its groups number themselves from it), so serials stay unique in the process.
_serials = itertools.count()


def next_serial() -> int:
    from ..core import _backend

    core = _backend.loaded_core()
    return core.next_group_serial() if core is not None else next(_serials)

# The copied span of a storage starts on this boundary, the caching allocator's block
# alignment: a restored view then has the same address modulo 512 as the original, so
# kernels that pick vectorised paths by alignment take the same path (bitwise results).
SPAN_ALIGN = 512


class AutoState:
    """What a group carries for auto mode only: its schedule's byte cap and its layer's measurements."""

    __slots__ = ("cap", "profile", "span_ends")

    def __init__(self):
        self.cap: Optional[int] = None  # bytes of new spans it may offload (the schedule's), None: no limit
        # Measuring: its layer's bytes of new spans (ascending) at which the observer marks the
        # time (when the layer has saved each PROFILE_POINTS-th share of its bytes), or None.
        self.profile: Optional[list] = None
        # Measuring: its layer's bytes of new spans after each new span, or None.
        self.span_ends: Optional[list] = None


class Group:
    """The saved tensors of one forward span (one layer, a part of one, or several small ones).

    Note [group twins]: with the core loaded the engine's groups are the core's ActivationGroup
    (csrc/python/activation_group.h): its data plane (spans, held tensors, restored views, copies:
    what the hooks and the core's cycle touch) and the engine's per-layer fields (`LayerFields`);
    this class is its Python twin for the path without the core, with the same attributes and
    methods.
    """

    __slots__ = (
        "name", "layer", "state", "held", "modified", "watch", "spans", "d2h", "h2d", "device_block",
        "typed_blocks", "views", "waited", "n_handles", "n_unpacked", "prev", "nbytes", "span_starts",
        "nbytes_aligned", "stream", "capped", "split", "part", "continued", "fetch_stream", "offsets",
        "new_spans", "n_layers", "auto", "fetched", "serial", "checksums", "span_sizes", "__weakref__",
    )

    def __init__(self, name, layer, offload: bool, prev):
        init_layer_fields(self, name, layer, prev)
        self.state = OPEN if offload else KEPT
        self.held: Optional[list] = []  # per handle slot: (tensor, version), while device data is valid
        self.modified = None  # slot -> (tensor, saved version, version): modified before the copy was confirmed
        self.watch = None  # per slot, once held is dropped: (tensor sharing its version counter, version) or None
        self.spans: Optional[list] = []  # per entry: a Span (bytes of its storage to copy)
        self.fetched = 0  # bytes of the block copied back so far (or queued to be)
        self.device_block = None  # the restored uint8 block on the device, laid out as the host block
        self.fetch_stream = None  # the stream its device block was allocated on (owns it), on an accelerator
        self.d2h = None  # CopyHandle of its spans to host; its one tensor is their pooled host block
        self.h2d: list = []  # CopyHandles of the block back to the device (backward): one, or a piece each
        self.stream = None  # the stream its tensors were saved on (current when it closed), on an accelerator
        self.typed_blocks: dict = {}  # dtype -> device_block viewed as that dtype (views are made from it)
        self.views: dict = {}  # (entry, dtype, size, stride, offset) -> restored tensor
        self.waited = set()  # streams that already wait for h2d
        self.n_handles = 0
        self.n_unpacked = 0
        self.nbytes = 0  # bytes of its storage spans
        self.span_starts: list = []  # per entry: where its copied span starts in the storage (bytes)
        self.nbytes_aligned = 0  # bytes of the group's host (and restored device) block
        self.capped = 0  # bytes of its layer's new spans so far (counted against a cap and the part ends)
        self.new_spans = 0  # new storage spans of its layer so far (with capped: its layer's size)
        self.offsets: list = []  # per entry: where its copied span starts in the group's blocks (bytes)
        self.span_sizes: list = []  # per entry: its bytes (set by copy_out)

    @property
    def holds_device_tensors(self) -> bool:
        """The held tensors are valid: the device data is still what was saved."""
        return self.held is not None

    @property
    def has_spans(self) -> bool:
        return self.spans is not None

    def hold(self, t, version: int) -> int:
        """The handle slot of `t` (saved at `version`) in this group."""
        self.held.append((t, version))
        self.n_handles += 1
        return len(self.held) - 1

    def seal(self) -> int:
        """Close: each span's start and version; its bytes into `nbytes`. Returns the span count."""
        starts = []
        for span in self.spans:
            starts.append(span.lo)
            self.nbytes += span.hi - span.lo
            span.version = span.tensor._version  # a later save may share this copy only at this version
        self.span_starts = starts
        return len(starts)

    def copy_out(self, pool, stream, chunk_bytes: int, timing: bool):
        """Close: one copy of the spans into a pooled host block at aligned offsets (Note [one
        copy per group] in engine.py); the transfer (a CopyHandle's implementation)."""
        sizes = self.span_sizes = [span.hi - span.lo for span in self.spans]
        self.offsets, self.nbytes_aligned = aligned_layout(sizes)
        return copy_spans_to_host([span.tensor for span in self.spans], self.span_starts, sizes, self.nbytes_aligned,
                                  self.offsets, pool=pool, stream=stream, chunk_bytes=chunk_bytes,
                                  timing=timing)._impl

    def drop_spans(self) -> None:
        self.spans = None

    def span_bytes(self) -> list:
        """verify=True, while the spans are held: each span's bytes, a uint8 tensor of its storage."""
        return [torch.empty(0, dtype=torch.uint8, device=span.tensor.device).set_(
            span.tensor.untyped_storage(), span.lo, (span.hi - span.lo,), (1,)) for span in self.spans]

    def span_descriptions(self) -> list:
        """verify=True: "dtype [sizes]" of the tensor each span was saved through."""
        return [describe(span.tensor) for span in self.spans]

    def block_spans(self, block) -> list:
        """After copy_out: each span's bytes in `block` (the host block or the restored one)."""
        return [block.narrow(0, at, size) for at, size in zip(self.offsets, self.span_sizes)]

    def drop_held(self) -> None:
        """The copy is complete (or ordered before every reader): drop the held tensors."""
        drop_held(self)

    def let_sources_go(self, stream) -> None:
        """The spans' memory is protected by `stream` (the copy stream) until it passes the copy."""
        for span in self.spans:
            span.tensor.record_stream(stream)

    def add_h2d(self, handle) -> None:
        """A copy back of its block (or of a piece of it) was issued."""
        self.h2d.append(handle)

    def h2d_handles(self) -> list:
        """Its copies back in this backward, in the order issued."""
        return list(self.h2d)

    def reset_restore(self) -> None:
        """Backward let go of the group: its restored block, views, copies back and waits go."""
        self.device_block = None
        self.fetch_stream = None
        self.h2d = []
        self.typed_blocks = {}
        self.views = {}
        self.waited = set()
        self.fetched = 0
        self.n_unpacked = 0

    def saved_on(self, stream) -> bool:
        """Its tensors were saved on `stream` (None: on the host, never)."""
        return stream is not None and self.stream == stream

    def owns_block(self, stream) -> bool:
        """The restored block was allocated on `stream` (None: on the host, never)."""
        return self.fetch_stream is not None and self.fetch_stream == stream

    def ready_on(self, stream) -> bool:
        """The consumer on `stream` (None: the host) already waits for the copy back."""
        return stream in self.waited

    def mark_ready(self, stream) -> bool:
        """Records that it does; True if it is the group's first reader in this backward."""
        first = not self.waited
        self.waited.add(stream)
        return first


class LayerFields:
    """The engine's per-layer fields of a group, the same in `Group` and the core's
    ActivationGroup (documentation only: `init_layer_fields` sets them in `Group`)."""

    name: str  # its (first) layer's name, or activation_offload's group name
    serial: int  # unique in the process (ActivationEvent.serial)
    layer: Optional[int]  # index in the layer list (auto-mode statistics), or None
    prev: object  # weakref to the previous offloaded group of the same forward
    split: Optional[list]  # its layer's part ends in bytes of new spans (Note [layer parts]), or None
    part: int  # the index of its layer's part it ends (its release point)
    continued: bool  # a later part of a layer copied in parts
    n_layers: int  # layers it holds: more when small layers share it (min_group_bytes), 0 for a later part
    auto: Optional[AutoState]  # auto mode's cap and measurements, else None
    checksums: object  # verify=True: its spans' sums as they left (verify.py's GroupChecksums), else None


def init_layer_fields(group, name, layer, prev) -> None:
    group.name = name
    group.serial = next_serial()
    group.layer = layer
    group.prev = prev
    group.split = None
    group.part = 0
    group.continued = False
    group.n_layers = 1
    group.auto = None
    group.checksums = None


def group_class(native: bool):
    """The core's ActivationGroup, or `Group`: both made as (name, layer, offload, prev)."""
    if not native:
        return Group
    from ..core import _backend

    return _backend.core().ActivationGroup


@dataclass(frozen=True)
class ActivationEvent:
    """What the activation runtime did to one group (a layer, a part of one, or several small
    layers sharing a copy), delivered to the listeners of `ActivationOffload.add_listener`.

    `kind`, in the order a group meets them:
      "closed"   the group's copy to host memory is issued (`nbytes`: its bytes);
      "released" its device tensors are let go: its copy is complete, or the compute stream
                 waits for it on the device (`nbytes`: the group's bytes);
      "fetched"  a copy back to the device is issued: the group's host block, or a piece of
                 it (`offset`: where the piece starts in the block, `nbytes`: its bytes);
      "restored" backward first reads the group from its copy back (once per group and
                 backward; a group still on the device when backward reaches it is served
                 as it is, with no "fetched" or "restored").
    """

    kind: str
    group: str  # the group's name: its (first) layer's name, or activation_offload's group name
    layer: Optional[int]  # its (first) layer's index among the handle's layers; None in activation_offload
    serial: int  # the group's number, unique in the process: parts of one layer and steps differ
    nbytes: int  # bytes of the event (see the kinds above)
    offset: int = 0  # "fetched": where its piece starts in the group's host block (bytes)
    block_bytes: int = 0  # bytes of the group's host block (its spans, each 512-byte aligned)
    part: int = 0  # the index of its layer's part it ends (Note [layer parts]); 0 for a whole layer
    n_layers: int = 1  # layers it holds: more where small layers share it, 0 for a later part of a layer
    step: int = 0  # the engine's step counter (as `stats()["step"]`)


class Span:
    """Bytes [lo, hi) of one storage that a group copies, read through `tensor` (Note [storages
    and views] in engine.py); widened while its group collects."""

    __slots__ = ("tensor", "lo", "hi", "version")

    def __init__(self, tensor, lo: int, hi: int):
        self.tensor = tensor
        self.lo = lo
        self.hi = hi
        # The tensor's version when its group closed: a later save may share this copy only at
        # this version (None while the group collects).
        self.version: Optional[int] = None


class Packed:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("group", "entry", "slot", "dtype", "size", "stride", "offset", "desc")

    def __init__(self, group, entry, slot, dtype, size, stride, offset):
        self.group = group
        self.entry = entry
        self.slot = slot
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset  # bytes from the start of the storage


def with_earlier_parts(ref) -> list:
    """`ref` (a weak reference to a group, or None) and, if its group is a later part of a
    layer copied in parts, the layer's earlier parts: the order backward needs them in."""
    refs = [ref]
    group = ref() if ref is not None else None
    while group is not None and group.continued:
        refs.append(group.prev)
        group = group.prev() if group.prev is not None else None
    return refs


def on_host_only(group: Group) -> bool:
    """Its copy is complete and not all of it was brought back to the device yet."""
    return group.state == HOST and group.d2h is not None and group.fetched < group.nbytes_aligned


def aligned_layout(sizes):
    """Where spans of the given sizes start in a block, each on a SPAN_ALIGN boundary, and the block's bytes."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // SPAN_ALIGN) * SPAN_ALIGN
    return offsets, at
