"""Rewrite a partitioned forward and backward graph so that each offloaded layer's saved
tensors leave as one host block and come back before backward needs them.

Input: the forward and backward graphs the partitioner made (the forward returns the user's
outputs, then the saved tensors, then saved symbolic sizes; the backward takes them in the
order Note [saved order] gives), the layer of each forward node (layer_map.py) and the plan.
The ops and the order they keep are transport.py's Note [compiled streams].

Note [saved order]: AOTAutograd reads the saved values positionally: the forward returns
(tensors checked for in-place changes, tensors not checked, opaque objects, symbolic sizes),
the backward takes (symbolic sizes, the same tensors in the same order, opaque objects,
tangents). The rewrite removes the offloaded tensors from both lists and adds one host block
per group at the end of the checked tensors, in both.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from . import ops
from .layout import DTYPES, flatten_specs, span_elements, specs_of

HOST_PREFIX = "offload_host_"


@dataclass
class SavedGroup:
    """One offloaded layer's saved tensors: `nodes`, the forward nodes whose tensors are copied (in
    forward order), and `saved`, each saved tensor the group takes out of the forward's outputs with
    how backward gets it back (Note [views of one buffer])."""

    layer: int
    nodes: List[fx.Node]
    nbytes: int
    saved: Dict[fx.Node, "Restored"] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    """A saved tensor as backward rebuilds it: the view ops `chain` (forward nodes, first to last)
    replayed on the restored tensor of `nodes[member]` (no ops: that tensor itself)."""

    member: int
    chain: Tuple[fx.Node, ...] = ()


# Note [views of one buffer]: a layer may save several views of one buffer its forward made, as an
# attention layer saves q, k and v, three `select`s of its fused projection's output. Copied one by
# one, each view's bytes run from its first element to its last, and interleaved views span nearly
# the whole buffer each: the bus moved the buffer three times and backward held three restored
# copies of it. Where a group's views of one buffer span at least the buffer's own bytes, the
# buffer is copied once instead, and backward rebuilds each view with the same view ops on the
# restored buffer: inductor sees each view with the size, stride and offset it had, as the graph
# without offload has it.


# Note [window tail]: with the resident window's release points, the last `resident_groups - 1`
# offloaded groups of a forward would be let go at the forward's end, after the compute stream
# waited for their copies out, and backward's first fetch would bring the last of them back at
# once: the bus moves them twice while compute waits, and the device holds them at backward's
# start either way (the eager engine serves them from its held tensors, Note [resident window]
# in engine.py; the budget plan counts them as on the device, plan.left_on_device). So they stay:
# `window_tail` takes them out of the groups copied, and the release points of the groups before
# them stay where those groups' closes put them (the end of each staying group's layer). Backward
# fetches the last group still copied from its start, while the staying groups' layers run.
# Auto mode's planned release points (`release_after`) place every release and the first fetch
# themselves: there nothing stays.


@dataclass(frozen=True)
class RewriteOptions:
    runtime: int  # the handle's transport id, baked into the ops' arguments
    resident_groups: int  # groups that may be on the device at once (Note [resident window])
    min_tensor_bytes: int
    device: torch.device
    # Per offloaded layer, the layer after whose end its group is let go (None: the forward's end),
    # auto mode's release points (plan.hidden_plan); None: the resident window's.
    release_after: Optional[Dict[int, Optional[int]]] = None
    # The layer at whose backward's start the first group's copy back is issued (None: backward's start).
    first_fetch_at: Optional[int] = None


def _val(node) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _static(val: torch.Tensor) -> bool:
    return all(type(n) is int for n in val.shape) and all(type(s) is int for s in val.stride()) \
        and type(val.storage_offset()) is int


def _view_root(node: fx.Node) -> fx.Node:
    """The node whose memory `node` reads, following view ops."""
    while _is_view(node):
        node = node.args[0]
    return node


def saved_tensors(fw: fx.GraphModule, num_fwd_outputs: int) -> List[fx.Node]:
    outs = fw.graph.output_node().args[0]
    return [n for n in outs[num_fwd_outputs:] if _val(n) is not None]


def choose_groups(fw: fx.GraphModule, num_fwd_outputs: int, layers: Dict[fx.Node, int], offload: Sequence[bool],
                  options: RewriteOptions) -> List[SavedGroup]:
    """The saved tensors to offload, grouped by the layer that reads them last in forward (Note
    [group by reader]): that layer offloaded, on the handle's device, at least `min_tensor_bytes`,
    of static size, not a user output, not a view of a graph input (a parameter or the forward's
    input: alive anyway, so a copy frees nothing, as Note [what stays] in engine.py has it)."""
    outs = fw.graph.output_node().args[0]
    user_outputs = {n for n in outs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    by_layer: Dict[int, List[fx.Node]] = {}
    for node in saved_tensors(fw, num_fwd_outputs):
        layer = _reading_layer(node, layers)
        if layer is None or not offload[layer] or node in user_outputs or node.op != "call_function":
            continue
        if node.meta.get("saved_tensor_with_no_vc_check", False) or not _copyable(_val(node), options):
            continue
        if _val(node).numel() * _val(node).element_size() < options.min_tensor_bytes \
                or _view_root(node).op == "placeholder":
            continue
        by_layer.setdefault(layer, []).append(node)
    return [_group(layer, by_layer[layer], options) for layer in sorted(by_layer)]


# Note [group by reader]: a saved tensor goes in the group of the last layer whose forward reads
# it, where that is later than the layer that made it: a decoder layer's output, saved for the
# next layer's norm, belongs to the next layer, as in eager, where the next layer's forward saves
# it. In the group of the layer that made it, it would bring that whole group back one layer
# early (a group comes back where its first reader's backward starts), so three groups would be
# on the device at once where two suffice: the one backward reads and the next, coming back.


def _reading_layer(node: fx.Node, layers: Dict[fx.Node, int]) -> Optional[int]:
    """The layer whose group a saved tensor joins (Note [group by reader]): the last layer whose
    forward reads it, if later than the one that made it; else the one that made it (None: made
    outside every layer)."""
    made = layers.get(node)
    if made is None:
        return None
    readers = [layers[u] for u in node.users if u in layers]
    return max([made] + readers)


def window_tail(groups: List[SavedGroup], options: RewriteOptions) -> Tuple[List[SavedGroup], List[SavedGroup]]:
    """(groups copied, groups that stay on the device): the last `resident_groups - 1` groups
    stay where the resident window places the releases (Note [window tail])."""
    tail = options.resident_groups - 1
    if options.release_after is not None or tail <= 0:
        return groups, []
    cut = max(0, len(groups) - tail)
    return groups[:cut], groups[cut:]


def _copyable(val: Optional[torch.Tensor], options: RewriteOptions) -> bool:
    """A tensor the ops can copy: on the handle's device, strided, of static size, not empty, of a
    dtype the ops carry."""
    return val is not None and val.dtype in DTYPES and val.device == options.device \
        and val.layout == torch.strided and _static(val) and val.numel() > 0


def _span_bytes(val: torch.Tensor) -> int:
    return span_elements(val.shape, val.stride()) * val.element_size()


def _group(layer: int, saved: List[fx.Node], options: RewriteOptions) -> SavedGroup:
    """The group of `saved` (one layer's, in forward order): each tensor copied on its own, except
    views of one buffer that span at least its bytes (Note [views of one buffer])."""
    chains = {node: _view_chain(node) for node in saved}
    by_base: Dict[fx.Node, List[fx.Node]] = {}
    for node, chain in chains.items():
        if chain:
            by_base.setdefault(chain[0].args[0], []).append(node)
    shared = {}
    for base, views in by_base.items():
        if base in chains:  # saved itself too
            views = views + [base]
        if len(views) > 1 and _copyable(_val(base), options) \
                and sum(_span_bytes(_val(v)) for v in views) >= _span_bytes(_val(base)):
            shared.update((v, base) for v in views)
    group = SavedGroup(layer, [], 0)
    members: Dict[fx.Node, int] = {}
    for node in saved:
        member = shared.get(node, node)
        if member not in members:
            members[member] = len(group.nodes)
            group.nodes.append(member)
            group.nbytes += _span_bytes(_val(member))
        group.saved[node] = Restored(members[member], tuple(chains[node]) if member is not node else ())
    return group


def _view_chain(node: fx.Node) -> List[fx.Node]:
    """The view ops from the buffer `node` reads to `node`, first to last, where each takes the one
    before it as its first argument and no other graph value (so backward can replay them); empty
    where `node` is no such view (keyword arguments, which `_set_val` does not pass, are none)."""
    chain = []
    while _is_view(node) and not node.kwargs and not any(isinstance(a, fx.Node) for a in node.args[1:]):
        chain.append(node)
        node = node.args[0]
    if chain and _is_view(node):  # a view of a view that cannot be replayed: not one buffer's view
        return []
    return chain[::-1]


def _is_view(node) -> bool:
    """An op whose output reads its first argument's memory: a view op, or one tensor of a view op
    that returns several (`q, k, v = t` records `unbind` and a `getitem` per tensor)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[1], int) and _is_view(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) \
        and any(r.alias_info is not None and not r.alias_info.is_write for r in node.target._schema.returns)


