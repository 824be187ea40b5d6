"""The knob ablation's readings (conf/ablation/) and experiments: each reading composes the selection it names,
single knobs carry the released code's values, and the ablation's baselines are the reference runs."""
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pcs.config import compose
from pcs.identity import RunIdentity

from conftest import CONF

READINGS = sorted(p.stem for p in (Path(CONF) / "ablation").glob("*.yaml"))
SINGLE_KNOBS = ["alpha", "stage2_source", "epsilon", "gqa"]
# Readings of experiment=ruler_ablation_question_after_epsilon alone: epsilon with each other released knob, and
# stage 2 by the value norm alone. The full ablations run every other reading.
EPSILON_PAIRS = [f"epsilon_{knob}" for knob in SINGLE_KNOBS if knob != "epsilon"]
FOLLOW_UP = [*EPSILON_PAIRS, "value_norm"]
ABLATION_READINGS = sorted(set(READINGS) - set(FOLLOW_UP))


def selection_file(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(Path(CONF) / "selection" / f"{name}.yaml"))


# The perturbation selection's knobs, as its file declares them.
SELECTION_KNOBS = [k for k in selection_file("perturbation") if k != "name" and not k.startswith("_")]


def selection_of(*overrides) -> dict:
    cfg = compose(list(overrides))
    return {k: cfg.selection[k] for k in ["name", *SELECTION_KNOBS] if k in cfg.selection}


def released() -> dict:
    return selection_file("perturbation_released")


def test_the_readings_are_the_documented_ones():
    assert READINGS == sorted(["full", "attention", "paper", *SINGLE_KNOBS, "released_knobs", "kvpress_attention",
                               "kvpress_paper", "criticalkv", *FOLLOW_UP])
    table = (Path(CONF) / "ablation" / "README.md").read_text()
    assert all(f"| `{reading}` |" in table for reading in READINGS)


@pytest.mark.parametrize("knob", SINGLE_KNOBS)
def test_a_single_knob_reading_moves_that_knob_alone_to_the_released_value(knob):
    paper, reading = selection_of("ablation=paper"), selection_of(f"ablation={knob}")
    assert paper == selection_of()          # the paper's reading is the default selection
    assert reading[knob] == released()[knob] != paper[knob]
    assert {k: v for k, v in reading.items() if k != knob} == {k: v for k, v in paper.items() if k != knob}
    # and under the paper's conventions
    assert compose([f"ablation={knob}"]).profile == compose([]).profile


@pytest.mark.parametrize("knob", [k for k in SINGLE_KNOBS if k != "epsilon"])
def test_an_epsilon_pair_is_the_epsilon_reading_with_one_more_released_knob(knob):
    epsilon, pair = selection_of("ablation=epsilon"), selection_of(f"ablation=epsilon_{knob}")
    assert pair == {**epsilon, knob: released()[knob]} != epsilon
    assert compose([f"ablation=epsilon_{knob}"]).profile == compose([]).profile


