"""`ActivationOffloadCallback`: activation offload inside a Hugging Face `Trainer`.

    from offload.integrations.hf import ActivationOffloadCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[ActivationOffloadCallback("auto")])

At train begin the callback calls `offload.enable_activation_offload` on the model
the Trainer trains (as it is then: plain, with `gradient_checkpointing=True`, or
sharded by accelerate's FSDP2, whose units become the offload layers); at train
end it disables it. Every `logging_steps` it adds the last step's figures to the
Trainer's logs. Importing this module imports `transformers`; nothing else in
offload does.
"""

from __future__ import annotations

import warnings
from typing import Optional

from transformers import TrainerCallback

from ..activation import enable_activation_offload
from ..core import _device

MODES = ("async", "auto")
# What the callback adds to the Trainer's logs: log key -> (stats() key, scale).
LOG_FIGURES = {
    "offload/bytes_offloaded": ("d2h_bytes", 1),
    "offload/exposed_wait_ms": ("exposed_seconds", 1e3),
    "offload/peak_memory_bytes": ("peak_device_bytes", 1),
    "offload/layers_offloaded": ("layers_offloaded", 1),
}


class ActivationOffloadCallback(TrainerCallback):
    """Enables activation offload on the Trainer's model for the length of `train()`.

    Args:
        mode: "async" (every layer but the last offloaded, copies overlapped with
            compute) or "auto" (only what the bus hides under compute, or as little as
            meets `memory_budget_bytes`); see docs/activation.md.
        **options: passed to `offload.enable_activation_offload` (`layers`,
            `memory_budget_bytes`, `keep_last`, `min_tensor_bytes`, ...; with "auto" on
            several ranks whose batches share one shape, `process_group=dist.group.WORLD`).

    `handle` is the `offload.ActivationOffload` while training runs (None before and
    after); `stats()` gives its figures. On each `on_log` the keys of `LOG_FIGURES` are
    added to the logs (and to `state.log_history`); callbacks that log before this one
    in the same event (the reporting integrations the Trainer adds first) see them on
    the Trainer's next log.
    """

    def __init__(self, mode: str = "async", **options):
        if mode not in MODES:
            raise ValueError(f"offload.integrations.hf.ActivationOffloadCallback: mode must be one of "
                             f"{', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.options = options
        self.handle = None
        self._last: Optional[dict] = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("offload.integrations.hf.ActivationOffloadCallback: the Trainer passed no model "
                               "to on_train_begin")
        if self.handle is None:
            _warn_if_off_the_device(model)
            self.handle = enable_activation_offload(model, self.mode, **self.options)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self._last = self.stats()
            self.handle.disable()
            self.handle = None
        return control

    def stats(self) -> dict:
        """The handle's `stats()` while training runs; after it, those of the last step trained."""
        if self.handle is None:
            return dict(self._last or {})
        return self.handle.stats()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.handle is None or logs is None:
            return control
        figures = self.figures()
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
        return control

    def figures(self) -> dict:
        """The log entries of the last step: LOG_FIGURES' keys."""
        stats = self.stats()
        out = {}
        for key, (name, scale) in LOG_FIGURES.items():
            value = stats.get(name)
            if value is not None:
                out[key] = value * scale
        return out


def _warn_if_off_the_device(model) -> None:
    """Offload moves activations off the compute device; a model trained elsewhere (the Trainer's
    `use_cpu=True` on a host with an accelerator) has none there, and would run silently unchanged."""
    compute = _device.current_device()
    where = next((p.device for p in model.parameters()), None)
    if where is not None and _device.is_accelerator(compute) and where.type != compute.type:
        warnings.warn(f"offload.integrations.hf.ActivationOffloadCallback: the Trainer's model is on {where} but "
                      f"activation offload moves activations off {compute}; nothing is offloaded (train on "
                      f"{compute.type}: use_cpu=False)", stacklevel=3)