def _set_val(node: fx.Node, op, *args) -> None:
    """node.meta["val"]: `op` run under the graph's fake mode on its arguments' fake values."""
    def fake(arg):
        if isinstance(arg, fx.Node):
            return arg.meta["val"]
        if isinstance(arg, (list, tuple)):
            return type(arg)(fake(a) for a in arg)
        return arg

    values = [fake(a) for a in args]
    flat = [v for a in values for v in (a if isinstance(a, (list, tuple)) else [a])]
    with detect_fake_mode([v for v in flat if isinstance(v, torch.Tensor)]):
        node.meta["val"] = op(*values)


def rewrite_forward(fw: fx.GraphModule, num_fwd_outputs: int, groups: List[SavedGroup], layers: Dict[fx.Node, int],
                    options: RewriteOptions, staying: Sequence[SavedGroup] = ()) -> List[fx.Node]:
    """Insert each group's `group_out` after its layer's last node and its `group_release` at its
    release point; return the host block nodes (one per group, in `groups` order). `staying`: the
    groups after them that stay on the device (`window_tail`), whose layers' ends are release
    points still."""
    graph = fw.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_of_layer: Dict[int, fx.Node] = {}
    for node, layer in layers.items():
        if node in order and (layer not in last_of_layer or order[node] > order[last_of_layer[layer]]):
            last_of_layer[layer] = node
    # Read before offload's ops are in the graph: their reads are no layer's output.
    outputs = _layer_outputs(graph, layers) if options.release_after is not None or staying else {}
    hosts, afters = [], []
    for group in groups:
        after = _after_of(group, order, last_of_layer)
        afters.append(after)
        with graph.inserting_after(after):
            host = graph.create_node("call_function", ops.group_out, (list(group.nodes), options.runtime, group.layer),
                                     name=f"{HOST_PREFIX}{group.layer}")
        _set_val(host, ops.group_out, list(group.nodes), options.runtime, group.layer)
        hosts.append(host)
    output = graph.output_node()
    window = max(1, options.resident_groups)
    for k, (group, host, after) in enumerate(zip(groups, hosts, afters)):
        if options.release_after is None:
            due = k + window - 1  # released once the group `window - 1` later has closed
            if due < len(hosts):
                anchor = hosts[due]
            elif due - len(hosts) < len(staying):  # a group that stays: where its layer ends
                ends = staying[due - len(hosts)]
                anchor = outputs.get(ends.layer, ends.nodes[-1])
            else:
                anchor = None
        else:  # after the end of the layer the plan names: the layer's output, a data edge to it
            anchor = outputs.get(options.release_after.get(group.layer))
            if anchor is not None and order.get(anchor, -1) <= order[after]:
                anchor = host  # a layer that ends before the group's copy is issued: at once
        where = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(output)
        with where:
            release = graph.call_function(ops.group_release, (host, list(group.nodes), anchor, options.runtime))
        release.meta["val"] = None
    _replace_saved_outputs(fw, num_fwd_outputs, groups, hosts)
    graph.lint()
    fw.recompile()
    return hosts


