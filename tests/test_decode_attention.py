"""pcs.kernels.decode_attention: each (row, KV head) attends over its own first ``lengths`` entries, per query head
only over what it chose where heads chose apart; the kernel (Triton's interpreter on a CPU, CUDA where there is
one) against the torch reference, and the reference against a softmax written out per query head."""
import os
import subprocess
import sys

import pytest
import torch

from pcs.kernels import decode_attention as da


def problem(rows, n_kv_heads, group, capacity, d=16, apart=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, n_kv_heads, group, d, generator=g).to(dtype)
    k = torch.randn(rows, n_kv_heads, capacity, d, generator=g).to(dtype)
    v = torch.randn(rows, n_kv_heads, capacity, d, generator=g).to(dtype)
    lengths = torch.randint(1, capacity + 1, (rows * n_kv_heads,), generator=g)
    lengths[0], lengths[-1] = capacity, 0          # a head that fills the capacity, one that holds nothing
    allowed = torch.rand(rows, n_kv_heads, group, capacity, generator=g) < 0.6 if apart else None
    return q, k, v, lengths, allowed


def jagged(k, v, allowed, lengths, seed=1):
    """The same entries laid out as a jagged pool holds them: each pair's first ``lengths`` entries (and room after
    them, filled with noise) at an offset of its own in one (N, d) buffer, the pairs in shuffled order with gaps."""
    rows, n_kv_heads, capacity, d = k.shape
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(rows * n_kv_heads, generator=g).tolist()
    room = torch.randint(0, 20, (rows * n_kv_heads,), generator=g)
    bases, at = torch.zeros(rows * n_kv_heads, dtype=torch.long), 0
    for pair in order:
        at += int(torch.randint(0, 9, (1,), generator=g))            # a gap: a freed region
        bases[pair] = at
        at += int(lengths[pair]) + int(room[pair])
    flat_k, flat_v = torch.randn(at, d, generator=g).to(k.dtype), torch.randn(at, d, generator=g).to(v.dtype)
    flat_a = None if allowed is None else torch.rand(at, allowed.shape[2], generator=g) < 0.5
    for pair in range(rows * n_kv_heads):
        r, h, n, b = pair // n_kv_heads, pair % n_kv_heads, int(lengths[pair]), int(bases[pair])
        flat_k[b:b + n], flat_v[b:b + n] = k[r, h, :n], v[r, h, :n]
        if allowed is not None:
            flat_a[b:b + n] = allowed[r, h, :, :n].T
    return flat_k, flat_v, flat_a, bases


def written_out(q, k, v, lengths, scale, allowed):
    """Per (row, KV head, query head): softmax(q k^T) v over the entries it sees, in float64."""
    rows, n_kv_heads, group, d = q.shape
    out = torch.zeros(rows, n_kv_heads, group, d, dtype=torch.float64)
    for r in range(rows):
        for h in range(n_kv_heads):
            n = int(lengths[r * n_kv_heads + h])
            for j in range(group):
                seen = torch.arange(n) if allowed is None else allowed[r, h, j, :n].nonzero().flatten()
                if len(seen):
                    scores = (k[r, h, seen].double() @ q[r, h, j].double()) * scale
                    out[r, h, j] = torch.softmax(scores, 0) @ v[r, h, seen].double()
    return out


