"""Which layer each node of a compiled graph belongs to, read from the module structure the
graph records (`nn_module_stack`: per node, the modules whose forward was running, outermost
first, each as (path, class)).

Dynamo writes a path from the compiled frame's locals (`L['self'].model.layers.0`, older
releases `L['self'].model.layers[0]` or `..._modules['layers']._modules['0']`), and where
offload's wrapped forward reaches the model through a closure, the path runs through it
(`L['self']._call.__closure__[1].cell_contents().layers.0`); a model below the compiled root
adds its own path. The handle's layer names are relative to its model, so a node is in a
layer when one of its modules' paths ends in the layer's name at a dot, and that module is
of the layer's class.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

import torch.fx as fx

_ROOT = re.compile(r"^L\['[^']*'\]")
_MODULES = re.compile(r"\._modules\['([^']*)'\]")
_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\['([^']*)'\]")
_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)")


def normalize_path(path: str) -> str:
    """A dynamo module path as a dotted name relative to the compiled root ('' for the root)."""
    while True:  # getattr(L['self'].layers, '0') nests for each level
        match = _GETATTR.fullmatch(path)
        if match is None:
            break
        path = f"{match.group(1)}.{match.group(2)}"
    path = _ROOT.sub("", path)
    path = _MODULES.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    path = _KEY.sub(r".\1", path)
    return path.lstrip(".")


def module_paths(node: fx.Node) -> List[str]:
    """The normalized paths of the modules running when `node` was recorded, outermost first."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return []
    out = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        out.append(normalize_path(str(path)))
    return out


def _class_of(value):
    kind = value[1] if isinstance(value, tuple) and len(value) > 1 else None
    return kind if isinstance(kind, type) else None


class LayerMatcher:
    """Finds the layer of a node from its module paths (see the module's docstring)."""

    def __init__(self, names: Sequence[str], classes: Sequence[Optional[type]] = ()):
        self.full = {name: index for index, name in enumerate(names)}
        self.depths = sorted({full.count(".") + 1 for full in self.full}, reverse=True)
        self.classes = list(classes) + [None] * (len(names) - len(classes))

    def index_of_path(self, path: str, kind: Optional[type]) -> Optional[int]:
        parts = path.split(".")
        for depth in self.depths:
            if depth > len(parts):
                continue
            index = self.full.get(".".join(parts[len(parts) - depth:]))
            if index is not None and (kind is None or self.classes[index] is None or kind is self.classes[index]):
                return index
        return None

    def layer_of(self, node: fx.Node, stack_key: str = "nn_module_stack") -> Optional[int]:
        stack = node.meta.get(stack_key)
        if not stack:
            return None
        for value in stack.values():
            path = value[0] if isinstance(value, tuple) else value
            index = self.index_of_path(normalize_path(str(path)), _class_of(value))
            if index is not None:
                return index
        return None


def map_layers(graph: fx.Graph, matcher: LayerMatcher, backward: bool = False) -> Dict[fx.Node, int]:
    """Every node of `graph` recorded inside one of the matcher's layers, to that layer's index.
    `backward`: a partitioned backward graph, whose nodes carry the module stack of the forward
    node they differentiate (AOTAutograd's `fwd_nn_module_stack`)."""
    key = "fwd_nn_module_stack" if backward else "nn_module_stack"
    out = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        index = matcher.layer_of(node, key)
        if index is not None:
            out[node] = index
    return out