def test_the_value_norm_reading_ranks_stage_2_by_the_projected_value_norm_alone():
    """ablation=value_norm keeps stage 1's entries and then the entries with the largest group mean of
    ``||v W^O_h||_1``, computed here head by head from the weight (brute force), whatever the window attends to."""
    import torch
    from pcs.eviction import build_method
    from pcs.eviction.base import LayerState
    cfg = compose(["ablation=value_norm", "method=snapkv", "budget=96"])
    assert selection_of("ablation=value_norm") == {**selection_of("ablation=paper"), "epsilon": 1.0e6}
    method = build_method(cfg)
    g = torch.Generator().manual_seed(3)
    h_q, h_kv, n, d, hidden = 6, 2, 300, 16, 40
    for trial in range(3):
        keys, values = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
        queries = torch.randn(h_q, method.window, d, generator=g) * (0.5 + trial)
        weight = torch.randn(hidden, h_q * d, generator=g)
        layer = LayerState(0, 1, keys, values, queries, weight)
        kept, firsts = method.keep(layer), method.stage1(layer)
        prefix = n - method.window
        for h in range(h_kv):
            heads = range(h * (h_q // h_kv), (h + 1) * (h_q // h_kv))
            norms = torch.stack([(values[h, :prefix] @ weight[:, q * d:(q + 1) * d].T).abs().sum(-1) for q in heads])
            mean = norms.mean(0)
            mean[firsts[h]] = float("-inf")
            chosen = kept[h][kept[h] < prefix]
            rest = chosen.numel() - firsts[h].numel()
            expected = torch.cat([firsts[h], mean.topk(rest).indices]).sort().values
            assert torch.equal(chosen, expected)


def test_every_knob_where_the_released_code_differs_has_its_own_reading():
    paper = selection_of()
    differing = {k for k in SELECTION_KNOBS if released()[k] != paper[k]}
    assert differing == set(SINGLE_KNOBS)


def test_whole_readings_compose_what_the_options_they_name_compose():
    same = [("ablation=attention", "selection=attention"),
            ("ablation=released_knobs", "selection=perturbation_released"),
            ("ablation=criticalkv", "preset=criticalkv"),
            ("ablation=kvpress_attention", "preset=criticalkv", "selection=attention"),
            ("ablation=kvpress_paper", "preset=criticalkv", "selection=perturbation")]
    for reading, *options in same:
        for method in ("snapkv", "adakv"):
            a, b = compose([reading, f"method={method}"]), compose([*options, f"method={method}"])
            assert RunIdentity(a).saved_data() == RunIdentity(b).saved_data(), reading
    # the released code's conventions really change (not the paper's under another name)
    assert compose(["ablation=kvpress_paper"]).profile.name == "kvpress"
    assert compose(["ablation=kvpress_paper"]).method.window == 64


@pytest.mark.parametrize("ablation, reference", [("ruler_ablation", "ruler_embedded"),
                                                 ("ruler_ablation_question_after", "ruler_embedded_question_after")])
def test_the_ablations_baselines_are_the_reference_runs(ablation, reference):
    """The attention and paper readings land in the reference runs' folders (their answers are reused), and
    every other reading pairs with an attention run of its own conventions."""
    from oracles import hydra_cfg
    params = hydra_cfg(f"experiment={ablation}").hydra.sweeper.params
    ref_params = hydra_cfg(f"experiment={reference}").hydra.sweeper.params
    assert str(params.budget) == str(ref_params.budget)
    readings = str(params.ablation).split(",")
    assert sorted(readings) == [r for r in ABLATION_READINGS if r != "full"]   # the full cache: the reference runs'
    for method in str(params.method).split(","):
        for budget in str(params.budget).split(","):
            runs = {r: RunIdentity(compose([f"experiment={ablation}", f"method={method}", f"budget={budget}",
                                             f"ablation={r}"])) for r in readings}
            for reading, selection in (("attention", "attention"), ("paper", "perturbation")):
                ref = RunIdentity(compose([f"experiment={reference}", f"method={method}", f"budget={budget}",
                                           f"selection={selection}"]))
                assert runs[reading].folder == ref.folder
            assert len({run.folder for run in runs.values()}) == len(readings)
            baselines = {run.pairing_key for r, run in runs.items() if run.selection_label == "attention"}
            assert len(baselines) == 2      # the paper's conventions and the released code's
            assert all(run.pairing_key in baselines for run in runs.values())


def test_the_gemma_ablation_runs_every_reading_and_the_full_cache_on_one_prefill_per_sample():
    """experiment=ruler_ablation_gemma: the full cache and the ten readings of SnapKV, one group (one job, each
    sample prefilled once), answers stopped once scored, every reading paired with an attention run of its
    conventions."""
    from pcs.sweep import plan
    from oracles import hydra_cfg
    params = hydra_cfg("experiment=ruler_ablation_gemma").hydra.sweeper.params
    readings = str(params.ablation).split(",")
    assert sorted(readings) == ABLATION_READINGS
    cfgs = [compose(["experiment=ruler_ablation_gemma", f"ablation={r}", f"budget={params.budget}"]) for r in readings]
    runs = {r: RunIdentity(cfg) for r, cfg in zip(readings, cfgs)}
    assert runs["full"].cfg.method.name == "full" and not runs["full"].reads_budget
    assert {run.cfg.method.name for r, run in runs.items() if r != "full"} == {"snapkv"}
    assert len({run.folder for run in runs.values()}) == len(readings)
    assert plan(cfgs) == [list(range(len(cfgs)))]
    assert all(cfg.engine.stop_when_scored and cfg.model.name == "gemma3_270m" for cfg in cfgs)
    baselines = {run.pairing_key for run in runs.values() if run.reads_budget and run.selection_label == "attention"}
    assert len(baselines) == 2 and all(run.pairing_key in baselines for run in runs.values() if run.reads_budget)


@pytest.mark.parametrize("experiment", ["ruler_ablation_gemma", "ruler_ablation_gemma_question_after"])
def test_the_gemma_ablations_take_the_answers_of_their_two_task_runs(experiment):
    """Each run of the one-task Gemma ablation is its earlier two-task run (tasks niah_single_2 and niah_multikey_1,
    250 samples per task and length, committed part way) in everything but which samples it holds, so it starts
    from that run's answers to niah_single_2 (pcs.run_folder.RunFolder.adopt)."""
    from pcs.run_folder import but_for_the_samples
    from oracles import hydra_cfg
    params = hydra_cfg(f"experiment={experiment}").hydra.sweeper.params
    for reading in str(params.ablation).split(","):
        now, before = (RunIdentity(compose([f"experiment={experiment}", f"ablation={reading}",
                                            f"budget={params.budget}", *extra]))
                       for extra in ([], ["benchmark.tasks=[niah_single_2,niah_multikey_1]", "benchmark.n_samples=250"]))
        assert now.folder != before.folder and list(now.cfg.benchmark.tasks) == ["niah_single_2"]
        assert but_for_the_samples(now.saved_data()) == but_for_the_samples(before.saved_data())


@pytest.mark.parametrize("rerun, base", [("ruler_ablation_gemma_rerun", "ruler_ablation_gemma"),
                                          ("ruler_ablation_gemma_question_after_rerun",
                                           "ruler_ablation_gemma_question_after")])
def test_a_gemma_rerun_runs_cells_of_its_ablation_on_other_samples(rerun, base):
    """The Gemma reruns: some of their ablation's readings and the full cache, each the same run in everything but
    the samples (RULER's generator seeded 43: other haystacks, never the ablation's answers, pcs.run_folder.RunFolder.adopt),
    each sample prefilled once for all."""
    from pcs.run_folder import but_for_the_samples
    from pcs.sweep import plan
    from oracles import hydra_cfg
    params, base_params = (hydra_cfg(f"experiment={e}").hydra.sweeper.params for e in (rerun, base))
    readings = str(params.ablation).split(",")
    assert {"full", "attention", "paper", "criticalkv"} <= set(readings) < set(str(base_params.ablation).split(","))
    cfgs = []
    for reading in readings:
        now, before = (RunIdentity(compose([f"experiment={e}", f"ablation={reading}", f"budget={params.budget}"]))
                       for e in (rerun, base))
        cfgs.append(now.cfg)
        assert (now.cfg.benchmark.seed, before.cfg.benchmark.seed) == (43, 42)
        assert now.folder != before.folder
        assert but_for_the_samples(now.saved_data()) != but_for_the_samples(before.saved_data())
        drop = lambda saved: {**saved, "benchmark": {k: v for k, v in saved["benchmark"].items()
                                                     if k not in ("seed", "n_samples")}}
        assert drop(now.saved_data()) == drop(before.saved_data())
    assert plan(cfgs) == [list(range(len(cfgs)))]


@pytest.mark.parametrize("follow_up, base", [
    ("ruler_ablation_question_after_epsilon", "ruler_ablation_question_after"),
    ("ruler_ablation_question_after_epsilon_rerun", "ruler_ablation_question_after_rerun"),
    ("ruler_ablation_value_norm_rerun", "ruler_ablation_rerun")])
def test_a_follow_up_adds_readings_to_its_base_experiments_runs(follow_up, base):
    """The follow-ups add readings (conf/ablation's epsilon pairs and value_norm) at one of their base experiment's
    budgets; the readings they compare them with land in the base's folders (their answers are reused), and each
    sample is prefilled once for all runs."""
    from pcs.sweep import plan
    from oracles import hydra_cfg
    params = hydra_cfg(f"experiment={follow_up}").hydra.sweeper.params
    base_params = hydra_cfg(f"experiment={base}").hydra.sweeper.params
    readings = str(params.ablation).split(",")
    reused = [r for r in readings if r not in FOLLOW_UP]
    assert {"attention", "paper"} <= set(reused) and set(readings) - set(reused)
    assert set(reused) <= set(str(base_params.ablation).split(","))
    assert str(params.budget) in str(base_params.budget).split(",")
    cfgs = []
    for method in str(params.method).split(","):
        for reading in readings:
            overrides = [f"method={method}", f"budget={params.budget}", f"ablation={reading}"]
            cfgs.append(compose([f"experiment={follow_up}", *overrides]))
            if reading in reused:
                assert RunIdentity(cfgs[-1]).folder == RunIdentity(compose([f"experiment={base}", *overrides])).folder
    assert len({RunIdentity(cfg).folder for cfg in cfgs}) == len(cfgs)
    assert plan(cfgs) == [list(range(len(cfgs)))]


# Per reading, a constant score per sample (so every interval is a point) and what each comparison must find.
SCORES = {"attention": 40.0, "paper": 30.0, "alpha": 36.0, "kvpress_attention": 50.0, "kvpress_paper": 45.0,
          "criticalkv": 58.0, "epsilon": 70.0, "epsilon_alpha": 60.0, "value_norm": 75.0}
EXPECTED = {   # reading -> {comparison: delta}
    "paper": {"w/o": -10.0},
    "alpha": {"w/o": -4.0, "paper knobs": 6.0},
    "kvpress_attention": {"paper conventions": 10.0},
    "kvpress_paper": {"w/o": -5.0, "paper conventions": 15.0},
    "criticalkv": {"w/o": 8.0, "paper knobs": 13.0},      # its knobs' own paper-conventions reading is not run
    # and against the readings one knob apart: that knob back at the paper's value, or at another value
    "epsilon": {"w/o": 30.0, "paper knobs": 40.0, "epsilon=1000000.0": -5.0},
    "value_norm": {"w/o": 35.0, "paper knobs": 45.0, "epsilon=0.0001": 5.0},
    "epsilon_alpha": {"w/o": 20.0, "paper knobs": 30.0, "without alpha": -10.0, "without epsilon": 24.0},
}


def write_ruler_run(root, reading, extra=(), per_stratum=10):
    from oracles import write_run
    overrides = ["benchmark=ruler", "benchmark.tasks=[niah_single_1,niah_single_2]", "benchmark.lengths=[2048,4096]",
                 "method=snapkv", "budget=256", f"ablation={reading}", *extra]
    rows = [{"id": f"{task}_{length}_{i}", "score": SCORES[reading] + (10.0 if length == 4096 else 0.0),
             "task": task, "length": length, "stratum": f"{task}_{length}"}
            for task in ("niah_single_1", "niah_single_2") for length in (2048, 4096) for i in range(per_stratum)]
    score = SCORES[reading]
    lengths = {str(n): {"tasks": {"niah_single_1": score + extra, "niah_single_2": score + extra},
                        "mean": score + extra} for n, extra in ((2048, 0.0), (4096, 10.0))}
    folder = write_run(root, *overrides, metrics={"score": score + 5.0, "lengths": lengths,
                                                  "domains": {f"mean_{n}": v["mean"] for n, v in lengths.items()}})
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_each_reading_is_compared_with_the_runs_it_differs_from_in_one_respect(tmp_path):
    from pcs.report.ablation import knob_effects
    root = tmp_path / "results"
    for reading in SCORES:
        write_ruler_run(root, reading)
    for reading in ("attention", "paper"):     # a plain with/without group (another budget): not an ablation
        write_ruler_run(root, reading, ["budget=512"])
    effects = knob_effects(sorted(p.parent for p in root.rglob("metrics.json")), resamples=200)
    assert set(effects["budget"]) == {256}
    assert set(effects["domain"]) == {"average", "mean_2048", "mean_4096"}
    average = effects[effects["domain"] == "average"]
    labels = {"paper": "perturbation", "alpha": "perturbation_alpha=0.5"}
    found = {}
    for reading, comparisons in EXPECTED.items():
        cfg = compose(["benchmark=ruler", "method=snapkv", f"ablation={reading}"])
        run = RunIdentity(cfg)
        mine = average[(average["selection"] == run.selection_label)
                       & (average["conventions"] == ", ".join(run.method_knobs))]
        found[reading] = {r["against"]: r["delta"] for _, r in mine.iterrows()}
        assert all(mine["ci_low"] == mine["delta"]) and all(mine["half_width"] == 0)
        assert labels.get(reading, run.selection_label) == run.selection_label
    assert found == {r: pytest.approx(c) for r, c in EXPECTED.items()}
    # every length sees the same differences (the 4096 offset is common to all runs)
    per_length = effects[effects["domain"] == "mean_4096"].set_index(["selection", "conventions", "against"])["delta"]
    assert per_length.to_dict() == average.set_index(["selection", "conventions", "against"])["delta"].to_dict()


def test_the_report_has_a_knob_section_and_a_figure_per_table(tmp_path):
    from pcs.report.__main__ import main
    root = tmp_path / "results"
    for reading in SCORES:
        write_ruler_run(root, reading)
    for reading in ("attention", "paper", "epsilon"):     # a second ablation: the question after compression
        write_ruler_run(root, reading, extra=["benchmark.query_aware=false"])
    assert main(["--results", str(root), "--out", str(tmp_path / "report"), "--resamples", "200"]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Selection knobs" in report
    figures = sorted((tmp_path / "report" / "ablation").glob("*.png"))
    assert len(figures) == 2
    # each table is followed by its own figure (named by the table's setting), before the next table
    headers = [line for line in report.splitlines() if line.startswith("### smollm2, ruler")]
    assert len(headers) == 2 and "query_aware=False" in headers[0] + headers[1]
    for header, following in zip(headers, headers[1:] + ["\n## "]):
        section = report[report.index(header):report.index(following, report.index(header) + 1)]
        setting = header.split(", ", 2)[2]
        assert [f.name for f in figures if f"](ablation/{f.name})" in section] == [f"smollm2_ruler_{setting}.png"]
    assert "| snapkv | 256 | paper | perturbation_alpha=0.5 | 41.0 | 40 | -4.0* [-4.0, -4.0] | +6.0* [+6.0, +6.0] | - | - |" \
        in report
    assert ("| snapkv | 256 | paper | perturbation_alpha=0.5_epsilon=0.0001 | 65.0 | 40 | +20.0* [+20.0, +20.0] | "
            "+30.0* [+30.0, +30.0] | - | without alpha: -10.0* [-10.0, -10.0]; without epsilon: +24.0* [+24.0, +24.0] |"
            ) in report
    assert figures[0].stat().st_size > 10_000


def test_only_a_benchmark_scored_per_length_gets_per_length_domains():
    """RULER's strata are task x length: a mean per length. LongBench's strata are its tasks and its ``length`` a
    sample's word count: the average alone (not one domain per word count)."""
    import pandas as pd
    from pcs.report.ablation import mean_domains
    ruler = pd.DataFrame({"task": ["a", "a", "b", "b"], "length": [2048, 4096, 2048, 4096],
                          "stratum": ["a_2048", "a_4096", "b_2048", "b_4096"]})
    assert sorted(mean_domains(ruler)) == ["average", "mean_2048", "mean_4096"]
    longbench = pd.DataFrame({"task": ["qasper", "qasper", "trec"], "length": [3512, 4120, 2210],
                              "stratum": ["qasper", "qasper", "trec"]})
    assert list(mean_domains(longbench)) == ["average"]


def test_too_few_samples_per_stratum_give_differences_without_intervals_or_stars(tmp_path):
    """3 samples per task and length (a pilot): the differences are reported, their intervals are not (with no
    variation within a stratum the bootstrap would print a point and a star)."""
    from pcs.report.ablation import knob_effects, markdown
    root = tmp_path / "results"
    for reading in ("attention", "paper", "alpha"):
        write_ruler_run(root, reading, per_stratum=3)
    effects = knob_effects(sorted(p.parent for p in root.rglob("metrics.json")), resamples=200)
    average = effects[effects["domain"] == "average"]
    assert set(average["n"]) == {12} and average["ci_low"].isna().all() and average["p_value"].isna().all()
    table = "\n".join(markdown(effects))
    assert "| perturbation_alpha=0.5 | 41.0 | 12 | -4.0 [no interval: < 10 per stratum] | +6.0 [no interval" in table
    assert "*" not in table


def test_readings_one_knob_apart_share_conventions_selection_and_every_other_knob():
    from pcs.report.ablation import Reading

    def reading(conventions, name, *knobs):
        return Reading(Path("/"), (), conventions, "_".join([name, *knobs]), name, knobs)

    members = [reading("", "attention"), reading("", "perturbation"), reading("", "perturbation", "alpha=0.5"),
               reading("", "perturbation", "epsilon=0.0001"), reading("", "perturbation", "epsilon=1000000.0"),
               reading("", "perturbation", "alpha=0.5", "epsilon=0.0001"),
               reading("", "perturbation", "alpha=0.5", "epsilon=0.0001", "gqa=product_of_means"),
               reading("profile=kvpress", "perturbation", "alpha=0.5"),
               reading("profile=kvpress", "perturbation", "alpha=0.25", "epsilon=0.0001"),
               reading("", "other", "alpha=0.5")]
    group = {(m.conventions, m.selection): m for m in members}

    def apart(conventions, name, *knobs):
        return {how: other.selection for how, other in group[(conventions, "_".join([name, *knobs]))]
                .one_knob_apart(group).items()}

    assert apart("", "perturbation", "alpha=0.5", "epsilon=0.0001") == {
        "without alpha": "perturbation_epsilon=0.0001", "without epsilon": "perturbation_alpha=0.5"}
    assert apart("", "perturbation", "epsilon=0.0001") == {"epsilon=1000000.0": "perturbation_epsilon=1000000.0"}
    assert apart("", "perturbation", "alpha=0.5") == {}      # its default is the paper-knobs comparison
    # one knob apart from the paper-conventions epsilon reading, but under other conventions
    assert apart("profile=kvpress", "perturbation", "alpha=0.25", "epsilon=0.0001") == {}
    assert apart("", "perturbation", "alpha=0.5", "epsilon=0.0001", "gqa=product_of_means") == {
        "without gqa": "perturbation_alpha=0.5_epsilon=0.0001"}
    assert apart("", "attention") == {}


@pytest.mark.parametrize("reading", [r for r in READINGS if r != "full"])
def test_adakv_is_snapkv_when_a_layer_has_one_kv_head(reading):
    """Why the ablation on Gemma 3 270M (one KV head per layer) runs SnapKV alone: with one head there is
    nothing to allocate between heads, so every reading keeps SnapKV's entries under AdaKV too. Random layers
    of Gemma's shape (4 query heads on 1 KV head of 256; the window queries 64 long for kvpress's window)."""
    import torch
    from pcs.eviction import build_method
    from pcs.eviction.base import LayerState

    g = torch.Generator().manual_seed(7)
    h_q, n, d, budget = 4, 400, 256, 120
    for trial in range(3):
        keys, values = torch.randn(1, n, d, generator=g), torch.randn(1, n, d, generator=g) * (1 + trial)
        queries = torch.randn(h_q, 64, d, generator=g) * 0.2
        layer = LayerState(trial, 3, keys, values, queries, torch.randn(640, h_q * d, generator=g))
        kept = []
        for method in ("snapkv", "adakv"):
            m = build_method(compose([f"ablation={reading}", f"method={method}", f"budget={budget}"]))
            w = m.window
            kept.append([sorted(p.tolist()) for p in m.keep(layer.seen_by(queries[:, -w:]))])
        assert kept[0] == kept[1] and len(kept[0]) == 1 and len(kept[0][0]) == budget


def test_a_rerun_agrees_where_the_difference_of_two_independent_estimates_may_be_zero(tmp_path):
    """python -m pcs.report.rerun on a hand-made ablation.csv: one effect the rerun reproduces (difference 2 within
    +-sqrt(3^2 + 4^2) = 5), one it does not (difference 12), the per-length rows and unmatched readings ignored."""
    import subprocess
    import sys
    import pandas as pd
    common = {"model": "smollm2", "benchmark": "ruler", "method": "snapkv", "budget": 512, "conventions": None,
              "knobs": None, "score": 50.0, "n": 100, "p_value": 0.01, "run_dir": "a", "baseline_run_dir": "b"}

    def row(setting, selection, against, delta, half, domain="average"):
        return {**common, "setting": setting, "selection": selection, "against": against, "domain": domain,
                "delta": delta, "ci_low": delta - half, "ci_high": delta + half, "half_width": half}

    rows = [row("s42", "perturbation", "w/o", -20.0, 3.0), row("s43", "perturbation", "w/o", -18.0, 4.0),
            row("s42", "perturbation_alpha=0.5", "w/o", 10.0, 2.0), row("s43", "perturbation_alpha=0.5", "w/o", -2.0, 2.0),
            row("s43", "perturbation", "w/o", 40.0, 1.0, domain="mean_2048"),
            row("s42", "perturbation_epsilon=0.0001", "w/o", 5.0, 1.0)]
    path = tmp_path / "ablation.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    done = subprocess.run([sys.executable, "-m", "pcs.report.rerun", str(path), "--ablation", "s42", "--rerun", "s43"],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("| snapkv")]
    assert len(lines) == 2
    # p: erfc(|d| / (h / 1.96) / sqrt 2): 2 of +-5 -> 0.433; 12 of +-2.83 -> 1e-16; Holm's thresholds 0.025, 0.05
    assert lines[0].endswith("| +2.0 +-5.0 | yes | yes | 0.433 | no |") and "-20.0 [-23.0, -17.0] (100)" in lines[0]
    assert lines[1].endswith("| -12.0 +-2.8 | no | no | 0.000 | yes |")
    assert "1 of 2 effects agree one by one" in done.stdout and "1 differ after Holm's correction" in done.stdout


def test_holms_correction_rejects_step_down_and_stops_at_the_first_it_keeps():
    """Transcribed from Holm (1979): sorted p-values against alpha / (m - rank), rejecting until the first that
    passes its threshold; a single test is rejected at alpha itself."""
    from pcs.report import rerun as module
    # m = 4: thresholds 0.0125, 0.0167, 0.025, 0.05; 0.03 fails its 0.025, so 0.04 is kept although below 0.05
    assert module.holm([0.04, 0.01, 0.03, 0.015]) == [False, True, False, True]
    assert module.holm([0.049]) == [True] and module.holm([0.051]) == [False]
    assert module.holm([0.5, 0.001, 0.02]) == [False, True, True]


@pytest.mark.parametrize("grown, ablation", [("ruler_ablation_grown", "ruler_ablation"),
                                             ("ruler_ablation_question_after_grown", "ruler_ablation_question_after")])
def test_a_grown_ablation_is_its_ablations_runs_on_more_samples(grown, ablation):
    """Each run of a grown experiment is a run of the ablation in everything but benchmark.n_samples, and has at
    least as many samples of every task: it starts from that run's answers (pcs.run_folder.RunFolder.adopt)."""
    from pcs.run_folder import but_for_the_samples
    from oracles import hydra_cfg
    params = hydra_cfg(f"experiment={grown}").hydra.sweeper.params
    ablation_params = hydra_cfg(f"experiment={ablation}").hydra.sweeper.params
    for method in str(params.method).split(","):
        for budget in str(params.budget).split(","):
            assert method in str(ablation_params.method).split(",") and budget in str(ablation_params.budget).split(",")
            for reading in str(params.ablation).split(","):
                assert reading in str(ablation_params.ablation).split(",")
                mine, theirs = (RunIdentity(compose([f"experiment={name}", f"method={method}", f"budget={budget}",
                                                     f"ablation={reading}"])) for name in (grown, ablation))
                assert but_for_the_samples(mine.saved_data()) == but_for_the_samples(theirs.saved_data())
                more, fewer = (OmegaConf.to_container(run.cfg.benchmark)["n_samples"] for run in (mine, theirs))
                tasks = len(mine.cfg.benchmark.tasks)
                more, fewer = ([n] * tasks if isinstance(n, int) else n for n in (more, fewer))
                assert all(m >= f for m, f in zip(more, fewer)) and more != fewer


def test_interim_ablation_pairs_the_first_samples_every_run_holds(tmp_path, capsys):
    """python -m pcs.report.interim on three partial runs of one RULER group (attention, the paper reading, alpha
    0.5): per stratum only the first samples every run answered count (a hole in one run ends its stratum's
    prefix there), the paired difference is the mean over strata of the per-stratum mean differences on those
    samples, and the projected count follows the widest half-width as one over the square root of the samples."""
    import math
    import re
    import numpy as np
    from pcs.report import interim
    rng = np.random.default_rng(4)
    strata = ("niah_single_2_4096", "niah_single_2_8192")
    held = {("selection=attention",): {strata[0]: range(40), strata[1]: range(40)},
            ("selection=perturbation",): {strata[0]: [*range(12), *range(13, 30)], strata[1]: range(40)},
            ("selection=perturbation", "selection.alpha=0.5"): {strata[0]: range(40), strata[1]: range(25)}}
    scores = {}
    for knobs, rows in held.items():
        cfg = compose(["benchmark=ruler", "method=snapkv", "budget=0.25", *knobs])
        folder = tmp_path / RunIdentity(cfg).folder
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(RunIdentity(cfg).saved_config)
        lines = []
        for stratum, indices in rows.items():
            for i in indices:
                score = float(rng.integers(0, 2) * 100)
                scores[knobs, f"{stratum}_{i}"] = score
                lines.append({"id": f"{stratum}_{i}", "stratum": stratum, "task": "niah_single_2",
                              "length": int(stratum[-4:]), "score": score})
        rng.shuffle(lines)                       # answers land out of order in a pool
        (folder / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert interim.main([str(folder.parent), "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    shared = {strata[0]: range(12), strata[1]: range(25)}         # sample 12 of 4K is the paper reading's hole
    assert "37 samples shared by 3 runs" in out
    attention, paper = ("selection=attention",), ("selection=perturbation",)
    delta = np.mean([np.mean([scores[paper, f"{s}_{i}"] - scores[attention, f"{s}_{i}"] for i in shared[s]])
                     for s in strata])
    (row,) = [line for line in out.splitlines() if line.startswith("| paper | perturbation |")]
    assert row.split("|")[4].strip().startswith(f"{delta:+.1f} [")
    found = re.search(r"widest half-width ([\d.]+): about (\d+) samples", out)
    assert found, out
    half, projected = found.groups()
    half = float(half)                                        # printed to 0.1
    assert math.ceil(37 * ((half - 0.05) / 3) ** 2) <= int(projected) <= math.ceil(37 * ((half + 0.05) / 3) ** 2)
