"""The Hugging Face Trainer callback: `ActivationOffloadCallback(mode="auto")` against the same Trainer without it.

A Llama built from a config (no downloads), bf16 weights and compute, synthetic
tokens; `transformers.Trainer` trains it for a number of steps, once without the
callback and once with it, in alternating order over the rounds (off, auto, then
auto, off, ...) so that drift on the machine lands on both alike. Each run is a
fresh Trainer (and optimizer) on the same model. A step is timed from the
Trainer's step begin to its step end (after the optimizer step), with a device
synchronize at both ends; the steps after the warm-up of every round are pooled
and their medians compared. Peak memory is the allocator's peak over a run (the
largest over the rounds). Target: auto's step time within 5% of the run without
it, with lower peak memory. `python -m benchmarks --only trainer`.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time

import torch

SECTION = "trainer"
REQUIRES = ("transformers", "accelerate")

# About 0.67B parameters; at seq 4096 the saved activations are several times the weights.
FULL = dict(hidden=2048, intermediate=5632, layers=12, heads=16, kv_heads=4, vocab=32000, seq=4096, batch=2,
            steps=24, warmup=6, rounds=3)
QUICK = dict(hidden=64, intermediate=128, layers=3, heads=4, kv_heads=2, vocab=256, seq=32, batch=2, steps=4,
             warmup=1, rounds=1)
TARGET = 1.05  # auto's step time at most this multiple of the run without the callback


def applies(device_type: str) -> bool:
    return True


def _clock():
    from transformers import TrainerCallback

    from offload.core import _device

    class StepClock(TrainerCallback):
        """Seconds of each optimizer step, the device drained at both ends."""

        def __init__(self, device):
            self.device, self.seconds, self._t0 = device, [], None

        def on_step_begin(self, args, state, control, **kwargs):
            _device.synchronize(self.device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _device.synchronize(self.device)
            self.seconds.append(time.perf_counter() - self._t0)

    return StepClock


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int, vocab: int):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(shapes: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shapes["hidden"], intermediate_size=shapes["intermediate"],
                         num_hidden_layers=shapes["layers"], num_attention_heads=shapes["heads"],
                         num_key_value_heads=shapes["kv_heads"], vocab_size=shapes["vocab"],
                         max_position_embeddings=shapes["seq"])
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def train_once(model, shapes: dict, device, callback, out_dir: str) -> dict:
    """One Trainer run of shapes['steps'] steps: per-step seconds and the allocator's peak."""
    from transformers import Trainer, TrainingArguments

    from offload.core import _device

    on_accel = _device.is_accelerator(device)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=shapes["batch"],
                             max_steps=shapes["steps"], learning_rate=1e-5, bf16=on_accel, use_cpu=not on_accel,
                             save_strategy="no", report_to=[], logging_steps=10**6, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    clock = _clock()(device)
    callbacks = [clock] + ([callback] if callback is not None else [])
    data = _Tokens(shapes["steps"] * shapes["batch"], shapes["seq"], shapes["vocab"])
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    gc.collect()
    _device.empty_cache()
    if on_accel:
        _device.reset_peak_memory_stats(device)
    trainer.train()
    peak = _device.max_memory_allocated(device) if on_accel else 0
    stats = callback.stats() if callback is not None else {}
    del trainer
    gc.collect()
    _device.empty_cache()
    return {"seconds": clock.seconds, "peak_bytes": peak, "stats": stats}


def measure(shapes: dict, device, progress=print) -> dict:
    """{'off'|'auto': {'step_ms', 'step_ms_min', 'step_ms_max', 'peak_bytes', 'stats'}} over the rounds."""
    from offload.core import _device
    from offload.integrations.hf import ActivationOffloadCallback

    on_accel = _device.is_accelerator(device)
    model = build_model(shapes, device, torch.bfloat16 if on_accel else torch.float32)
    steps = {"off": [], "auto": []}
    peaks = {"off": 0, "auto": 0}
    stats = {"off": {}, "auto": {}}
    with tempfile.TemporaryDirectory(prefix="offload-bench-trainer-") as out_dir:
        for r in range(shapes["rounds"]):
            for way in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                callback = ActivationOffloadCallback("auto") if way == "auto" else None
                got = train_once(model, shapes, device, callback, out_dir)
                timed = got["seconds"][shapes["warmup"]:] or got["seconds"]
                steps[way] += timed
                peaks[way] = max(peaks[way], got["peak_bytes"])
                stats[way] = got["stats"]
                progress(f"round {r + 1}/{shapes['rounds']} {way}: step {statistics.median(timed) * 1e3:.1f} ms, "
                         f"peak {got['peak_bytes'] / 2**30:.2f} GiB")
    del model
    gc.collect()
    _device.empty_cache()
    return {way: {"step_ms": statistics.median(s) * 1e3, "step_ms_min": min(s) * 1e3, "step_ms_max": max(s) * 1e3,
                  "steps_timed": len(s), "peak_bytes": peaks[way], "stats": stats[way]} for way, s in steps.items()}


def run(ctx):
    from common import row

    shapes = QUICK if ctx.quick else FULL if ctx.full else dict(FULL, rounds=2)
    got = measure(shapes, ctx.device, ctx.progress)
    off, auto = got["off"], got["auto"]
    ratio = auto["step_ms"] / off["step_ms"]
    s = auto["stats"]
    ctx.progress(f"auto/off step time {ratio:.3f}x ({'met' if ratio <= TARGET else 'MISSED'}: <= {TARGET:.2f}x); "
                 f"auto offloaded {s.get('d2h_bytes', 0) / 2**30:.2f} GiB/step over {s.get('layers_offloaded', 0)} "
                 f"layers, exposed wait {s.get('exposed_seconds', 0.0) * 1e3:.2f} ms/step")
    where = (f"Llama {shapes['layers']}x{shapes['hidden']}, seq {shapes['seq']}, batch {shapes['batch']}, "
             f"{'bf16' if ctx.device.type != 'cpu' else 'fp32'}")
    spread = dict(spread_ms=[auto["step_ms_min"], auto["step_ms_max"]],
                  baseline_spread_ms=[off["step_ms_min"], off["step_ms_max"]], steps_timed=auto["steps_timed"],
                  offloaded_bytes=s.get("d2h_bytes"), layers_offloaded=s.get("layers_offloaded"),
                  exposed_wait_ms=s.get("exposed_seconds", 0.0) * 1e3, target_ratio=TARGET,
                  target_met=ratio <= TARGET)
    return [
        row(SECTION, f"step time, ActivationOffloadCallback('auto') ({where})", offload=auto["step_ms"],
            baseline=off["step_ms"], unit="ms", baseline_name="the same Trainer without the callback",
            higher_is_better=False, headline="Trainer callback (auto): step time", **spread),
        row(SECTION, f"peak memory, ActivationOffloadCallback('auto') ({where})",
            offload=auto["peak_bytes"] / 2**30, baseline=off["peak_bytes"] / 2**30, unit="GiB",
            baseline_name="the same Trainer without the callback", higher_is_better=False),
    ]
