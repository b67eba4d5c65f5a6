"""Activation offload of a model compiled whole (torch.compile with inductor).

The design is docs/design/compile.md. In short: offload's partitioner (partitioner.py) runs
inductor's partition, then rewrites the forward and backward graphs of an offloaded model
(rewrite.py) so that each offloaded layer's saved tensors, found by the module structure
the graph records (layer_map.py), leave as one host block through offload's ops (ops.py)
and come back before backward needs them, on offload's pool and copy streams
(transport.py). Which layers offload and which the compiler recomputes is planned from the
partitioned graph (plan.py), auto mode's from each layer's compute estimated from the graphs and
the measured bus (costs.py); where each tensor lies in its group's host block is one pure
function that the ops' fake and real kernels share (layout.py). What the installed torch
offers, and the partitioner's place in inductor's configuration, is support.py. A handle's
`CompiledBinding` (binding.py) ties it to its graphs.
"""

from .binding import BindingOptions, CompiledBinding, bind

__all__ = ["BindingOptions", "CompiledBinding", "bind"]
