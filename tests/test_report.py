"""Reports: interpolation against hand-worked cases and the paper's own Figure 1 numbers, tables and
plots from a synthetic results folder written here."""
import json

import pandas as pd
import pytest

from pcs.identity import RunIdentity
from pcs.report.__main__ import main
from pcs.report.document import build
from pcs.report.collect import collect, paper_tables
from pcs.report.savings import ABOVE, BELOW, equivalent_budget, savings

from conftest import compose_cfg
from oracles import needle_metrics, write_run

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("budgets,scores,target,expected", [
    ([128, 256], [40.0, 44.0], 42.0, (192.0, "")),              # halfway
    ([128, 256], [40.0, 44.0], 44.0, (256.0, "")),              # on a measured point
    ([256, 128], [44.0, 40.0], 41.0, (160.0, "")),              # order of the input does not matter
    ([128, 256], [40.0, 44.0], 45.0, (None, ABOVE)),            # no extrapolation
    ([128, 256], [40.0, 44.0], 39.0, (None, BELOW)),
    ([64, 128, 256], [40.0, 46.0, 44.0], 45.0, (64 + 5 / 6 * 64, "")),   # non-monotone: first crossing
    ([64, 128, 256], [40.0, 46.0, 44.0], 44.0, (64 + 4 / 6 * 64, "")),
])
def test_equivalent_budget(budgets, scores, target, expected):
    value, note = equivalent_budget(budgets, scores, target)
    assert note == expected[1]
    assert value == pytest.approx(expected[0]) if expected[0] is not None else value is None


def test_paper_numbers_give_the_papers_figure_1_savings():
    saved = savings(paper_tables())
    llama_snapkv = saved[(saved.model == "llama31") & (saved.method == "snapkv")].set_index("budget")
    assert llama_snapkv.loc[[128, 256, 512], "savings_pct"].tolist() == [18.7, 23.0, 27.5]
    assert llama_snapkv.loc[1024, "note"] == ABOVE
    six = saved[(saved.budget == 512) & saved.model.isin(["llama31", "mistral7b"])]
    assert len(six) == 6
    assert (six.savings_pct.min(), six.savings_pct.max()) == (21.1, 34.0)


def longbench_metrics(average):
    domains = {"single_doc_qa": average + 1, "multi_doc_qa": average - 1, "summarization": average,
               "few_shot": average + 2, "synthetic": average - 2, "code": average}
    return {"score": average, "domains": domains}


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    lb = ["benchmark=longbench", "model=llama31"]
    write_run(root, *lb, "method=full", metrics=longbench_metrics(49.0))
    for budget, att, pert in ((128, 42.0, 43.0), (256, 45.0, 45.5), (512, 47.0, 47.5)):
        write_run(root, *lb, "method=snapkv", "selection=attention", f"budget={budget}", metrics=longbench_metrics(att))
        write_run(root, *lb, "method=snapkv", "selection=perturbation", f"budget={budget}",
                  metrics=longbench_metrics(pert))
    write_run(root, "method=full", metrics=needle_metrics(90.0))
    for method in ("snapkv", "adakv"):
        for selection, score in (("attention", 50.0), ("perturbation", 60.0)):
            write_run(root, f"method={method}", f"selection={selection}", "budget=64", metrics=needle_metrics(score))
    write_run(root, "method=laprox", "budget=64", metrics=needle_metrics(70.0))
    pert = write_run(root, "benchmark=perturbation", "budget=128", metrics={
        "score": 90.0, "heads_improved": 9, "n_heads": 10, "mean_relative_reduction": 0.2, "assumption1_frac": 0.7})
    (pert / "layerwise.png").write_bytes(PNG + b"stub")
    return root


