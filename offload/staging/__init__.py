"""Async checkpoint staging for torch.distributed.checkpoint. See docs/staging.md."""

from .stager import AsyncStager

__all__ = ["AsyncStager"]
