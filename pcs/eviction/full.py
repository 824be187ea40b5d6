"""The full cache: keeps everything, the reference every method is measured against."""
from __future__ import annotations

from dataclasses import dataclass

from .base import LayerState, Method


@dataclass
class FullCache(Method):
    evicts: bool = False

    def keep(self, layer: LayerState, stage2=None):
        return None