def test_report_from_a_results_folder(results, tmp_path):
    out = tmp_path / "report"
    assert main(["--results", str(results), "--out", str(out)]) == 0
    table = (out / "tables" / "longbench_snapkv.md").read_text()
    assert "| Average | 49.00 | 42.00 | **43.00** | 45.00 | **45.50** | 47.00 | **47.50** |" in table
    assert "| Single-Doc QA | 50.00 |" in table
    assert r"\toprule" in (out / "tables" / "longbench_snapkv.tex").read_text()
    wide = pd.read_csv(out / "tables" / "longbench_snapkv.csv")
    assert list(wide.columns[:5]) == ["model", "domain", "full", "b128_attention", "b128_perturbation"]
    needle = (out / "tables" / "needle_snapkv.md").read_text()
    assert "| Average | 90.00 | 50.00 | **60.00** |" in needle
    saved = pd.read_csv(out / "savings.csv")
    assert list(saved.columns[:6]) == ["model", "method", "budget", "score", "equivalent_budget", "savings_pct"]
    row = saved[(saved.method == "snapkv") & (saved.table == "longbench_snapkv") & (saved.budget == 128)].iloc[0]
    assert row.equivalent_budget == pytest.approx(128 + 1 / 3 * 128, abs=0.05)    # 43 on the 42 -> 45 segment
    for png in ["savings.png", "needle/smollm2_grid_b64.png", "needle/smollm2__snapkv_attention_b64.png",
                "perturbation/smollm2__snapkv_b128/layerwise.png"]:
        assert (out / png).read_bytes()[:8] == PNG, png
    side_by_side = (out / "tables" / "methods_needle_smollm2.md").read_text()
    for line in ("| adakv | - | w/o | 90.00 | 50.00 |", "| adakv | - | w/ | 90.00 | 60.00 |",
                 "| laprox | - | - | 90.00 | **70.00** |", "| snapkv | - | w/ | 90.00 | 60.00 |"):
        assert line in side_by_side
    report = (out / "report.md").read_text()
    assert "## Budget savings" in report and "## Needle-in-a-Haystack" in report and "9 / 10" in report


def test_conventions_and_knob_readings_keep_rows_of_their_own(tmp_path):
    """Runs of one method and setting under other conventions, or with a selection knob changed, are other
    configurations: each keeps its own row in the side-by-side table (never merged into the default's), the
    paper-shaped table holds the paper's selections only, and a table of one cell is linked, not inlined."""
    root = tmp_path / "results"
    runs = {("method=full",): 90.0, ("method=snapkv", "selection=attention", "budget=64"): 50.0,
            ("method=snapkv", "selection=perturbation", "budget=64"): 40.0,
            ("method=snapkv", "selection=perturbation", "selection.alpha=0.5", "budget=64"): 55.0,
            ("method=snapkv", "selection=attention", "budget=64", "profile=kvpress"): 20.0}
    for overrides, score in runs.items():
        folder = write_run(root, *overrides, metrics=needle_metrics(score))
        right = round(score / 5)    # of 20 samples (the knob ablation's section pairs them)
        (folder / "predictions.jsonl").write_text("".join(
            json.dumps({"id": str(i), "stratum": "grid", "score": 100.0 if i < right else 0.0}) + "\n"
            for i in range(20)))
    out = tmp_path / "report"
    build(root, out, resamples=200)
    side_by_side = (out / "tables" / "methods_needle_smollm2.md").read_text()
    rows = [line for line in side_by_side.splitlines() if line.startswith("| snapkv")]
    kvpress = RunIdentity(compose_cfg("method=snapkv", "budget=64", "profile=kvpress")).method_knobs
    assert rows == ["| snapkv | - | w/o | 90.00 | 50.00 |", "| snapkv | - | w/ | 90.00 | 40.00 |",
                    "| snapkv | - | perturbation_alpha=0.5 | 90.00 | **55.00** |",
                    f"| snapkv | {'_'.join(kvpress)} | w/o | 90.00 | 20.00 |"]
    paper_shaped = (out / "tables" / "needle_snapkv.md").read_text()
    assert "| Average | 90.00 | **50.00** | 40.00 |" in paper_shaped and "alpha" not in paper_shaped
    report = (out / "report.md").read_text()
    assert "## needle_snapkv\n" in report and "## needle_snapkv_" + "_".join(kvpress) in report   # full + one cell
    # a setting without the full cache: its one run's table is one cell
    write_run(root, "method=snapkv", "selection=attention", "budget=64", "benchmark.context_lengths=[1000]",
              metrics=needle_metrics(30.0))
    build(root, out, resamples=200)
    report = (out / "report.md").read_text()
    alone = "needle_snapkv_context_lengths=1000"
    assert f"\n- [{alone}](tables/{alone}.md)\n" in report and f"## {alone}" not in report   # one link a line


