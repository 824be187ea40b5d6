"""One decoding step's attention for a pool of rows, each (row, KV head) reading its own entries and none past
them, in one Triton kernel for CUDA (flash-decoding: the entries are split among programs, whose partial results
are merged by a second, small kernel).

Keys and values lie as the pool holds them, (rows, H_kv, capacity, d); ``lengths`` (rows x H_kv, on the device)
says how many entries each head holds. A program takes one (row, KV head) pair and one split of ``split`` entries;
a split past the pair's length returns at once, so a step reads each pair's own entries whatever the capacity,
the longest row in flight or the padding of shorter heads. Lengths live on the device and the grid depends only on
the buffers' shapes, so a captured CUDA graph replays the step as lengths grow.

The ``group`` query heads of a KV head share its keys, as rows of one block product. Where a row's query heads
chose different entries (per-query-head selection), ``allowed`` (rows, H_kv, group, capacity) hides from each
query head what it did not choose.

Why a kernel of its own: PyTorch's attention kernels parallelize over (batch, heads) at one query, 8 programs for
a batch-1 step of Llama's 8 KV heads, and a boolean mask rules out the flash kernel. On an H200 a full-cache step
at 32K read its 4 GiB of entries at about 100 GB/s that way (results/bench/README.md).

Triton is imported lazily: it ships with torch's CUDA wheels, not with the CPU wheel this project pins.
``reference`` is the same attention in plain torch (masked attention over each row's padded entries), what the
kernel is tested against and what a machine without Triton uses.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

BLOCK = 64           # entries a program multiplies at a time
TARGET_PROGRAMS = 512   # splits are sized so that a step launches about this many programs over the capacity
LONGEST_SPLIT = 1024    # entries one program reads at most


def available(device: torch.device, d: int) -> bool:
    """Whether the kernel can run on ``device`` for head dimension ``d`` (any: the kernel pads it to a power of two
    of at least 16, ``tl.dot``'s smallest inner dimension): CUDA with Triton importable."""
    if device.type != "cuda" or d < 1:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def split_size(pairs: int, capacity: int) -> int:
    """Entries per program: a power of two times ``BLOCK``, so that ``pairs`` (row, KV head) pairs over
    ``capacity`` entries make about ``TARGET_PROGRAMS`` programs; at most ``LONGEST_SPLIT``. A function of the
    buffers' shapes only, so a captured step keeps its grid."""
    want = -(-pairs * capacity // TARGET_PROGRAMS)
    size = BLOCK
    while size < want and size < LONGEST_SPLIT:
        size *= 2
    return size


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: the tests, on a CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernel():
    """The compiled kernel, built on first use (importing this module needs no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_kv_heads", "width", "s_qb", "s_qh", "s_qg", "s_kb", "s_kh", "s_kn", "s_vb", "s_vh",
                                   "s_vn", "s_ab", "s_ah", "s_ag", "s_an", "s_ob", "s_oh", "s_og"])
    def split_attention(q, keys, values, lengths, allowed, acc_out, m_out, l_out, scale, n_kv_heads, width,
                        s_qb, s_qh, s_qg, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ab, s_ah, s_ag, s_an,
                        s_ob, s_oh, s_og, ONE_SPLIT: tl.constexpr,
                        GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr, D: tl.constexpr,
                        BLOCK: tl.constexpr,
                        SPLIT_BLOCKS: tl.constexpr, APART: tl.constexpr, IEEE: tl.constexpr):
        pair = tl.program_id(0)
        split = tl.program_id(1)
        n_splits = tl.num_programs(1)
        b = (pair // n_kv_heads).to(tl.int64)        # 64-bit offsets: a layer's buffer may pass 2^31 elements
        h = (pair % n_kv_heads).to(tl.int64)
        n = tl.minimum(tl.load(lengths + pair), width)     # never past the buffer, whatever a length says
        rows = tl.arange(0, ROWS)                    # the group's query heads, padded to tl.dot's 16 rows
        dims = tl.arange(0, D)                       # the head dimension HEAD, padded to a power of two
        real = dims < HEAD
        offsets = tl.arange(0, BLOCK)
        query = tl.load(q + b * s_qb + h * s_qh + rows[:, None] * s_qg + dims[None, :],
                        mask=(rows[:, None] < GROUP) & real[None, :], other=0.0)
        m = tl.full([ROWS], float("-inf"), tl.float32)       # running maximum score per query head
        total = tl.zeros([ROWS], tl.float32)                 # running sum of exp(score - m)
        acc = tl.zeros([ROWS, D], tl.float32)                # running sum of exp(score - m) x value
        for i in range(SPLIT_BLOCKS):
            start = (split * SPLIT_BLOCKS + i) * BLOCK
            if start < n:                            # a block past the pair's entries reads nothing
                at = start + offsets
                inside = at < n
                k = tl.load(keys + b * s_kb + h * s_kh + at[:, None] * s_kn + dims[None, :],
                            mask=inside[:, None] & real[None, :], other=0.0)
                if IEEE:                                 # float32 entries: no TF32 rounding
                    scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
                else:
                    scores = tl.dot(query, tl.trans(k)) * scale
                seen = inside[None, :] & (rows[:, None] < GROUP)
                if APART:
                    chosen = tl.load(allowed + b * s_ab + h * s_ah + rows[:, None] * s_ag + at[None, :] * s_an,
                                     mask=seen, other=0)
                    seen = seen & (chosen != 0)
                scores = tl.where(seen, scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that has seen nothing yet
                rescale = tl.exp(m - shift)
                p = tl.exp(scores - shift[:, None])
                total = total * rescale + tl.sum(p, 1)
                v = tl.load(values + b * s_vb + h * s_vh + at[:, None] * s_vn + dims[None, :],
                            mask=inside[:, None] & real[None, :], other=0.0)
                if IEEE:
                    acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
        asked = rows < GROUP
        if ONE_SPLIT:                                # the whole answer: normalized, into the output
            answer = acc / tl.maximum(total, 1.17549435e-38)[:, None]
            tl.store(acc_out + b * s_ob + h * s_oh + rows[:, None] * s_og + dims[None, :],
                     answer.to(acc_out.dtype.element_ty), mask=asked[:, None] & real[None, :])
        else:                                        # a split's partial sums, merged by merge_splits
            out = (pair * n_splits + split).to(tl.int64) * ROWS + rows
            tl.store(m_out + out, m, mask=asked)
            tl.store(l_out + out, total, mask=asked)
            tl.store(acc_out + out[:, None] * D + dims[None, :], acc, mask=asked[:, None])

    @triton.jit(do_not_specialize=["n_kv_heads", "s_ob", "s_oh", "s_og"])
    def merge_splits(acc, m, total, out, n_kv_heads, s_ob, s_oh, s_og,
                     SPLITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr,
                     D: tl.constexpr):
        # One program per (row, KV head): the splits' sums rescaled to a common maximum, one after another.
        pair = tl.program_id(0)
        b = (pair // n_kv_heads).to(tl.int64)
        h = (pair % n_kv_heads).to(tl.int64)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, D)
        asked = rows < GROUP
        top = tl.full([ROWS], float("-inf"), tl.float32)
        weight = tl.zeros([ROWS], tl.float32)
        answer = tl.zeros([ROWS, D], tl.float32)
        for split in range(SPLITS):
            at = (pair * SPLITS + split).to(tl.int64) * ROWS + rows
            m_split = tl.load(m + at, mask=asked, other=float("-inf"))
            new_top = tl.maximum(top, m_split)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            old_scale = tl.exp(top - shift)
            split_scale = tl.exp(m_split - shift)
            weight = weight * old_scale + tl.load(total + at, mask=asked, other=0.0) * split_scale
            part = tl.load(acc + at[:, None] * D + dims[None, :], mask=asked[:, None], other=0.0)
            answer = answer * old_scale[:, None] + part * split_scale[:, None]
            top = new_top
        answer = answer / tl.maximum(weight, 1.17549435e-38)[:, None]
        tl.store(out + b * s_ob + h * s_oh + rows[:, None] * s_og + dims[None, :],
                 answer.to(out.dtype.element_ty), mask=asked[:, None] & (dims[None, :] < HEAD))

    return split_attention, merge_splits


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float, allowed: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """Attention of one query per query head over each (row, KV head)'s first ``lengths`` entries.

    query: (rows, H_kv, group, d); keys, values: (rows, H_kv, capacity, d), last dimension contiguous; lengths:
    (rows x H_kv,) integers on the device; allowed: None, or (rows, H_kv, group, capacity) booleans, what each
    query head may see. Returns (rows, H_kv, group, d) in the query's dtype; a pair of no entries gives zeros.
    Off CUDA, ``reference`` computes it."""
    return torch.ops.pcs.decode_attention(query, keys, values, lengths, scale, allowed, split or 0)


# One operator for the dispatcher: an eager step's operation count sees one where the kernel launches, and a
# compiled region can call it without tracing into Triton's launcher.
@torch.library.custom_op("pcs::decode_attention", mutates_args=())
def _operator(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float,
              allowed: torch.Tensor | None, split: int) -> torch.Tensor:
    return _attend(query, keys, values, lengths, scale, allowed, split or None)


@_operator.register_fake
def _(query, keys, values, lengths, scale, allowed, split):
    return query.new_empty(query.shape)


def _attend(query, keys, values, lengths, scale, allowed, split):
    if not query.is_cuda and not interpreted():
        return reference(query, keys, values, lengths, scale, allowed)
    rows, n_kv_heads, group, d = query.shape
    capacity = keys.shape[2]
    for t in (query, keys, values):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention reads the last dimension contiguously")
    pairs = rows * n_kv_heads
    if split is not None and (split <= 0 or split % BLOCK):
        raise ValueError(f"decode_attention: split={split} is not a positive multiple of {BLOCK} entries")
    if lengths.shape != (pairs,) or (allowed is not None and allowed.shape != (rows, n_kv_heads, group, capacity)):
        raise ValueError("decode_attention: lengths are (rows x H_kv,), allowed (rows, H_kv, group, capacity)")
    split = split or split_size(pairs, capacity)
    n_splits = max(1, -(-capacity // split))
    padded_rows = max(16, 1 << (group - 1).bit_length())
    padded_d = max(16, 1 << (d - 1).bit_length())
    out = torch.empty(rows, n_kv_heads, group, d, dtype=query.dtype, device=query.device)
    if n_splits == 1:      # no partial sums: the kernel writes the answer
        acc = m = total = out
    else:
        acc = torch.empty(pairs, n_splits, padded_rows, padded_d, dtype=torch.float32, device=query.device)
        m = torch.empty(pairs, n_splits, padded_rows, dtype=torch.float32, device=query.device)
        total = torch.empty_like(m)
    apart = allowed is not None
    mask = allowed.view(torch.uint8) if apart else lengths          # any pointer where nothing is read
    mask_strides = allowed.stride() if apart else (0, 0, 0, 0)
    attend, merge_splits = _kernel()
    attend[(pairs, n_splits)](
        query, keys, values, lengths, mask, acc, m, total, scale, n_kv_heads, capacity,
        query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), *mask_strides,
        out.stride(0), out.stride(1), out.stride(2), ONE_SPLIT=n_splits == 1,
        GROUP=group, ROWS=padded_rows, HEAD=d, D=padded_d, BLOCK=BLOCK, SPLIT_BLOCKS=split // BLOCK, APART=apart,
        IEEE=keys.dtype == torch.float32, num_warps=4, num_stages=2)
    if n_splits > 1:
        merge_splits[(pairs,)](acc, m, total, out, n_kv_heads, out.stride(0), out.stride(1), out.stride(2),
                               SPLITS=n_splits, GROUP=group, ROWS=padded_rows, HEAD=d, D=padded_d, num_warps=4)
    return out


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention`` in plain torch: masked attention over the padded capacity, in float32."""
    rows, n_kv_heads, group, d = query.shape
    capacity = keys.shape[2]
    seen = torch.arange(capacity, device=keys.device) < lengths.reshape(rows, n_kv_heads, 1, 1)
    if allowed is not None:
        seen = seen & allowed
    seen = seen.expand(rows, n_kv_heads, group, capacity)
    out = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=seen, scale=scale)
    return torch.where(seen.any(-1, keepdim=True), out, 0.0).to(query.dtype)
