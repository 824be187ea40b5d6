"""End to end on the real embedded SmolLM2-135M-Instruct (loads real weights)."""
import json

import pytest

from pcs.identity import RunIdentity
from pcs.runner import run

from conftest import compose_cfg

pytestmark = pytest.mark.embedded


def test_full_cache_finds_the_needle_at_1000_tokens(embedded_dir, tmp_path):
    cfg = compose_cfg("method=full", f"results_dir={tmp_path}", "progress=false",
                      "benchmark.context_lengths=[1000]", "benchmark.depth_percents=[50]")
    metrics = run(cfg)
    row = json.loads((tmp_path / RunIdentity(cfg).folder / "predictions.jsonl").read_text())
    assert "dolores park" in row["prediction"].lower()
    assert metrics["score"] >= 80


def test_compressed_run_keeps_budget_over_prompt_of_the_cache(embedded_dir, tmp_path):
    cfg = compose_cfg("method=adakv", "budget=64", f"results_dir={tmp_path}", "progress=false",
                      "benchmark.context_lengths=[1000]", "benchmark.depth_percents=[100]",
                      "benchmark.max_new_tokens=24")
    run(cfg)
    row = json.loads((tmp_path / RunIdentity(cfg).folder / "predictions.jsonl").read_text())
    assert row["kv_cache_bytes"] / row["kv_cache_bytes_full"] == pytest.approx(64 / row["prompt_tokens"], rel=0.02)
    assert row["new_tokens"] > 0 and row["prediction"].strip()
