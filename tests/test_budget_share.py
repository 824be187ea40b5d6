"""budget as a share of each prompt: int(share x n) entries per KV head for a prompt of n tokens, its own run folder
and report table, refused where an absolute budget is needed."""
import json
from pathlib import Path

import pytest

from pcs.budget import entries, from_text, is_share
from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.identity import RunIdentity
from pcs.runner import run

from conftest import compose_cfg


def test_a_share_is_that_part_of_each_prompt_and_never_less_than_the_window():
    assert [entries(0.25, n, 8) for n in (40, 200, 301, 1000)] == [10, 50, 75, 250]
    assert entries(0.25, 20, 8) == 8 and entries(128, 5000) == 128
    assert is_share(0.5) and not is_share(128)


def test_a_command_line_budget_is_an_integer_or_a_share_and_pcs_bench_reads_both():
    from pcs.bench.__main__ import parse
    assert from_text("128") == 128 and isinstance(from_text("128"), int) and from_text("0.25") == 0.25
    for bad in ("1.5", "0", "x"):
        with pytest.raises(ConfigError):
            from_text(bad)
    assert parse(["--budgets", "0.25", "512"]).budgets == [0.25, 512]
    with pytest.raises(SystemExit):
        parse(["--budgets", "1.5"])


@pytest.mark.parametrize("bad", ["budget=1.5", "budget=0.0", "budget=-2", "budget=0.25 compress.trigger=512"])
def test_budgets_that_mean_nothing_are_refused_before_the_model_loads(bad):
    with pytest.raises(ConfigError):
        validate(compose_cfg(*bad.split()))


BENCHMARKS = {
    "needle": ["benchmark=needle", "benchmark.context_lengths=[200,300,400]", "benchmark.depth_percents=[50]",
               "benchmark.max_new_tokens=2"],
    # RULER's essay haystacks fill its prompts unevenly: each task's prompts differ in length at one nominal length.
    "ruler": ["benchmark=ruler", "benchmark.lengths=[1024]", "benchmark.tasks=[niah_single_1,vt,fwe]",
              "benchmark.n_samples=1"],
}


@pytest.mark.parametrize("benchmark", sorted(BENCHMARKS))
def test_each_prompt_is_compressed_to_its_share(tiny_model_dir, tmp_path, benchmark):
    """budget=0.25: every layer and KV head of the (tiny Llama) cache holds int(0.25 n) entries, n the tokens of
    that prompt, whatever the prompt; the run has its own folder and report table."""
    cfg = compose_cfg(f"model.path={tiny_model_dir}", f"results_dir={tmp_path}", "progress=false",
                      *BENCHMARKS[benchmark], "method=snapkv", "method.window=8", "budget=0.25")
    run(cfg)
    identity = RunIdentity(cfg)
    assert "/snapkv_perturbation_b0.25_" in identity.folder and "share" in identity.table
    assert "share" not in RunIdentity(compose_cfg("method=snapkv", "budget=128")).table
    rows = [json.loads(line) for line in (Path(tmp_path) / identity.folder / "predictions.jsonl").read_text().splitlines()]
    per_entry = 4 * 2 * 2 * 8 * 4        # layers x KV heads x (key, value) x head dim x float32
    assert len({r["prompt_tokens"] for r in rows}) >= 3
    for r in rows:   # bytes held right after compression (the whole prompt is compressed: query-aware)
        assert r["kv_cache_bytes"] == int(0.25 * r["prompt_tokens"]) * per_entry, r
