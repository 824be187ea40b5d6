"""Stage 2's exact norms ``||v_i W^O_h||_1`` in one Triton kernel, for CUDA.

The batched product that ``projected_value_norms`` otherwise makes writes every entry's (group x hidden) outputs to
memory and a reduction reads them back: at 8K tokens with Llama-3.1-8B's shapes, half a gigabyte a layer for a
quarter of the entries. Here each program multiplies a block of value rows by a block of ``W^O_h``'s columns in
registers and adds the block's absolute values into the rows' sums, so the product never reaches memory. A row
may ask for fewer entries than the others (``sizes``): its programs past them return at once.

An entry's norm depends on its own value vector only: every program sums the same column blocks in the same order,
and a row's dot products do not depend on the other rows of its block. So an entry gets the same bits whichever
entries it is scored with, as the bounded stage 2 needs (``pcs.eviction.scores.NormPlan``). Products accumulate in
float32 (``input_precision="ieee"`` for float32 values: no TF32 rounding), closer to the exact norm than the
half-precision product the torch path reduces.

Triton is imported lazily: it ships with torch's CUDA wheels, not with the CPU wheel this project pins, and a
machine without it keeps the torch path (``available``).
"""
from __future__ import annotations

import functools

import torch

# One configuration, never tuned per call: another block shape could change an entry's bits. It was the fastest of
# 24 block shapes timed on one layer of Llama-3.1-8B's shapes at 8,192 entries (docs/findings.md, GPU prefill;
# results/bench/value_norm_blocks_NVIDIA_H200.jsonl), and tests/test_gpu.py holds its norms and bits.
BLOCK_ENTRIES = 128    # value rows per program
BLOCK_OUTPUTS = 64     # columns of W^O_h per step of a program's loop
NUM_WARPS = 8          # Triton's launch options
NUM_STAGES = 3


def configuration() -> str:
    """The kernel's configuration in words, for results rows: entries x outputs per block, warps, stages."""
    return f"{BLOCK_ENTRIES}x{BLOCK_OUTPUTS}, {NUM_WARPS} warps, {NUM_STAGES} stages"


def available(device: torch.device, d: int) -> bool:
    """Whether the kernel can score a layer of head dimension ``d`` on ``device``: CUDA with Triton importable, and
    ``d`` a power of two of at least 16 (a Triton block's size and ``tl.dot``'s smallest inner dimension)."""
    if device.type != "cuda" or d < 16 or d & (d - 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """The compiled kernel, built on first use (so that importing this module needs no Triton)."""
    import triton
    import triton.language as tl

    # One compiled kernel whatever the number of entries: Triton would otherwise compile variants for sizes and
    # strides equal to 1 or divisible by 16, and an entry's bits would rest on those variants computing alike.
    @triton.jit(do_not_specialize=["n_entries", "stride_vr", "stride_vn", "stride_or", "stride_og", "stride_on"])
    def value_norms(values, weights, sizes, out, n_entries, group, hidden,
                    stride_vr, stride_vn, stride_vd, stride_wr, stride_wd, stride_wo, stride_or, stride_og,
                    stride_on, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr):
        row_head = tl.program_id(0)                  # row r's query head g: r * group + g
        r, g = row_head // group, row_head % group
        first = tl.program_id(1) * BLOCK_M
        n_row = tl.minimum(tl.load(sizes + r), n_entries)     # the entries row r asks for
        if first < n_row:                            # a block past them computes nothing
            entries = first + tl.arange(0, BLOCK_M)
            dims = tl.arange(0, D)
            inside = entries < n_row
            v = tl.load(values + r * stride_vr + entries[:, None] * stride_vn + dims[None, :] * stride_vd,
                        mask=inside[:, None], other=0.0)
            sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
            w_head = weights + r * stride_wr + g * hidden * stride_wo
            for start in range(0, hidden, BLOCK_N):
                outputs = start + tl.arange(0, BLOCK_N)
                w = tl.load(w_head + dims[:, None] * stride_wd + outputs[None, :] * stride_wo,
                            mask=outputs[None, :] < hidden, other=0.0)
                if IEEE:
                    y = tl.dot(v, w, input_precision="ieee")
                else:
                    y = tl.dot(v, w)
                sums += tl.sum(tl.abs(y), axis=1)
            tl.store(out + r * stride_or + g * stride_og + entries * stride_on, sums, mask=inside)

    return value_norms


def value_norms(values: torch.Tensor, weights: torch.Tensor, group: int,
                sizes: torch.Tensor | None = None) -> torch.Tensor:
    """``||v_i W^O_h||_1`` for (r, c, d) value rows of r rows and each row's ``group`` query heads' ``W^O_h`` side by
    side (``group_weights``: (r, d, group * hidden)) -> (r, group, c) float32, as ``projected_value_norms``.

    ``sizes`` (r,) on the device: row i asks for its first ``sizes[i]`` entries only, the rest of its outputs are
    zeros, and the blocks past them cost a launch's share each, not a product: a batch of rows that ask for unequal
    numbers of entries (AdaKV's heads) pays for what each asks, not for the largest. The same kernel runs either
    way, ``sizes`` or not, so an entry gets the same bits."""
    r, c, d = values.shape
    hidden = weights.shape[-1] // group
    assert weights.shape == (r, d, group * hidden) and weights.dtype == values.dtype, (values.shape, weights.shape)
    if sizes is None:
        out = torch.empty(r, group, c, dtype=torch.float32, device=values.device)
        sizes = torch.full((r,), c, dtype=torch.long, device=values.device)
    else:           # int64 either way: Triton compiles a kernel per pointer type
        assert sizes.shape == (r,) and sizes.dtype == torch.long, (sizes.shape, sizes.dtype)
        out = torch.zeros(r, group, c, dtype=torch.float32, device=values.device)
    if c and r:
        launch(values, weights, group, sizes, out)
    return out


def launch(values: torch.Tensor, weights: torch.Tensor, group: int, sizes: torch.Tensor, out: torch.Tensor,
           block_entries: int | None = None, block_outputs: int | None = None, **options) -> None:
    """The kernel over ``value_norms``' arguments into ``out``, in blocks of ``block_entries`` x ``block_outputs``
    (``options``: Triton's launch options, e.g. ``num_warps``), the module's configuration where not given. Other
    configurations are for timing them (docs/findings.md, GPU prefill): an entry's bits may depend on them."""
    import triton
    r, c, d = values.shape
    block_entries = BLOCK_ENTRIES if block_entries is None else block_entries
    block_outputs = BLOCK_OUTPUTS if block_outputs is None else block_outputs
    options = {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES} | options
    _kernel()[(r * group, triton.cdiv(c, block_entries))](
        values, weights, sizes, out, c, group, weights.shape[-1] // group,
        *values.stride(), *weights.stride(), *out.stride(),
        D=d, BLOCK_M=block_entries, BLOCK_N=block_outputs, IEEE=values.dtype == torch.float32, **options)
