"""Tensor lists of real models (names, shapes), built from `transformers` configs on the meta device.

No weights are downloaded or allocated: the model is instantiated on `meta` and
only its state dict's names and shapes are read.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


def qwen2_5_1_5b(quick: bool = False) -> List[Tuple[str, Tuple[int, ...]]]:
    """Qwen2.5-1.5B: hidden 1536, 28 layers, intermediate 8960, vocab 151936, 12/2 heads, tied: 339 tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        config = Qwen2Config(hidden_size=128, num_hidden_layers=2, intermediate_size=352, vocab_size=2048,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        config = Qwen2Config(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, vocab_size=151936,
                             num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    return _shapes(Qwen2ForCausalLM, config)


def llama3_8b(quick: bool = False) -> List[Tuple[str, Tuple[int, ...]]]:
    """A Llama-3-8B-like list: hidden 4096, 32 layers, intermediate 14336, vocab 128256, 32 heads, 8 kv heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        config = LlamaConfig(hidden_size=256, num_hidden_layers=2, intermediate_size=896, vocab_size=4096,
                             num_attention_heads=8, num_key_value_heads=2)
    else:
        config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
                             num_attention_heads=32, num_key_value_heads=8)
    return _shapes(LlamaForCausalLM, config)


QUICK_LABELS = {"Qwen2.5-1.5B": "tiny Qwen2 config", "Llama-3-8B": "tiny Llama config"}


def label(name: str, quick: bool) -> str:
    """How a row names a tensor list: quick shapes are tiny configs, not the model of that name."""
    return QUICK_LABELS[name] if quick else name


def _shapes(cls, config):
    with torch.device("meta"):
        model = cls(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def materialize(shapes, dtype, device):
    """name -> tensor of each shape, filled with a constant; tied names get tensors of their own."""
    return {name: torch.full(shape, 0.5 + (i % 7), dtype=dtype, device=device)
            for i, (name, shape) in enumerate(shapes)}
