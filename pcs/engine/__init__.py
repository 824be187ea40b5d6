"""The engine: a sample's shared prefill and every cell's compression (``prefill``), then greedy decoding of
many sequences at once (``decode``: the pool's step; ``pool``: its buffers; ``graphs``: the step captured as
a CUDA graph). How many sequences decode together is execution, not part of what a run measures."""
from .decode import DecodePool, DoesNotFit, Generation, Sequence, clock, decode, open_pool
from .prefill import Arrival, Cell, prefill

__all__ = ["Arrival", "Cell", "DecodePool", "DoesNotFit", "Generation", "Sequence", "clock", "decode", "open_pool",
           "prefill"]
