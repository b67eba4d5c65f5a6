"""Activation offload of a model compiled whole (torch.compile with inductor).

The design is docs/design/compile.md. In short: offload's partitioner (partitioner.py) runs
inductor's partition, then rewrites the forward and backward graphs of an offloaded model
(rewrite.py) so that each offloaded layer's saved tensors, found by the module structure
the graph records (layer_map.py), leave as one host block through offload's ops (ops.py)
and come back before backward needs them, on offload's pool and copy streams
(transport.py). A handle's `CompiledBinding` (binding.py) ties it to its graphs.
"""

from .binding import BindingOptions, CompiledBinding, bind

__all__ = ["BindingOptions", "CompiledBinding", "bind"]
