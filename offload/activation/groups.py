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

OPEN, COPYING, HOST, KEPT = "open", "copying", "host", "kept"

# The kinds of `ActivationEvent`, in the order a group meets them.
CLOSED, RELEASED, FETCHED, RESTORED = "closed", "released", "fetched", "restored"
EVENT_KINDS = (CLOSED, RELEASED, FETCHED, RESTORED)

# Numbers groups for the events: a group's serial tells apart the parts of one layer and
# the groups of successive steps, which share names and layers.
_serials = itertools.count()

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
    """The saved tensors of one forward span (one layer, a part of one, or several small ones)."""

    __slots__ = (
        "name", "layer", "state", "held", "modified", "watch", "spans", "d2h", "h2d", "device_block",
        "typed_blocks", "views", "waited", "n_handles", "n_unpacked", "prev", "nbytes", "span_starts",
        "nbytes_aligned", "stream", "capped", "split", "part", "continued", "fetch_stream", "offsets",
        "new_spans", "n_layers", "auto", "fetched", "serial", "__weakref__",
    )

    def __init__(self, name, layer, offload: bool, prev):
        self.name = name
        self.serial = next(_serials)  # unique in the process (ActivationEvent.serial)
        self.layer = layer  # index in the layer list (auto-mode statistics), or None
        self.state = OPEN if offload else KEPT
        self.held: Optional[list] = []  # per handle slot: (tensor, version), while device data is valid
        self.modified = None  # slot -> (tensor, saved version, version): modified before the copy was confirmed
        self.watch = None  # per slot, once held is dropped: (tensor sharing its version counter, version) or None
        self.spans: list = []  # per entry: a Span (bytes of its storage to copy)
        self.d2h = None  # CopyHandle of the group's spans to host; its one tensor is their pooled host block
        self.h2d: list = []  # CopyHandles of the block back to the device (backward): one, or a piece each
        self.fetched = 0  # bytes of the block copied back so far (or queued to be)
        self.device_block = None  # the restored uint8 block on the device, laid out as the host block
        self.typed_blocks: dict = {}  # dtype -> device_block viewed as that dtype (views are made from it)
        self.views: dict = {}  # (entry, dtype, size, stride, offset) -> restored tensor
        self.waited = set()  # streams that already wait for h2d
        self.n_handles = 0
        self.n_unpacked = 0
        self.prev = prev  # weakref to the previous offloaded group of the same forward
        self.nbytes = 0  # bytes of its storage spans
        self.span_starts: list = []  # per entry: where its copied span starts in the storage (bytes)
        self.nbytes_aligned = 0  # bytes of the group's host (and restored device) block
        self.stream = None  # the stream its tensors were saved on (current when it closed), on an accelerator
        self.capped = 0  # bytes of its layer's new spans so far (counted against a cap and the part ends)
        self.split = None  # its layer's part ends in bytes of new spans (Note [layer parts]), or None
        self.part = 0  # the index of its layer's part it ends (its release point)
        self.continued = False  # a later part of a layer copied in parts
        self.new_spans = 0  # new storage spans of its layer so far (with capped: its layer's size)
        self.n_layers = 1  # layers it holds: more when small layers share it (min_group_bytes), 0 for a later part
        self.fetch_stream = None  # the stream its restored device block was allocated on (owns it)
        self.offsets: list = []  # per entry: where its copied span starts in the group's blocks (bytes)
        self.auto: Optional[AutoState] = None  # auto mode's cap and measurements, else None


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
