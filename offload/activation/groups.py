"""The data model of activation offload: a group of saved tensors and what autograd holds for each.

A group is the span of forward from one layer's start to the next layer's start (or the end
of the model's forward): every tensor autograd saves in that span belongs to it (Note
[groups] in engine.py). Its state moves OPEN -> COPYING -> HOST; a KEPT group (auto mode
measuring a layer it does not offload) only counts what its layer saves.
"""

from __future__ import annotations

from typing import Optional

OPEN, COPYING, HOST, KEPT = "open", "copying", "host", "kept"

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
        "new_spans", "n_layers", "auto", "fetched", "__weakref__",
    )

    def __init__(self, name, layer, offload: bool, prev):
        self.name = name
        self.layer = layer  # index in the layer list (auto-mode statistics), or None
        self.state = OPEN if offload else KEPT
        self.held: Optional[list] = []  # per handle slot: (tensor, version), while device data is valid
        self.modified = None  # slot -> (tensor, saved version, version): modified before the copy was confirmed
        self.watch = None  # per slot, once held is dropped: (tensor sharing its version counter, version) or None
        self.spans: list = []  # per entry: [tensor, lo, hi] (bytes of its storage to copy); + version when closed
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