@pytest.mark.parametrize("apart", [False, True])
def test_the_reference_is_a_softmax_over_each_heads_own_entries(apart):
    q, k, v, lengths, allowed = problem(3, 2, 4, 50, apart=apart)
    got = da.reference(q, k, v, lengths, 0.3, allowed)
    torch.testing.assert_close(got.double(), written_out(q, k, v, lengths, 0.3, allowed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("apart", [False, True])
def test_the_reference_reads_jagged_entries_as_padded_ones(apart):
    q, k, v, lengths, allowed = problem(3, 2, 4, 50, apart=apart)
    flat_k, flat_v, flat_a, bases = jagged(k, v, allowed, lengths)
    got = da.reference(q, flat_k, flat_v, lengths, 0.3, flat_a, bases)
    torch.testing.assert_close(got, da.reference(q, k, v, lengths, 0.3, allowed), rtol=1e-6, atol=1e-6)


def test_splits_follow_the_number_of_pairs_alone():
    assert [da.splits_for(p) for p in (1, 8, 32, 64, 512, 4096)] == [64, 64, 16, 16, 16, 16]
    assert all(s & (s - 1) == 0 for s in map(da.splits_for, range(1, 3000)))


@pytest.fixture
def kernel_device():
    """Where the kernel runs: CUDA, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` from the
    process's start: Triton reads it when imported; ``test_the_kernel_tests_pass_in_tritons_interpreter``)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if not da.interpreted():
        pytest.skip("no CUDA: run under TRITON_INTERPRET=1 (the interpreter test does)")
    return "cpu"


def test_the_kernel_tests_pass_in_tritons_interpreter():
    """On a CPU with Triton installed, the kernel's tests below in a process of their own under the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or da.interpreted():
        pytest.skip("the kernel's tests run in this process")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "the_kernel_gives or "
                          "the_kernel_reads", __file__], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    # 12 problems x float32 and float16, and the test past the lengths; bfloat16's 6 skip in the interpreter
    assert run.returncode == 0 and "25 passed, 12 skipped" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("rows, n_kv_heads, group, capacity, d, splits, apart", [
    (3, 2, 4, 200, 16, None, False),   # the default parts, merged
    (2, 2, 4, 50, 16, 1, False),       # one part: the kernel writes the answer
    (2, 2, 2, 130, 16, 4, True),       # per-query-head choices
    (1, 1, 1, 300, 16, 2, False),      # one query head per KV head
    (2, 2, 3, 70, 16, 8, True),        # a group that is no power of two
    (2, 2, 4, 90, 8, 4, False),        # a head dimension padded to tl.dot's 16
])
@pytest.mark.parametrize("layout", ["padded", "jagged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_gives_the_reference(kernel_device, rows, n_kv_heads, group, capacity, d, splits, apart, layout,
                                        dtype):
    """Padded, and jagged (each pair from its own offset, in another order, with gaps), against the padded
    reference."""
    if dtype == torch.bfloat16 and kernel_device == "cpu":
        pytest.skip("Triton's interpreter mishandles bfloat16")
    q, k, v, lengths, allowed = problem(rows, n_kv_heads, group, capacity, d, apart, dtype)
    want = da.reference(q, k, v, lengths, 0.25, allowed)
    bases = None
    if layout == "jagged":
        k, v, allowed, bases = jagged(k, v, allowed, lengths)
    q, k, v, lengths, allowed, bases = (t if t is None else t.to(kernel_device)
                                        for t in (q, k, v, lengths, allowed, bases))
    got = da.decode_attention(q, k, v, lengths, 0.25, allowed, bases, splits).cpu()
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    assert (got[-1, -1] == 0).all()                # the head that holds nothing


def test_the_kernel_reads_nothing_past_a_heads_length(kernel_device):
    """Entries past a head's length (the pool's room, a longer head's padding) may hold anything, inf or nan."""
    q, k, v, lengths, _ = problem(2, 2, 4, 200, dtype=torch.float16)
    lengths = torch.tensor([130, 7, 64, 1])
    want = da.reference(q, k, v, lengths, 0.25)
    for r, h in ((0, 0), (0, 1), (1, 0), (1, 1)):
        n = int(lengths[2 * r + h])
        k[r, h, n:], v[r, h, n:] = float("nan"), float("inf")
    got = da.decode_attention(q.to(kernel_device), k.to(kernel_device), v.to(kernel_device),
                              lengths.to(kernel_device), 0.25, splits=4)
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2e-3, atol=2e-3)


def test_the_attention_is_one_operation_to_the_step_counter():
    """The bench counts an eager step's operations through the dispatcher: the kernel (here its reference) is one,
    whatever it launches inside."""
    from pcs.bench.instrument import StepOps
    q, k, v, lengths, _ = problem(2, 2, 4, 50)
    ops = StepOps()
    with ops.counting():
        da.decode_attention(q, k, v, lengths, 0.25)
    assert ops.ops == 1
