"""Activation offload: saved activations go to pinned host memory during forward and come
back ahead of backward. See docs/activation.md."""

from .engine import ActivationOffload, activation_offload, enable_activation_offload

__all__ = ["ActivationOffload", "activation_offload", "enable_activation_offload"]
