"""Values derived from a small index tensor (``cu_seqlens``), kept per tensor object and in-place version.

A model passes one ``cu_seqlens`` to every layer, so what the kernels derive from it on the device (chunk
tables, an int32 copy, a longest-first order: each a few kernel launches) is made once per tensor. A hit
needs the same tensor object, the same in-place version counter (``copy_`` and friends bump it) and the
same ``key``; the cache keeps the tensor alive, so its ``id`` cannot be reused meanwhile. Nothing made
during a CUDA-graph capture is kept: such tensors hold their values only once the graph runs.
"""

from __future__ import annotations

from typing import Any

import torch

from cula.kernels.common.fast_launch import stream_capturing


class PerTensorCache:
    """At most ``size`` entries, the oldest evicted first."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: dict[int, tuple[torch.Tensor, int, Any, Any]] = {}

    def get(self, tensor: torch.Tensor, key: Any = None) -> Any:
        """The value stored for ``tensor`` (this version) under ``key``, or None."""
        hit = self._entries.get(id(tensor))
        if hit is not None and hit[0] is tensor and hit[1] == tensor._version and hit[2] == key:
            return hit[3]
        return None

    def put(self, tensor: torch.Tensor, key: Any, value: Any) -> Any:
        """Keep ``value`` for ``tensor`` (unless a capture is running); returns ``value``."""
        if not stream_capturing():
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[id(tensor)] = (tensor, tensor._version, key, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
