"""Paired bootstrap intervals against hand-worked cases, a coverage experiment and an independent
bootstrap; unpaired runs are refused, and reports carry the intervals into tables and savings."""
import json

import numpy as np
import pandas as pd
import pytest

from pcs.report.__main__ import main
from pcs.report.significance import UnpairedError, paired, paired_bootstrap

from oracles import needle_metrics, write_run


def test_identical_runs_give_zero_delta_and_a_zero_width_interval():
    got = paired_bootstrap(np.zeros(25), resamples=2000)
    assert (got.delta, got.ci_low, got.ci_high, got.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert not got.excludes_zero


def test_a_constant_shift_is_the_delta_with_a_zero_width_interval():
    got = paired_bootstrap(np.full(40, 2.5), resamples=2000)
    assert got.delta == pytest.approx(2.5, abs=1e-12)
    assert got.ci_low == pytest.approx(2.5, abs=1e-12) and got.ci_high == pytest.approx(2.5, abs=1e-12)
    assert got.p_value == 0.0 and got.excludes_zero


def test_strata_keep_the_benchmarks_weighting():
    """LongBench averages task scores: a task of 10 samples weighs as much as one of 30."""
    d = np.array([1.0] * 30 + [4.0] * 10)
    strata = [np.arange(30), np.arange(30, 40)]
    got = paired_bootstrap(d, strata, resamples=500)
    assert got.delta == pytest.approx((1.0 + 4.0) / 2)                   # not the sample mean, 1.75
    assert got.ci_low == pytest.approx(2.5) and got.ci_high == pytest.approx(2.5)   # no variation within tasks
    assert got.n == 40


def test_a_domain_counts_its_own_samples_and_a_stratum_too_small_gives_no_interval():
    """n is the samples of the strata asked for, not of the run; with a stratum under MIN_STRATUM the replicates
    cannot vary as the samples would (one sample, or two equal, never do), so no interval and no p-value."""
    from pcs.report.significance import MIN_STRATUM
    rng = np.random.default_rng(0)
    d = rng.normal(0.0, 1.0, size=60)
    part = paired_bootstrap(d, [np.arange(20), np.arange(20, 35)], resamples=200)
    assert part.n == 35 and not np.isnan(part.ci_low)
    small = paired_bootstrap(d, [np.arange(20), np.arange(20, 20 + MIN_STRATUM - 1)], resamples=200)
    assert small.n == 20 + MIN_STRATUM - 1
    assert small.delta == pytest.approx((d[:20].mean() + d[20:20 + MIN_STRATUM - 1].mean()) / 2)
    assert np.isnan(small.ci_low) and np.isnan(small.ci_high) and np.isnan(small.p_value)


def test_the_interval_covers_the_true_mean_at_close_to_the_nominal_rate():
    """300 synthetic paired samples of 40 differences ~ N(0.7, 2^2): the percentile bootstrap's 95 %
    interval should cover 0.7 about 93-95 % of the time at this n; we accept 90 % to 98.5 % (the
    binomial standard error over 300 trials is 1.3 points)."""
    rng = np.random.default_rng(123)
    covered = 0
    for seed in range(300):
        d = rng.normal(0.7, 2.0, size=40)
        got = paired_bootstrap(d, resamples=1000, seed=seed)
        covered += got.ci_low <= 0.7 <= got.ci_high
    assert 0.90 <= covered / 300 <= 0.985


def test_unpaired_samples_are_refused():
    a = pd.DataFrame({"id": ["x", "y", "z"], "score": [1.0, 2.0, 3.0], "stratum": ""})
    b = pd.DataFrame({"id": ["x", "y", "w"], "score": [1.0, 2.0, 3.0], "stratum": ""})
    with pytest.raises(UnpairedError, match="2 ids"):
        paired([a, b])
    twice = pd.DataFrame({"id": ["x", "x", "y"], "score": [1.0, 2.0, 3.0], "stratum": ""})
    with pytest.raises(UnpairedError):
        paired([a, twice])


def write_predictions(folder, scores, tasks=None):
    lines = [{"id": f"s{i}", "score": s, **({"task": tasks[i]} if tasks else {})} for i, s in enumerate(scores)]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def independent_bootstrap(d, resamples, seed):
    """A plain loop: resample the differences with replacement, take the mean, read the percentiles."""
    rng = np.random.default_rng(seed)
    means = [rng.choice(d, size=len(d), replace=True).mean() for _ in range(resamples)]
    return np.percentile(means, [2.5, 97.5])


def test_report_pairs_two_needle_runs_and_matches_an_independent_bootstrap(tmp_path):
    rng = np.random.default_rng(0)
    attention = rng.uniform(0, 100, 15).round(2)
    perturbation = np.clip(attention + rng.normal(8, 10, 15), 0, 100).round(2)
    root = tmp_path / "results"
    for selection, scores in (("attention", attention), ("perturbation", perturbation)):
        folder = write_run(root, "method=snapkv", f"selection={selection}", "budget=64",
                           metrics=needle_metrics(float(np.mean(scores))))
        write_predictions(folder, scores)
    unpaired = write_run(root, "method=adakv", "selection=attention", "budget=64", metrics=needle_metrics(1.0))
    write_predictions(unpaired, attention)
    other = write_run(root, "method=adakv", "selection=perturbation", "budget=64", metrics=needle_metrics(1.0))
    write_predictions(other, perturbation[:10])
    assert main(["--results", str(root), "--out", str(tmp_path / "report")]) == 0
    table = pd.read_csv(tmp_path / "report" / "significance.csv")
    row = table[table.method == "snapkv"].iloc[0]
    d = perturbation - attention
    assert row.n == 15 and row.domain == "average" and row.selection == "perturbation"
    assert row.delta == pytest.approx(d.mean(), abs=1e-9)
    low, high = independent_bootstrap(d, 10_000, seed=99)
    width = high - low
    assert abs(row.ci_low - low) < 0.05 * width and abs(row.ci_high - high) < 0.05 * width
    refused = table[table.method == "adakv"].iloc[0]
    assert "do not score the same samples" in refused.note and pd.isna(refused.delta)


def test_tables_mark_significant_cells_and_savings_get_intervals(tmp_path):
    """Constant per-sample scores make every interval a point: attention 40 at b64 and 60 at b128,
    perturbation 50 at b64, so the equivalent budget is 96 (saving 33.3 %) in every resample."""
    root = tmp_path / "results"
    lb = ["benchmark=longbench", "model=llama31", "method=snapkv"]
    tasks = ["qasper"] * 10 + ["trec"] * 10     # MIN_STRATUM samples per task: intervals are computed
    for selection, budget, score in (("attention", 64, 40.0), ("attention", 128, 60.0), ("perturbation", 64, 50.0),
                                     ("perturbation", 128, 60.0)):
        domains = {"single_doc_qa": score, "few_shot": score}
        folder = write_run(root, *lb, f"selection={selection}", f"budget={budget}",
                           metrics={"score": score, "domains": domains})
        write_predictions(folder, [score] * 20, tasks)
    assert main(["--results", str(root), "--out", str(tmp_path / "report"), "--resamples", "300"]) == 0
    table = (tmp_path / "report" / "tables" / "longbench_snapkv.md").read_text()
    assert "| Average | 40.00 | **50.00**\\* | **60.00** | **60.00** |" in table   # b64 differs, b128 does not
    tested = pd.read_csv(tmp_path / "report" / "significance.csv")
    assert set(tested.domain) == {"average", "single_doc_qa", "few_shot"}
    saved = pd.read_csv(tmp_path / "report" / "savings.csv").set_index("budget")
    assert saved.loc[64, "equivalent_budget"] == 96.0
    assert saved.loc[64, "equivalent_budget_ci_low"] == 96.0 and saved.loc[64, "equivalent_budget_ci_high"] == 96.0
    assert saved.loc[64, "savings_pct_ci_low"] == pytest.approx(33.3) and saved.loc[64, "resamples_in_range"] == 300


def test_a_saving_interval_reaching_past_the_measured_budgets_says_so(tmp_path):
    """Attention 40 at b64 and 60 at b128; perturbation at b64 scores 30 and 50 on alternate samples (mean 40, the
    curve's lowest point): about half the resamples fall below the measured range. They count, so the lower
    bound lies below it (written "< "), not within it as an interval over the other half would say; the upper
    bound is inside. Perturbation 30 at b128 lies below in every resample: both bounds are cut there."""
    root = tmp_path / "results"
    lb = ["benchmark=longbench", "model=llama31", "method=snapkv"]
    tasks = ["qasper"] * 10 + ["trec"] * 10
    for selection, budget, scores in (("attention", 64, [40.0] * 20), ("attention", 128, [60.0] * 20),
                                      ("perturbation", 64, [30.0, 50.0] * 10), ("perturbation", 128, [30.0] * 20)):
        mean = sum(scores) / len(scores)
        folder = write_run(root, *lb, f"selection={selection}", f"budget={budget}",
                           metrics={"score": mean, "domains": {"single_doc_qa": mean, "few_shot": mean}})
        write_predictions(folder, scores, tasks)
    assert main(["--results", str(root), "--out", str(tmp_path / "report"), "--resamples", "400"]) == 0
    saved = pd.read_csv(tmp_path / "report" / "savings.csv", keep_default_na=False).set_index("budget")
    edge = saved.loc[64]
    assert float(edge.equivalent_budget) == 64.0 and edge.ci_low_beyond == "below" and edge.ci_high_beyond == ""
    assert float(edge.equivalent_budget_ci_low) == 64.0 and 64.0 < float(edge.equivalent_budget_ci_high) < 128.0
    assert 120 < int(edge.resamples_in_range) < 280
    below = saved.loc[128]
    assert (below.ci_low_beyond, below.ci_high_beyond, int(below.resamples_in_range)) == ("below", "below", 0)
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"| [< 0.0, {float(edge.savings_pct_ci_high):.1f}] % |" in report
    assert "| [< -100.0, < -100.0] % |" in report


def test_a_comparison_asked_again_is_the_same_interval_and_a_mask_stratum_reads_as_its_rows():
    """The report asks for one comparison from several tables: the second answer is the first (drawn once), and
    strata given as boolean masks select the rows their indices select."""
    from pcs.report.significance import _bootstrap, paired_bootstrap
    rng = np.random.default_rng(3)
    d = rng.normal(1.0, 2.0, 60)
    rows = [np.arange(0, 30), np.arange(30, 60)]
    masks = [np.arange(60) < 30, np.arange(60) >= 30]
    before = _bootstrap.cache_info().hits
    first = paired_bootstrap(d, rows, resamples=500)
    assert paired_bootstrap(d.copy(), [r.copy() for r in rows], resamples=500) == first
    assert _bootstrap.cache_info().hits == before + 1
    assert paired_bootstrap(d, masks, resamples=500) == first
    assert paired_bootstrap(d, rows, resamples=500, seed=1) != first
