"""``pcs.kernels.value_norms``: where it runs, and (with Triton installed, in Triton's interpreter on this CPU) the
norms it computes; on CUDA, tests/test_gpu.py checks its bits and the kept sets with it."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pcs.kernels.value_norms import available


def test_the_kernel_runs_only_on_cuda_for_power_of_two_head_dimensions(monkeypatch):
    """With Triton importable (a stand-in here, so that the head dimension's rule is what answers)."""
    import types
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert available(torch.device("cuda"), 128) and available(torch.device("cuda"), 16)
    assert not available(torch.device("cpu"), 128)
    assert not available(torch.device("cuda"), 80)      # not a power of two
    assert not available(torch.device("cuda"), 8)       # below tl.dot's smallest inner dimension


def test_the_kernel_computes_every_rows_query_heads_norms_in_the_interpreter():
    """Value rows of 2 KV heads with 3 query heads each, strided weights as ``group_weights`` gives them, a number of
    entries and of outputs that fill no block: every (row, head, entry) norm within float32's rounding of the float64
    norm of the same inputs, in float32 and float16 (the interpreter mishandles bfloat16); rows asking for fewer
    entries than the others get those entries' bits and zeros past them."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from pcs.kernels.value_norms import value_norms
        g = torch.Generator().manual_seed(0)
        rows, group, d, hidden, c = 2, 3, 32, 200, 150
        for dtype in (torch.float32, torch.float16):
            values = torch.randn(rows, c, d, generator=g).to(dtype)
            weights = torch.randn(d, rows, group * hidden, generator=g).to(dtype).transpose(0, 1)
            got = value_norms(values, weights, group)
            want = (values.double() @ weights.double()).view(rows, c, group, hidden).abs().sum(-1).transpose(1, 2)
            assert got.shape == (rows, group, c) and got.dtype == torch.float32
            error = ((got.double() - want).abs() / want).max().item()
            assert error < 1e-5, (dtype, error)
            assert value_norms(values[:, :0], weights, group).shape == (rows, group, 0)
            # rows asking for part of a block and for more than one: those entries' bits, zeros past them
            for sizes in ([5, 150], [0, 70], [64, 65], [128, 129]):
                ragged = value_norms(values, weights, group, torch.tensor(sizes))
                for r, n in enumerate(sizes):
                    assert torch.equal(ragged[r, :, :n], got[r, :, :n]) and not ragged[r, :, n:].any(), (sizes, r)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_selections_kernel_cases_pass_in_tritons_interpreter():
    """The kept-entry tests that run stage 2's norms through the kernel (their ``norms kernel`` cases: every fast path
    against Algorithm 1's definition through ties, and every method and GQA mode against exhaustive scoring under the
    paper's profile), in a process of their own under the interpreter (it must be on before torch imports Triton,
    and this process decodes on the CPU's own path)."""
    pytest.importorskip("triton")
    tests = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "norms and kernel and (algorithm1 or paper)",
                          os.path.join(tests, "test_selection.py"), os.path.join(tests, "test_algorithm1.py")],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
