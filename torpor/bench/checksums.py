"""Checksums of a model's tensors on the device: what decides whether a sleep and wake lost a byte.

Two int64 sums over each tensor's 32-bit words (or bytes, when its size is no multiple of 4): the
plain sum and a position-weighted one, so a changed, lost or moved word changes one of them. Computed
on the device (copying tens of GB to the host to hash them would take longer than the cycle).
"""

from __future__ import annotations

from typing import Any

__all__ = ["module_checksums", "tensor_checksum"]


def tensor_checksum(t: Any) -> tuple[int, int]:
    """The plain and the position-weighted int64 sum of ``t``'s words, computed where ``t`` lives."""
    import torch

    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    w = (flat.view(torch.int32) if flat.numel() % 4 == 0 else flat).to(torch.int64)
    pos = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
    return int(w.sum()), int((w * pos).sum())


def module_checksums(module: Any) -> dict[str, tuple[int, int]]:
    """:func:`tensor_checksum` of every parameter and buffer of ``module``, by name (shared ones under each name)."""
    import torch

    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        return {name: tensor_checksum(t) for name, t in named}
