"""The decoding step's forward compiled by ``torch.compile`` (``EngineOptions.compile_step``): per decoder layer its
norms, rotary embedding, activations, residual additions and the pool's cache writes fused into a few kernels
beside the matrix products and the attention operator, where the eager forward dispatches each of them on its own.

A step through a compiled forward reads every layer's whole capacity (``PoolCache.prepare_step(...,
whole_capacity=True)``), as a captured graph does: no shape follows the step's lengths, and the batch and the
capacity are the only sizes that change. After the first size seen changes, the forward is compiled once more with
those sizes symbolic, so pools of any size and capacity share it. The pool's layer ``update`` and the decode kernel
(a custom operator with a shape function) trace as they are: the whole model is one graph, which the tests check.
"""
from __future__ import annotations

import torch

# Variants of the step compiled before torch falls back to eager for it: the batch of 1 (sizes of 1 are their own
# case), then any batch; times a mask row per query head or not, a query ring recording or not, each capacity a
# kernel split size follows. More than torch's default of 8 across a sweep's pools; each costs one compilation.
RECOMPILES = 64


def compiled_forward(model, backend: str = "inductor"):
    """``model``'s forward as one compiled graph (see the module's docstring). On CUDA the graph's kernels are
    captured by ``pcs.engine.graphs`` as the eager forward's are. ``backend``: torch.compile's (the tests trace the
    pool's step through ``aot_eager`` too: the same graph, run by torch's own kernels, without generating code)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
    on_cpu = next(model.parameters()).device.type == "cpu"
    # on a CPU each fused kernel names itself to a profiler (as CUDA's kernels do), so a step's kernels can be counted
    options = {"cpp.enable_kernel_profile": True} if on_cpu and backend == "inductor" else None
    return torch.compile(model, backend=backend, options=options)
