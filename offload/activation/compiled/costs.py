"""What auto mode's plan for a compiled model is made from: each layer's compute time in forward
and backward, estimated from its graph nodes, and the bus's bandwidth each way, measured.

Why estimated: a compiled step runs no Python per layer, so the layer timings the eager planner
measures do not exist. The partitioned graphs hold every op with its shapes instead, and a
training step's time is mostly its matmuls and attention: their floating-point operations
(torch's flop counter formulas) at the device's measured matmul rate give each layer's time.
Elementwise and normalisation ops are left out, so a layer counts as shorter than it runs and
the plan hides fewer bytes than the bus could: an estimate that errs keeps a layer on the device
(memory), never stalls the step (time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from ...core import _device

# The matmul the device's rate is measured on: large enough to run at the rate a layer's matmuls
# reach on an accelerator, small enough to take milliseconds on a host.
RATE_SIZE = {"accelerator": 4096, "host": 256}
RATE_ROUNDS = 5


@dataclass(frozen=True)
class GraphCompute:
    """Floating-point operations of a partitioned graph pair: per layer in forward and backward, and
    outside the layers (embedding, head, loss)."""

    forward: List[int]
    backward: List[int]
    forward_rest: int
    backward_rest: int
    dtype: torch.dtype  # the one most of the forward's operations run in: the device's rate is measured in it


def node_flops(node: fx.Node) -> int:
    """The floating-point operations of `node` by torch's flop counter formulas; 0 for an op it has
    none for, or whose shapes are symbolic."""
    target = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(target) if target is not None else None
    if formula is None:
        return 0

    def value(arg):
        return arg.meta.get("val") if isinstance(arg, fx.Node) else arg

    args, kwargs = tree_map(value, (node.args, node.kwargs))
    try:
        flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
        return flops if type(flops) is int else 0
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts nothing
        return 0


def graph_compute(fw: fx.Graph, bw: fx.Graph, forward_layers: Dict[fx.Node, int],
                  backward_layers: Dict[fx.Node, int], count: int) -> GraphCompute:
    """The floating-point operations of the forward `fw` and backward `bw`, per layer (the layer maps
    of layer_map.map_layers) and outside them."""
    per_pass = []
    by_dtype: Dict[torch.dtype, int] = {}  # a model's few float32 matmuls (rotary angles) do not set the rate
    for graph, layers in ((fw, forward_layers), (bw, backward_layers)):
        per_layer, rest = [0] * count, 0
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            flops = node_flops(node)
            if not flops:
                continue
            if graph is fw and isinstance(node.meta.get("val"), torch.Tensor):
                dtype = node.meta["val"].dtype
                by_dtype[dtype] = by_dtype.get(dtype, 0) + flops
            layer = layers.get(node)
            if layer is None:
                rest += flops
            else:
                per_layer[layer] += flops
        per_pass.append((per_layer, rest))
    (forward, forward_rest), (backward, backward_rest) = per_pass
    dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
    return GraphCompute(forward, backward, forward_rest, backward_rest, dtype)


@functools.lru_cache(maxsize=None)
def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Floating-point operations per second of a square matmul in `dtype` on `device`, measured once
    per process (the best of a few rounds: another tenant only ever slows one)."""
    from ..auto.shared import Clock

    accel = _device.is_accelerator(device)
    n = RATE_SIZE["accelerator" if accel else "host"]
    if not dtype.is_floating_point or (not accel and dtype in (torch.float16, torch.bfloat16)):
        dtype = torch.float32  # a host's half-precision matmul is no measure of its layers
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    clock = Clock(device)
    best = None
    for _ in range(RATE_ROUNDS + 1):  # the first round warms the library up
        start = clock.mark()
        torch.mm(a, b)
        end = clock.mark()
        seconds = clock.seconds(start, end)
        best = seconds if best is None else min(best, seconds)
    return 2 * n ** 3 / max(best, 1e-9)


@functools.lru_cache(maxsize=None)
def bus_bandwidth(device: torch.device) -> tuple:
    """(device-to-host, host-to-device) bytes per second through the copy engine, measured once per
    process (auto mode's own probe)."""
    from ..auto.planner import probe_bandwidth

    return probe_bandwidth(device)


def measured(device: torch.device, dtype: torch.dtype) -> tuple:
    """(matmul flop/s in `dtype`, device-to-host and host-to-device bytes/s) on `device`, measured on
    real tensors: the partitioner runs inside the compile, where tensors made may be fake ones."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        return (matmul_rate(device, dtype),) + tuple(bus_bandwidth(device))
