"""The partitioner offload installs in inductor while a handle is enabled: inductor's own
partition of the joint graph (or the partitioner the user had set), then, for a graph traced
from an offloaded model, the rewrite that offloads its layers' saved tensors.

A graph belongs to a handle when its forward holds that handle's `compiled_step` marker
(ops.py), which the model's forward records while dynamo traces it; every other graph
passes through untouched. The marker's `served` flag is set here: a graph this never saw
raises when it runs (ops.py).

Note [compiled recompute]: a layer the budget plan recomputes has its forward nodes in the
joint graph tagged MUST_RECOMPUTE, each layer its own region (`ac_graph_id`), as
torch.utils.checkpoint's nodes are tagged under compile: the partitioner saves the layer's
inputs instead of its activations and the backward graph runs the layer's ops again, inside
the same compiled backward, with no second Python forward. Nodes whose values leave the
layer (its outputs) stay untagged, so the partition decides for them as without the plan.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional

import torch.fx as fx

from . import ops

try:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as _PartitionerBase
except ImportError:  # a torch without the hook: support.py refuses before one is made
    _PartitionerBase = object

_lock = threading.Lock()
_owners: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # runtime id -> CompiledOffload


def marker_of(graph: fx.Graph) -> Optional[fx.Node]:
    """The `compiled_step` node of `graph`, or None."""
    for node in graph.find_nodes(op="call_function", target=ops.compiled_step):
        return node
    return None


def tag_recompute(joint: fx.GraphModule, layers: Dict[fx.Node, int], recompute) -> int:
    """Tag the forward nodes of the recomputed layers MUST_RECOMPUTE (Note [compiled recompute]);
    returns how many were tagged."""
    from torch.utils.checkpoint import CheckpointPolicy

    tagged = 0
    for node, layer in layers.items():
        if not recompute[layer] or node.meta.get("partitioner_tag") == "is_backward":
            continue
        forward_users = [u for u in node.users if u.op != "output" and u.meta.get("partitioner_tag") != "is_backward"]
        if any(layers.get(user) != layer for user in forward_users):
            continue  # leaves the layer: an output, saved or recomputed as the partition decides
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = layer
        tagged += 1
    return tagged


class OffloadPartitioner(_PartitionerBase):
    """Installed as `torch._inductor.config.custom_partitioner_fn` (support.py installs it);
    `previous` is the partitioner it replaced, or None for inductor's own."""

    def __init__(self, previous=None):
        self.previous = previous

    def _partition(self, gm, joint_inputs, **kwargs):
        if self.previous is not None:
            return self.previous(gm, joint_inputs, **kwargs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        kwargs.setdefault("compiler", "inductor")
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        marker = marker_of(gm.graph)
        owner = None if marker is None else _owners.get(marker.args[0])
        if owner is None:
            if marker is not None:
                marker.args = (marker.args[0], True, "")  # its handle is gone: the graph runs, offloading nothing
            return self._partition(gm, joint_inputs, **kwargs)
        return owner.partition(self._partition, gm, joint_inputs, kwargs)

    def uuid(self):
        # Part of inductor's and AOTAutograd's cache keys. The rewrite depends on this code and on
        # each handle's plan, so both go in: a graph compiled for another plan is not reused.
        # (A uuid of None would not bypass those caches: it keys like no partitioner at all.)
        import hashlib
        import os

        from torch._inductor.custom_graph_pass import get_hash_for_files

        here = os.path.dirname(os.path.abspath(__file__))
        files = tuple(sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py")))
        digest = hashlib.sha256(get_hash_for_files(files))
        with _lock:
            owners = sorted(_owners.items())
        for runtime, owner in owners:
            digest.update(f"{runtime}:{owner.cache_key()}".encode())
        previous = self.previous.uuid() if self.previous is not None else None
        digest.update(repr(previous).encode())
        return digest.hexdigest()


def register_owner(runtime: int, owner) -> None:
    with _lock:
        _owners[runtime] = owner


def unregister_owner(runtime: int) -> None:
    with _lock:
        _owners.pop(runtime, None)


def owners_left() -> int:
    return len(_owners)
