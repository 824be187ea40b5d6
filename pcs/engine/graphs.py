"""The decode pool's forward as CUDA graphs: one capture per pool-size bucket (1, 2, 4, ... slots) and buffer
layout, replayed at every step, so a step costs one launch instead of hundreds of kernel launches from Python.

What makes the step replayable: the pool's buffers, write indices, masks and query rings are device tensors
that the step updates in place (``pcs.engine.pool``); attention reads each layer's whole capacity (masked, or
through the decode kernel up to each head's length on the device), so no shape depends on the sequences' lengths; free slots of the bucket advance by 0 and see one zero entry, so
their rows are finite and ignored. A bucket is captured the first time it is needed with the current buffers;
when a buffer grows (a longer sequence joins), the graphs captured on the old one are dropped and the bucket
is captured again. Nothing in the captured forward reads the device from the host: the step's one read is
its chosen tokens, outside the graph (``DecodePool.step``).
"""
from __future__ import annotations

import torch

from .pool import bucket


class StepGraphs:
    def __init__(self, pool):
        self.pool = pool
        self.graphs: dict[tuple, tuple] = {}
        self.memory = torch.cuda.graph_pool_handle()   # one memory pool: graphs never replay at the same time
        # The layout last read, per bucket, until the pool's buffers may have changed (a sequence joined or left, or
        # was compressed again: ``changed``): steps between those read no buffer's address.
        self.layouts: dict[int, tuple] = {}

    def changed(self) -> None:
        self.layouts = {}

    def layout(self, size: int) -> tuple:
        """What a captured graph is tied to: the bucket and the address and shape of every buffer it touches."""
        tensors = [t for layer in self.pool.layers for t in layer.tensors()]
        tensors += self.pool.rings.tensors() if self.pool.rings is not None else []
        recorders = tuple(layer.recorder is not None for layer in self.pool.layers)
        return (size, recorders) + tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)

    def run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the ``len(ids)`` sequences in flight, by replaying their bucket's graph."""
        live, size = ids.shape[0], bucket(ids.shape[0], self.pool.size)
        self.pool.cache.prepare_step(size, whole_capacity=True)
        key = self.layouts.get(size) or self.layouts.setdefault(size, self.layout(size))
        if key not in self.graphs:
            self.graphs = {k: g for k, g in self.graphs.items() if k[1:] == key[1:]}   # drop stale layouts
            self.graphs[key] = self.capture(size)
        graph, static_ids, static_positions, static_logits = self.graphs[key]
        static_ids.zero_()
        static_positions.zero_()
        static_ids[:live] = ids
        static_positions[:live] = positions
        graph.replay()
        return static_logits[:live]

    def capture(self, size: int) -> tuple:
        device = self.pool.device
        static_ids = torch.zeros(size, 1, dtype=torch.long, device=device)
        static_positions = torch.zeros(size, 1, dtype=torch.long, device=device)
        # A warm-up outside the graph initialises what kernels set up lazily; it writes into the pool, so the
        # indices and rings it advances are put back (the entries it wrote are overwritten by the real step).
        saved = self.state()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.forward(static_ids, static_positions)
        torch.cuda.current_stream(device).wait_stream(side)
        self.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            static_logits = self.forward(static_ids, static_positions)
        return graph, static_ids, static_positions, static_logits

    def forward(self, ids, positions) -> torch.Tensor:
        out = self.pool.forward_step(input_ids=ids, position_ids=positions, past_key_values=self.pool.cache, use_cache=True)
        return out.logits[:, -1]

    def state(self) -> list[torch.Tensor]:
        tensors = [t for layer in self.pool.layers for t in (layer.next_slot, layer.next_allowed, layer.held)]
        tensors += self.pool.rings.tensors() if self.pool.rings is not None else []
        return [(t, t.clone()) for t in tensors]

    @staticmethod
    def restore(saved) -> None:
        for tensor, copy in saved:
            tensor.copy_(copy)