def test_paper_values_stand_beside_measured_cells(results, tmp_path):
    build(results, tmp_path / "report", with_paper=True)
    table = (tmp_path / "report" / "tables" / "longbench_snapkv.md").read_text()
    # Paper, Table 1, Llama-3.1-8B, SnapKV: full 49.20, b128 w/o 42.70 and w/ 43.25 on average.
    assert "| Average | 49.00 (49.20, -0.20) | 42.00 (42.70, -0.70) | **43.00** (43.25, -0.25) |" in table


def test_collect_reads_the_tidy_csv():
    df = collect(paper_tables_path())
    assert set(df.table) == {"table1", "table2", "table3", "table5", "table6", "table8"}
    assert {"attention", "perturbation", "perturbation_alpha0", "none"} == set(df.selection)


def paper_tables_path():
    from importlib import resources
    return resources.files("pcs") / "data" / "paper_longbench_tables.csv"


def test_ruler_tables_by_group_and_length_with_stars_and_a_length_plot(tmp_path):
    """Three runs of one RULER setting (full, attention, perturbation at one budget) at two lengths: the table's
    rows are each group and the mean per length, worked out by hand here; a difference that every sample shows
    gets its star; the score-vs-length figure is drawn."""
    from pcs.benchmarks.base import build_benchmark
    from pcs.report.significance import significance
    root = tmp_path / "results"
    common = ["benchmark=ruler", "benchmark.tasks=[niah_single_1,vt,cwe]", "benchmark.lengths=[1024,2048]",
              "benchmark.n_samples=20"]
    # per (task, length): the number of 20 samples answered right (100) by each run, the rest 0
    right = {"full": {1024: (20, 20, 20), 2048: (20, 18, 16)},
             "attention": {1024: (10, 4, 20), 2048: (0, 0, 10)},
             "perturbation": {1024: (14, 4, 20), 2048: (20, 10, 10)}}
    runs = {}
    for name, counts in right.items():
        overrides = ["method=full"] if name == "full" else ["method=snapkv", f"selection={name}", "budget=64"]
        cfg = compose_cfg(*common, *overrides)
        rows = [{"id": f"{task}_{length}_{i}", "task": task, "length": length, "stratum": f"{task}_{length}",
                 "score": 100.0 if i < n else 0.0}
                for length, per_task in counts.items() for task, n in zip(["niah_single_1", "vt", "cwe"], per_task)
                for i in range(20)]
        folder = write_run(root, *common, *overrides, metrics=build_benchmark(cfg).metrics(rows))
        (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = folder
    out = tmp_path / "report"
    build(root, out, resamples=2000)
    table = (out / "tables" / "ruler_snapkv_lengths=1024+2048_n_samples=20_tasks=niah_single_1+vt+cwe.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| ") and "Domain" not in line]
    assert [line.split(" | ")[0][2:] for line in lines] == [
        "retrieval_1024", "multi_hop_tracing_1024", "aggregation_1024", "mean_1024",
        "retrieval_2048", "multi_hop_tracing_2048", "aggregation_2048", "mean_2048", "Average"]
    # retrieval 2048: niah_single_1 20/20, 0/20, 20/20; mean 2048: (100+90+80)/3, (0+0+50)/3, (100+50+50)/3
    assert lines[4] == "| retrieval_2048 | 100.00 | 0.00 | **100.00**\\* |"
    assert lines[7] == "| mean_2048 | 90.00 | 16.67 | **66.67**\\* |"
    assert lines[1] == "| multi_hop_tracing_1024 | 100.00 | **20.00** | **20.00** |"     # equal: no star
    tested = significance([runs["attention"], runs["perturbation"]], resamples=2000).set_index("domain")
    assert tested.loc["mean_2048", "delta"] == pytest.approx(50.0)
    assert tested.loc["mean_1024", "delta"] == pytest.approx(20 / 3)
    assert tested.loc["average", "delta"] == pytest.approx((20 / 3 + 50) / 2)
    assert tested.loc["multi_hop_tracing_1024", "delta"] == 0.0
    assert (out / "ruler" / "smollm2_lengths=1024+2048_n_samples=20_tasks=niah_single_1+vt+cwe.png").read_bytes()[:8] == PNG
    assert "## RULER" in (out / "report.md").read_text()
    # the figures' intervals: each run's mean per length with a within-task bootstrap interval around it
    from pcs.plots.ruler import ruler_figure
    from pcs.report.ruler import length_deltas, score_intervals
    scores = score_intervals(list(runs.values()), resamples=500).set_index(["selection", "length"])
    assert scores.loc[("none", 2048), "score"] == pytest.approx(90.0)
    assert scores.loc[("attention", 2048), "score"] == pytest.approx(50 / 3)
    assert scores.loc[("perturbation", 1024), "score"] == pytest.approx((70 + 20 + 100) / 3)
    assert (scores["ci_low"] <= scores["score"]).all() and (scores["score"] <= scores["ci_high"]).all()
    assert scores.loc[("attention", 1024), "ci_low"] < scores.loc[("attention", 1024), "ci_high"]
    deltas = length_deltas(tested.reset_index())
    assert deltas.set_index("length").loc[2048, "delta"] == pytest.approx(50.0)
    one_length = score_intervals(list(runs.values()), resamples=500)
    one_length = one_length[one_length["length"] == 2048]
    assert ruler_figure(one_length, deltas, tmp_path / "bars.png", "one length").read_bytes()[:8] == PNG


