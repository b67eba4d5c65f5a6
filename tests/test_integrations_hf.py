"""The Hugging Face Trainer callback: same losses, gradients and weights with offload on and off, figures logged.

Both runs train where offload moves activations from: the accelerator when the host
has one, else the CPU (the engine's stand-in).
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from offload.core import _device  # noqa: E402
from offload.integrations.hf import LOG_FIGURES, ActivationOffloadCallback  # noqa: E402

STEPS = 5
ON_ACCELERATOR = _device.is_accelerator(_device.current_device())



class _Recording(Trainer):
    """Keeps each step's loss and, just before the optimizer step, the gradients."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses, self.grads = [], []

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return loss


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count=16, length=24, vocab=256):
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (count, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, callback, checkpointing=False, use_cpu=not ON_ACCELERATOR):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    config._attn_implementation = "eager"  # the same attention kernels on every device, deterministic backward
    model = LlamaForCausalLM(config)
    # `gradient_checkpointing` is named `activation_checkpointing` in newer transformers.
    fields = TrainingArguments.__dataclass_fields__
    checkpoint_flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=use_cpu, max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             **{checkpoint_flag: checkpointing})
    trainer = _Recording(model=model, args=args, train_dataset=_Tokens(),
                         callbacks=[callback] if callback is not None else None)
    trainer.train()
    return trainer


def _assert_same(a, b):
    assert len(a.losses) == len(b.losses) == STEPS
    for step, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), f"loss of step {step}: {x.item()} vs {y.item()}"
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert ga.keys() == gb.keys() and ga
        for n in ga:
            assert torch.equal(ga[n], gb[n]), f"gradient of {n} at step {step}"
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    for n in pa:
        assert torch.equal(pa[n], pb[n]), f"parameter {n} after training"


@pytest.mark.parametrize("mode,checkpointing", [("async", False), ("async", True), ("auto", False)])
def test_integrations_hf_trainer_bitwise_equal_with_and_without(tmp_path, mode, checkpointing, deterministic):
    reference = _train(tmp_path / "off", None, checkpointing)
    callback = ActivationOffloadCallback(mode, min_tensor_bytes=0)
    offloaded = _train(tmp_path / "on", callback, checkpointing)
    _assert_same(reference, offloaded)
    assert callback.handle is None, "disabled at train end"
    logged = [entry for entry in offloaded.state.log_history if "loss" in entry]
    assert len(logged) == STEPS and all(set(LOG_FIGURES) <= set(entry) for entry in logged)
    if mode == "async":
        assert all(entry["offload/bytes_offloaded"] > 0 for entry in logged)
    assert callback.stats()["step"] >= 1
    # The model's and the layers' own forwards are back.
    assert "forward" not in vars(offloaded.model)
    assert all("forward" not in vars(layer) for layer in offloaded.model.model.layers)


@pytest.mark.cuda
def test_integrations_hf_model_off_the_accelerator_warns(tmp_path):
    with pytest.warns(UserWarning, match="the Trainer's model is on cpu but activation offload moves activations "
                                         "off cuda:0; nothing is offloaded"):
        _train(tmp_path, ActivationOffloadCallback("async", min_tensor_bytes=0), use_cpu=True)


def test_integrations_hf_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode must be one of async, auto, got 'sync'"):
        ActivationOffloadCallback("sync")


def test_integrations_hf_import_offload_never_imports_transformers():
    code = ("import sys, offload, offload.integrations\n"
            "assert 'transformers' not in sys.modules, 'imported by offload'\n"
            "import offload.integrations.hf\n"
            "assert 'transformers' in sys.modules\n")
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