def _after_of(group: SavedGroup, order: Dict[fx.Node, int], last_of_layer: Dict[int, fx.Node]) -> fx.Node:
    """The node a group's `group_out` follows: its layer's last, or its last saved tensor if later."""
    return max([last_of_layer.get(group.layer, group.nodes[0])] + group.nodes, key=order.__getitem__)


def _layer_outputs(graph: fx.Graph, layers: Dict[fx.Node, int]) -> Dict[int, fx.Node]:
    """Per layer, its output: the last of its nodes whose tensor a node outside the layer reads (so
    inductor makes it a buffer whether or not a release reads it too)."""
    out: Dict[int, fx.Node] = {}
    for node in graph.nodes:
        layer = layers.get(node)
        if layer is None or _val(node) is None:
            continue
        if any(layers.get(user) != layer for user in node.users if user.op != "output"):
            out[layer] = node
    return out


def _replace_saved_outputs(fw: fx.GraphModule, num_fwd_outputs: int, groups, hosts) -> None:
    """The forward's saved tensors without the offloaded ones, the host blocks after the checked
    tensors (Note [saved order])."""
    output = fw.graph.output_node()
    outs = list(output.args[0])
    gone = {n for g in groups for n in g.saved}
    head, saved = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
    at = len(saved)
    for i, node in enumerate(saved):
        if _val(node) is None or node.meta.get("saved_tensor_with_no_vc_check", False):
            at = i
            break
    kept_before = [n for n in saved[:at] if n not in gone]
    kept_after = [n for n in saved[at:] if n not in gone]
    output.args = (tuple(head + kept_before + hosts + kept_after),) + tuple(output.args[1:])
    descs = output.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outs):
        # The descriptions of the saved outputs are positional (SavedForBackwards(i)): the first
        # saved ones, as many as there are saved outputs now, in order.
        saved_descs = list(descs[num_fwd_outputs:])
        count = len(kept_before) + len(hosts) + len(kept_after)
        output.meta["desc"] = list(descs[:num_fwd_outputs]) + saved_descs[:count]


