"""The ops a compiled graph calls to offload a layer's saved tensors (namespace `offload`).

Declared once in the dispatcher, with a fake kernel each, so dynamo, AOTAutograd and inductor
see them as ordinary ops: inductor calls them as extern kernels in graph order. Their real
kernels hand over to the handle's `GroupTransport` (transport.py), which Note [compiled
streams] describes; rewrite.py places them.

- `compiled_step(runtime, served, layers)`: traced at the start of an offloaded model's
  forward. The partitioner that rewrites the graph sets `served` and `layers`, the layers
  the graph offloads and recomputes (`plan_text`; so a graph from the compile cache reports
  its plan too); a graph it never saw (another backend, a torch without the partitioner
  hook) still runs this op, which raises. `layers` is a string rather than two int lists:
  inductor 2.13 lowered those lists, set by the partitioner, as empty ones.
- `group_out(saved, runtime, layer) -> host block` and `group_release(block, saved, anchor,
  runtime)`: the forward side. `anchor` orders the release after the op that makes it due.
- `group_prefetch(block, anchor, token, specs..., device, runtime)` and `group_in(token,
  specs..., device, runtime) -> tensors`: the backward side. The prefetch writes the serial
  of the issued copy into `token`, a buffer of the graph's, which `group_in` reads: a data
  edge, so their order holds (docs/design/compile.md says why the token is not the
  prefetch's output).

Ops that return nothing are marked as having side effects: graph passes would drop them.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .layout import TensorSpec, group_layout, specs_of, unflatten_specs
from .transport import transport_for

_LIB = torch.library.Library("offload", "FRAGMENT")  # noqa: TOR901 - ops defined in Python, once per process

_SCHEMAS = {
    "compiled_step": "compiled_step(int runtime, bool served, str layers) -> ()",
    "group_out": "group_out(Tensor[] saved, int runtime, int layer) -> Tensor",
    "group_release": "group_release(Tensor block, Tensor[] saved, Tensor? anchor, int runtime) -> ()",
    "group_prefetch": ("group_prefetch(Tensor block, Tensor? anchor, Tensor(a!) token, SymInt[] sizes, "
                       "SymInt[] strides, int[] ranks, int[] dtypes, Device device, int runtime) -> ()"),
    "group_in": ("group_in(Tensor token, SymInt[] sizes, SymInt[] strides, int[] ranks, int[] dtypes, "
                 "Device device, int runtime) -> Tensor[]"),
}
for _schema in _SCHEMAS.values():
    _LIB.define(_schema)

# The message a graph no partitioner rewrote raises with; the handle fills in what it knows.
UNSERVED = ("offload.enable_activation_offload: this compiled graph of an offloaded model was not rewritten by "
            "offload's partitioner, so nothing it saves would be offloaded. {why}")
_unserved_why = {"text": "Compile the model with the inductor backend (torch.compile(model) or model.compile(), the "
                         "default backend), or compile its layers (layer.compile()) instead of the whole model."}


def set_unserved_reason(text: str) -> None:
    """What `compiled_step` says when it runs in a graph nothing rewrote (support.py sets it)."""
    _unserved_why["text"] = text


def plan_text(offloaded, recomputed) -> str:
    """`layers` of `compiled_step`: 'offloaded indices/recomputed indices', comma-separated."""
    return ",".join(map(str, offloaded)) + "/" + ",".join(map(str, recomputed))


def _read_plan_text(text: str):
    offloaded, _, recomputed = text.partition("/")
    return ([int(i) for i in offloaded.split(",") if i], [int(i) for i in recomputed.split(",") if i])


def _compiled_step(runtime: int, served: bool, layers: str) -> None:
    if not served:
        raise RuntimeError(UNSERVED.format(why=_unserved_why["text"]))
    transport_for(runtime).begin_step(*_read_plan_text(layers))


def _group_out(saved, runtime: int, layer: int) -> torch.Tensor:
    return transport_for(runtime).group_out(list(saved), layer)


def _group_out_fake(saved, runtime: int, layer: int) -> torch.Tensor:
    return torch.empty(group_layout(specs_of(saved)).total, dtype=torch.uint8, device="cpu")


def _group_release(block, saved, anchor, runtime: int) -> None:
    transport_for(runtime).group_release(block)


def _group_prefetch(block, anchor, token, sizes, strides, ranks, dtypes, device, runtime: int) -> None:
    specs = unflatten_specs(sizes, strides, ranks, dtypes)
    token[0] = transport_for(runtime).group_prefetch(block, specs, device)


def _group_in(token, sizes, strides, ranks, dtypes, device, runtime: int):
    specs = unflatten_specs(sizes, strides, ranks, dtypes)
    return transport_for(runtime).group_in(int(token[0]), specs)


def _group_in_fake(token, sizes, strides, ranks, dtypes, device, runtime: int):
    return [_restored_fake(spec, device) for spec in unflatten_specs(sizes, strides, ranks, dtypes)]


def _restored_fake(spec: TensorSpec, device) -> torch.Tensor:
    return torch.empty_strided(spec.size, spec.stride, dtype=spec.dtype, device=device)


def _none_fake(*args) -> None:
    return None


# One kernel for every device: the ops take host and device tensors together (a host block and
# the device tensors it was copied from), so no single dispatch key names their device.
for _name, _real, _fake in (
    ("compiled_step", _compiled_step, _none_fake),
    ("group_out", _group_out, _group_out_fake),
    ("group_release", _group_release, _none_fake),
    ("group_prefetch", _group_prefetch, _none_fake),
    ("group_in", _group_in, _group_in_fake),
):
    _LIB.impl(_name, _real, "CompositeExplicitAutograd")
    torch.library.register_fake(f"offload::{_name}", _fake, lib=_LIB)

for _name in ("compiled_step", "group_release", "group_prefetch", "group_out"):
    has_side_effect(getattr(torch.ops.offload, _name).default)

compiled_step = torch.ops.offload.compiled_step.default
group_out = torch.ops.offload.group_out.default
group_release = torch.ops.offload.group_release.default
group_prefetch = torch.ops.offload.group_prefetch.default
group_in = torch.ops.offload.group_in.default