def test_figures_name_a_setting_by_its_knobs_never_breaking_one(tmp_path):
    """A setting's knobs come from the run's identity (its joined string cannot be split back: keys and values
    hold underscores), the question's place in words; lines break only between knobs."""
    from pcs.plots.labels import setting_knobs, wrapped
    folder = write_run(tmp_path, "benchmark=ruler", "benchmark.lengths=[2048]", "benchmark.query_aware=false",
                       "benchmark.tasks=[niah_single_1,niah_single_2]", "benchmark.n_samples=[200,300]",
                       metrics={"score": 1.0})
    knobs = setting_knobs(folder)
    assert "question after compression" in knobs and "n_samples=200+300" in knobs
    assert "tasks=niah_single_1+niah_single_2" in knobs
    lines = wrapped(knobs, 20).split("\n")
    assert len(lines) > 1 and " ".join(lines) == ", ".join(knobs)
    assert all(piece in knobs for line in lines for piece in line.rstrip(",").split(", "))   # whole knobs only


def test_a_cell_run_in_two_folders_is_reported_once_and_the_report_says_which(results, tmp_path):
    """A run of the default beside a copy of the results in a folder of their own (``make run`` next to the
    committed reference runs): the report uses one run per cell (the one that finished last at equal samples),
    counts it once in every table, and names the one it left out."""
    import shutil
    mine = results / "embedded"
    for run in ("needle/smollm2/full", "needle/smollm2/snapkv_attention_b64", "needle/smollm2/snapkv_perturbation_b64"):
        shutil.copytree(results / run, mine / run)
    newer = mine / "needle/smollm2/snapkv_perturbation_b64"
    (newer / "metrics.json").write_text(json.dumps({**needle_metrics(80.0), "n_samples": 1,
                                                    "ended_at": "2030-01-01T00:00:00"}))
    out = tmp_path / "report"
    assert main(["--results", str(results), "--out", str(out), "--resamples", "50"]) == 0
    assert "| Average | 90.00 | 50.00 | **80.00** |" in (out / "tables" / "needle_snapkv.md").read_text()
    report = (out / "report.md").read_text()
    assert "| embedded/needle/smollm2/snapkv_perturbation_b64 | needle/smollm2/snapkv_perturbation_b64 |" in report
    assert "| embedded/needle/smollm2/full | needle/smollm2/full |" in report   # equal: the first in path order