def _layer_starts(graph: fx.Graph, layers: Dict[fx.Node, int]) -> Dict[int, fx.Node]:
    """Per layer, the first node of its backward: the first node recorded in the layer that the
    gradients reach (it depends on a tangent; a parameter's transpose, which does not, may stand
    anywhere)."""
    reached = set()
    starts: Dict[int, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                reached.add(node)
            continue
        if not any(arg in reached for arg in node.all_input_nodes):
            continue
        reached.add(node)
        layer = layers.get(node)
        if layer is not None and layer not in starts:
            starts[layer] = node
    return starts


@dataclass
class _GroupArrival:
    """Where a saved group comes back in the backward graph: `at`, the node its `group_in` stands
    before (`order` its place in the graph), `block` its host block's placeholder, `olds` the
    placeholders of its tensors that the restored ones replace."""

    order: int
    group: SavedGroup
    block: fx.Node
    olds: List[fx.Node]
    at: fx.Node


def rewrite_backward(bw: fx.GraphModule, groups: List[SavedGroup], hosts: List[fx.Node],
                     options: RewriteOptions, layers: Dict[fx.Node, int]) -> None:
    """Replace the offloaded tensors' placeholders with one host block placeholder per group,
    each group brought back by `group_prefetch` (one group ahead of backward) and `group_in`
    (where the backward of the layer that first reads the group starts: `layers`, the backward
    graph's nodes recorded in each layer).

    Why at a layer's start, not at the first use: inductor fuses the nodes of a layer's backward
    as it would without offload only when no op of offload's stands between them. A `group_in`
    at the first use splits, for instance, a bias gradient's sum that does not read the group
    from the sums that do, and split sums add in another order on a GPU."""
    graph = bw.graph
    host_phs = _host_placeholders(graph, groups, hosts)
    order = {n: i for i, n in enumerate(graph.nodes)}  # before offload's ops go in
    starts = _layer_starts(graph, layers)
    arrivals = _arrivals(graph, groups, host_phs, layers, starts, order)
    start = _first_fetch_point(graph, starts, order, options.first_fetch_at, arrivals[0].at if arrivals else None)
    token = None
    for j, arrival in enumerate(arrivals):
        spec_args = tuple(flatten_specs(specs_of([n.meta["val"] for n in arrival.group.nodes]))) + (options.device,)
        if j == 0:
            with graph.inserting_before(start):
                token = _prefetch(graph, arrival.block, None, spec_args, options)
        with graph.inserting_before(arrival.at):
            loaded = graph.call_function(ops.group_in, (token,) + spec_args + (options.runtime,))
            _set_val(loaded, ops.group_in, token, *spec_args, options.runtime)
            items = []
            for i in range(len(arrival.group.nodes)):
                item = graph.call_function(operator.getitem, (loaded, i))
                item.meta["val"] = loaded.meta["val"][i]
                items.append(item)
            if j + 1 < len(arrivals):  # the next group's copy back starts as this one arrives
                nxt = arrivals[j + 1]
                nxt_specs = flatten_specs(specs_of([n.meta["val"] for n in nxt.group.nodes]))
                token = _prefetch(graph, nxt.block, items[0], tuple(nxt_specs) + (options.device,), options)
            values = [_replay(graph, items[r.member], r.chain) for r in arrival.group.saved.values()]
        for old, value in zip(arrival.olds, values):
            old.replace_all_uses_with(value)
            graph.erase_node(old)
    graph.lint()
    bw.recompile()


def _first_fetch_point(graph: fx.Graph, starts: Dict[int, fx.Node], order: Dict[fx.Node, int],
                       layer: Optional[int], arrival: Optional[fx.Node]) -> fx.Node:
    """The node the first copy back is issued before: where `layer`'s backward starts (`starts`,
    `_layer_starts`), if that comes before the first group's arrival; else backward's first node."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    at = starts.get(layer) if layer is not None else None
    if at is None or arrival is None:
        return first
    return at if order[at] < order[arrival] else first


def _replay(graph: fx.Graph, value: fx.Node, chain: Sequence[fx.Node]) -> fx.Node:
    """`chain`'s view ops (forward nodes) applied in the backward graph to `value`."""
    for view in chain:
        args = (value,) + tuple(view.args[1:])
        value = graph.call_function(view.target, args, dict(view.kwargs))
        _set_val(value, view.target, *args)
    return value


def _host_placeholders(graph: fx.Graph, groups: List[SavedGroup], hosts: List[fx.Node]) -> List[fx.Node]:
    """One placeholder per host block (`hosts`, the forward's outputs), placed after the last
    checked saved tensor still there (Note [saved order])."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    gone_names = {n.name for g in groups for n in g.saved}
    anchor = None
    for p in placeholders:
        if p.name in gone_names:
            continue
        if p.name.startswith("tangents") or p.meta.get("saved_tensor_with_no_vc_check", False):
            break
        if _val(p) is None and anchor is not None:
            break
        anchor = p
    host_phs = []
    for host in hosts:
        where = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(placeholders[0])
        with where:
            ph = graph.placeholder(host.name)
        ph.meta.update(host.meta)
        host_phs.append(ph)
        anchor = ph
    return host_phs


def _arrivals(graph: fx.Graph, groups: List[SavedGroup], host_phs: List[fx.Node], layers: Dict[fx.Node, int],
              starts: Dict[int, fx.Node], order: Dict[fx.Node, int]) -> List[_GroupArrival]:
    """Each group's arrival, in the order backward needs them: at the start of the backward of
    the layer that reads the group first (the layer after the group's, whose input the
    group's layer made, or the group's own), else at its first use. `starts`: `_layer_starts`;
    `order`: each node's place in the graph."""
    by_name = {p.name: p for p in graph.find_nodes(op="placeholder")}
    arrivals = []
    for group, ph in zip(groups, host_phs):
        olds = [by_name[n.name] for n in group.saved]
        users = [u for old in olds for u in old.users]
        first = min(users, key=order.__getitem__) if users else graph.output_node()
        for layer in layers.get(first), group.layer:
            start = starts.get(layer)
            if start is not None and order[start] < order[first]:
                first = start
        arrivals.append(_GroupArrival(order.get(first, len(order)), group, ph, olds, first))
    arrivals.sort(key=lambda arrival: arrival.order)
    return arrivals


def _prefetch(graph: fx.Graph, block: fx.Node, anchor: Optional[fx.Node], spec_args, options) -> fx.Node:
    """`group_prefetch` of `block` and the token it writes, which its `group_in` reads."""
    # The token is the graph's own buffer, written by the prefetch: the restored tensors
    # `group_in` returns count as aligned for inductor, as the saved tensors they stand for did
    # (an op's output is taken as unaligned where an input is, and the host block, a graph
    # input on the host, is).
    token = graph.call_function(torch.ops.aten.empty.memory_format, ([1],),
                                {"dtype": torch.int64, "device": torch.device("cpu")})
    with detect_fake_mode([block.meta["val"]]):
        token.meta["val"] = torch.empty(1, dtype=torch.int64, device="cpu")
    node = graph.call_function(ops.group_prefetch, (block, anchor, token) + tuple(spec_args) + (options.runtime,))
    node.meta["val"] = None
    return token
