"""One decoding step's attention for a pool of rows, each (row, KV head) reading its own entries and none past
them, in one Triton kernel for CUDA (flash-decoding: a pair's entries are split among programs, whose partial
results are merged by a second, small kernel).

Keys and values lie as the pool holds them: padded, (rows, H_kv, capacity, d), or jagged, (N, d) with each pair's
entries from its own ``bases`` offset (what lets a pool hold each row at its own capacity). ``lengths`` (rows x
H_kv, on the device) says how many entries each pair holds. A program takes one (row, KV head) pair and one of
``splits_for(pairs)`` equal parts of that pair's own entries (a part of no entries returns at once), so a step reads
each pair's own entries whatever the capacity, the longest row in flight or the padding of shorter heads, and the
grid follows the number of pairs alone: a captured CUDA graph replays the step as lengths grow.

The ``group`` query heads of a KV head share its keys, as rows of one block product. Where a row's query heads
chose different entries (per-query-head selection), ``allowed`` hides from each query head what it did not choose:
(rows, H_kv, group, capacity) padded, (N, group) jagged.

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

BLOCK = 64             # entries a program multiplies at a time
TARGET_PROGRAMS = 512  # programs a step's grid aims at, over all pairs
FEWEST_SPLITS = 16     # parts per pair at least: a long row among many short ones is still read by this many programs
MOST_SPLITS = 64       # parts per pair at most (a batch-1 step of 8 KV heads: 512 programs)


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


def splits_for(pairs: int) -> int:
    """Programs per (row, KV head) pair, each reading an equal part of the pair's entries: a power of two making
    about ``TARGET_PROGRAMS`` in all, within [``FEWEST_SPLITS``, ``MOST_SPLITS``]. A function of the number of pairs
    only, so a captured step keeps its grid."""
    want = -(-TARGET_PROGRAMS // max(pairs, 1))
    return min(MOST_SPLITS, max(FEWEST_SPLITS, 1 << (want - 1).bit_length()))


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: the tests, on a CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernel():
    """The Triton programs, imported on first use (importing this module needs no Triton)."""
    from . import decode_attention_triton
    return decode_attention_triton.split_attention, decode_attention_triton.merge_splits


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float, allowed: torch.Tensor | None = None, bases: torch.Tensor | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """Attention of one query per query head over each (row, KV head)'s first ``lengths`` entries.

    query: (rows, H_kv, group, d); lengths: (rows x H_kv,) integers on the device. Padded (``bases`` None): keys,
    values (rows, H_kv, capacity, d), allowed None or (rows, H_kv, group, capacity) booleans, what each query head
    may see. Jagged: keys, values (N, d), pair p's entries at ``bases[p]`` onward, allowed None or (N, group).
    The last dimension contiguous. Returns (rows, H_kv, group, d) in the query's dtype; a pair of no entries gives
    zeros. ``splits``: programs per pair (default ``splits_for``). Off CUDA, ``reference`` computes it."""
    return torch.ops.pcs.decode_attention(query, keys, values, lengths, scale, allowed, bases, splits or 0)


# One operator for the dispatcher: an eager step's operation count sees one where the kernel launches, and a
# compiled region can call it without tracing into Triton's launcher.
@torch.library.custom_op("pcs::decode_attention", mutates_args=())
def _operator(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float,
              allowed: torch.Tensor | None, bases: torch.Tensor | None, splits: int) -> torch.Tensor:
    return _attend(query, keys, values, lengths, scale, allowed, bases, splits or None)


@_operator.register_fake
def _(query, keys, values, lengths, scale, allowed, bases, splits):
    return query.new_empty(query.shape)


def _attend(query, keys, values, lengths, scale, allowed, bases, splits):
    if not query.is_cuda and not interpreted():
        return reference(query, keys, values, lengths, scale, allowed, bases)
    rows, n_kv_heads, group, d = query.shape
    pairs = rows * n_kv_heads
    jagged = bases is not None
    for t in (query, keys, values):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention reads the last dimension contiguously")
    if splits is not None and (splits <= 0 or splits & (splits - 1)):
        raise ValueError(f"decode_attention: splits={splits} is not a power of two")
    width = keys.shape[0] if jagged else keys.shape[2]        # no pair reads past it
    mask_shape = (keys.shape[0], group) if jagged else (rows, n_kv_heads, group, width)
    if lengths.shape != (pairs,) or (jagged and bases.shape != (pairs,)) or \
            (allowed is not None and allowed.shape != mask_shape):
        raise ValueError("decode_attention: lengths and bases are (rows x H_kv,); allowed (rows, H_kv, group, "
                         "capacity) padded, (N, group) jagged")
    n_splits = splits or splits_for(pairs)
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
    if not apart:
        mask_strides = (0, 0, 0, 0)
    elif jagged:                                                     # (entry, query head)
        mask_strides = (0, 0, allowed.stride(1), allowed.stride(0))
    else:
        mask_strides = allowed.stride()
    key_strides = (0, 0, keys.stride(0)) if jagged else keys.stride()[:3]
    value_strides = (0, 0, values.stride(0)) if jagged else values.stride()[:3]
    attend, merge_splits = _kernel()
    attend[(pairs, n_splits)](
        query, keys, values, lengths, bases if jagged else lengths, mask, acc, m, total, scale, n_kv_heads, width,
        query.stride(0), query.stride(1), query.stride(2), *key_strides, *value_strides, *mask_strides,
        out.stride(0), out.stride(1), out.stride(2), ONE_SPLIT=n_splits == 1,
        GROUP=group, ROWS=padded_rows, HEAD=d, D=padded_d, BLOCK=BLOCK, JAGGED=jagged, APART=apart,
        IEEE=keys.dtype == torch.float32, WHILE=interpreted(), num_warps=4, num_stages=2)
    if n_splits > 1:
        merge_splits[(pairs,)](acc, m, total, out, n_kv_heads, out.stride(0), out.stride(1), out.stride(2),
                               SPLITS=n_splits, GROUP=group, ROWS=padded_rows, HEAD=d, D=padded_d, num_warps=4)
    return out


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float,
              allowed: torch.Tensor | None = None, bases: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention`` in plain torch: masked attention over the padded capacity (jagged entries gathered into
    it first), in float32."""
    rows, n_kv_heads, group, d = query.shape
    if bases is not None:        # each pair's entries, as far as the longest pair's, from its own offset
        longest = max(int(lengths.max()), 1) if lengths.numel() else 1
        at = (bases[:, None] + torch.arange(longest, device=keys.device)).clamp(max=keys.shape[0] - 1)
        keys, values = (t[at].reshape(rows, n_kv_heads, longest, d) for t in (keys, values))
        if allowed is not None:
            allowed = allowed[at].reshape(rows, n_kv_heads, longest, group).transpose(2, 3)
    capacity = keys.shape[2]
    seen = torch.arange(capacity, device=keys.device) < lengths.reshape(rows, n_kv_heads, 1, 1)
    if allowed is not None:
        seen = seen & allowed
    seen = seen.expand(rows, n_kv_heads, group, capacity)
    out = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=seen, scale=scale)
    return torch.where(seen.any(-1, keepdim=True), out, 0.0).to(query.dtype)
