"""`verify=True`: every offloaded group checksummed on the device as it leaves and again when it is
back, and an error naming the layer and the tensor where the two differ.

Note [verify]: a copy racing its own reload, a buffer reused while a copy still reads it, a stream
not waited for: each of these trains on silently wrong activations, and the loss curve shows it
only much later, if at all. With `verify=True` the engine sums each group's spans on the compute
stream right before their copy out (the copy stream waits for that stream, so the sums read what
the copy reads), and sums the restored block's spans on the consumer's stream right after it waits
for the copy back; the first read of the group in backward compares the two (a host wait) and
raises `ActivationMismatch` on a difference. Three sums per span, in int64 on the device: of its
bytes, of its 32-bit words and of every other word (what a swap of two words leaves equal in the
first two, the third catches). A debugging aid: it reads every offloaded byte twice more on the
device and waits for the device once per group in backward (its cost: benchmarks/RESULTS.md,
"Activation engine host time").
"""

from __future__ import annotations

import torch


class ActivationMismatch(RuntimeError):
    """An offloaded group came back different from what was saved (raised with `verify=True`)."""


def checksums(spans) -> torch.Tensor:
    """Per span (uint8 tensors, each starting on a 4-byte boundary): (sum of bytes, sum of 32-bit
    words, sum of every other word), as an (n, 3) int64 tensor on the spans' device."""
    rows = []
    for span in spans:
        words = span[: span.numel() // 4 * 4].view(torch.int32)
        rows.append(torch.stack([span.sum(dtype=torch.int64), words.sum(dtype=torch.int64),
                                 words[::2].sum(dtype=torch.int64)]))
    return torch.stack(rows)


class GroupChecksums:
    """What a group's spans summed to as they left, and what they were saved as."""

    __slots__ = ("sums", "descriptions")

    def __init__(self, group):
        self.sums = checksums(group.span_bytes())
        self.descriptions = group.span_descriptions()

    def check(self, group, block: torch.Tensor) -> None:
        """Raise `ActivationMismatch` if the spans in `block` (the group's restored block, its copy
        back waited for on the current stream) differ from what left."""
        back = checksums(group.block_spans(block))
        if torch.equal(back, self.sums):
            return
        differ = (back != self.sums).any(dim=1).nonzero().flatten().tolist()
        first = differ[0]
        where = f"layer {group.name!r}" if group.layer is not None else f"group {group.name!r}"
        part = f", part {group.part}" if group.split is not None or group.continued else ""
        raise ActivationMismatch(
            f"offload.activation (verify=True): the activations of {where}{part} came back different from what "
            f"was saved: span {first} of {len(self.descriptions)}, saved through a {self.descriptions[first]} "
            f"tensor (and {len(differ) - 1} more spans) - a copy that raced its reload or a buffer reused too early; "
            "gradients from this step would be wrong")
