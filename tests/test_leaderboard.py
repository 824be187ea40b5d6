"""The leaderboard (``pcs.report --leaderboard``): from run folders of experiment=leaderboard's sweep written here
with known answers, each row's score, entries kept, relative costs and selection effect worked out by hand, on the
samples every run has answered."""
import json

import pytest

from pcs.identity import RunIdentity
from pcs.report.__main__ import main
from pcs.report.leaderboard import bench_rounds, leaderboard

from conftest import compose_cfg

OVERRIDES = ["experiment=leaderboard", "benchmark.n_samples=10"]
PNG = b"\x89PNG\r\n\x1a\n"


def write_answers(results, overrides, right, kept=0.25, extra=0, sharded=False, lengths=(2048,), base=OVERRIDES,
                  follow_ups=None):
    """A run whose answers to niah_single_1 and niah_single_2 (10 each per length) are right at the indices
    ``right[task]`` (``right[(task, length)]`` where a length has its own);
    ``extra`` more niah_single_1 answers past those (a run ahead of the others); ``sharded``: a run of two shards
    in progress (its answers in ``shards/<k>-of-2/``, none merged yet)."""
    cfg = compose_cfg(*base, *overrides)
    folder = results / RunIdentity(cfg).folder
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(RunIdentity(cfg).saved_config)
    rows = [{"id": f"{task}_{length}_{i}", "task": task, "length": length, "stratum": f"{task}_{length}",
             "score": 100.0 if i in right.get((task, length), right.get(task, ())) else 0.0,
             "kv_cache_bytes": kept * 1000, "kv_cache_bytes_full": 1000}
            for length in lengths for task in ("niah_single_1", "niah_single_2") for i in range(10)]
    rows += [{**rows[0], "id": f"niah_single_1_2048_{10 + i}", "score": 0.0} for i in range(extra)]
    if follow_ups is not None:      # the follow-ups' mean score per sample: 100 at the indices follow_ups[task]
        for r in rows:
            r["follow_up_score"] = 100.0 if int(r["id"].rsplit("_", 1)[1]) in follow_ups[r["task"]] else 0.0
    if not sharded:
        (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in range(2 if sharded else 0):
        (folder / "shards" / f"{k}-of-2").mkdir(parents=True)
        (folder / "shards" / f"{k}-of-2" / "predictions.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows[k::2]))
    (folder / "metrics.json").write_text(json.dumps({"device": "cpu", "score": 0.0}))
    return folder


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    write_answers(root, ["method=full"], {"niah_single_1": range(10), "niah_single_2": range(9)}, kept=1.0)
    write_answers(root, ["method=snapkv", "selection=attention", "budget=256"],
                  {"niah_single_1": range(3), "niah_single_2": range(5)}, extra=3)
    write_answers(root, ["method=snapkv", "selection=perturbation", "budget=256"],
                  {"niah_single_1": range(5), "niah_single_2": range(2, 10)})
    write_answers(root, ["method=defensivekv", "budget=256"],
                  {"niah_single_1": range(8), "niah_single_2": range(10)}, kept=0.2, sharded=True)
    return root


def test_a_run_far_behind_stays_out_until_it_has_half_the_answers(results, tmp_path):
    """A method added to a sweep late: with 9 answers against the most-answered run's 23 it would shrink every row
    to 9 samples, so the main table leaves it out, and a second table holds every run on the 9 samples all share
    (scores and effects worked out on those); with 12 (at least half) it enters and the rows hold the 12 all
    share, and the second table goes."""
    late = write_answers(results, ["method=knorm", "selection=attention", "budget=256"],
                         {"niah_single_1": range(10), "niah_single_2": range(10)})
    rows = (late / "predictions.jsonl").read_text().splitlines()
    (late / "predictions.jsonl").write_text("\n".join(rows[:9]) + "\n")      # niah_single_1's samples 0-8
    board = leaderboard(["leaderboard", "benchmark.n_samples=10"], results, resamples=200)
    main_table, catching_up = board[board["cohort"] == ""], board[board["cohort"] != ""]
    assert "knorm" not in set(main_table["method"]) and set(main_table["n"]) == {20}
    assert len(catching_up) == 5 and set(catching_up["n"]) == {9} and "knorm" in set(catching_up["method"])
    scores = catching_up.set_index(["method", "selection"])
    # on niah_single_1's samples 0-8 (one task): snapkv right at 0-2, with perturbation at 0-4, the full cache all
    assert scores.loc[("knorm", "attention"), "score"] == pytest.approx(100.0)
    assert scores.loc[("snapkv", "attention"), "score"] == pytest.approx(100 * 3 / 9)
    assert scores.loc[("snapkv", "perturbation"), "effect"] == pytest.approx(100 * 2 / 9)
    out = tmp_path / "board"
    assert main(["--results", str(results), "--leaderboard", "leaderboard", "benchmark.n_samples=10",
                 "--out", str(out), "--resamples", "200"]) == 0
    readme = (out / "README.md").read_text()
    assert readme.index("### smollm2, 2048 tokens, question inside (20 samples per run)") < readme.index(
        "### smollm2, 2048 tokens, question inside, every run, those catching up included (9 samples per run)")
    assert readme.count("| knorm |") == 1 and sorted(p.name for p in out.glob("*.png")) == ["smollm2_2048.png"]
    alone = {**json.loads(rows[0]), "id": "niah_single_1_2048_19"}     # a sample no other run has answered
    (late / "predictions.jsonl").write_text(json.dumps(alone) + "\n")
    board = leaderboard(["leaderboard", "benchmark.n_samples=10"], results, resamples=200)
    assert set(board["cohort"]) == {""} and set(board["n"]) == {20}
    (late / "predictions.jsonl").write_text("\n".join(rows[:12]) + "\n")
    board = leaderboard(["leaderboard", "benchmark.n_samples=10"], results, resamples=200)
    assert "knorm" in set(board["method"]) and set(board["n"]) == {12} and set(board["cohort"]) == {""}


def test_rows_are_worked_out_on_the_samples_every_run_answered(results, tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in [
        {"model": "smollm2", "context": 2048, "method": "full", "selection": "none", "budget": None,
         "prefill_s": 2.0, "decode_ms_per_token": 50.0},
        {"model": "smollm2", "context": 2048, "method": "snapkv", "selection": "perturbation", "budget": 256,
         "prefill_s": 2.5, "decode_ms_per_token": 40.0},
        {"model": "smollm2", "context": 4096, "method": "snapkv", "selection": "perturbation", "budget": 256,
         "prefill_s": 9.0, "decode_ms_per_token": 45.0}]))
    board = leaderboard(["leaderboard", "benchmark.n_samples=10"], results, [bench], resamples=500)
    rows = board.set_index(["method", "selection"])
    assert len(board) == 4 and set(board["n"]) == {20}          # snapkv attention's 3 extra answers left out
    # the mean over the two tasks: (30 + 50) / 2, (50 + 80) / 2, (80 + 100) / 2, (100 + 90) / 2
    assert rows.loc[("snapkv", "attention"), "score"] == pytest.approx(40.0)
    assert rows.loc[("snapkv", "perturbation"), "score"] == pytest.approx(65.0)
    assert rows.loc[("defensivekv", "none"), "score"] == pytest.approx(90.0)
    assert rows.loc[("full", "none"), "score"] == pytest.approx(95.0)
    # paired per task: niah_single_1 +1 at samples 3 and 4 -> +20; niah_single_2 -1 at 0 and 1, +1 at 5-9 -> +30
    assert rows.loc[("snapkv", "perturbation"), "effect"] == pytest.approx(25.0)
    low, high = rows.loc[("snapkv", "perturbation"), ["effect_low", "effect_high"]]
    assert low < 25.0 < high
    assert rows[["effect"]].isna().sum().iloc[0] == 3                 # only the perturbation row has one
    assert rows.loc[("defensivekv", "none"), "kv_kept"] == pytest.approx(0.2)
    assert rows.loc[("snapkv", "perturbation"), ["prefill_rel", "decode_rel"]].tolist() == pytest.approx([1.25, 0.8])
    assert rows.loc[("snapkv", "attention"), ["prefill_rel"]].isna().all()   # not in the bench file


def test_the_command_writes_the_table_a_figure_and_how_it_was_made(results, tmp_path):
    out = tmp_path / "board"
    assert main(["--results", str(results), "--leaderboard", "leaderboard", "benchmark.n_samples=10",
                 "--out", str(out), "--resamples", "200"]) == 0
    readme = (out / "README.md").read_text()
    assert "--leaderboard leaderboard benchmark.n_samples=10" in readme and "run on cpu" in readme
    assert "| defensivekv | none | 256 | 90.0 [" in readme
    assert "| snapkv | perturbation | 256 | 65.0 [" in readme and "| +25.0 [" in readme
    assert readme.index("| full |") < readme.index("| defensivekv |") < readme.index("| snapkv | perturbation")
    assert (out / "smollm2_2048.png").read_bytes()[:8] == PNG
    assert (out / "leaderboard.csv").exists()


def test_a_model_of_several_lengths_gets_a_table_of_them_together_first(tmp_path):
    """Each (task, length) is a stratum: the lengths-together score is the mean of the four strata's means, its
    selection effect paired within them; its table comes before each length's."""
    root, base = tmp_path / "results", [*OVERRIDES, "benchmark.lengths=[2048,4096]"]
    write_answers(root, ["method=full"], {"niah_single_1": range(10), "niah_single_2": range(10)}, kept=1.0,
                  lengths=(2048, 4096), base=base)
    write_answers(root, ["method=snapkv", "selection=attention", "budget=256"],
                  {"niah_single_1": range(4), "niah_single_2": range(6), ("niah_single_2", 4096): range(2)},
                  lengths=(2048, 4096), base=base)
    write_answers(root, ["method=snapkv", "selection=perturbation", "budget=256"],
                  {"niah_single_1": range(5), "niah_single_2": range(6), ("niah_single_1", 4096): range(1)},
                  lengths=(2048, 4096), base=base)
    board = leaderboard(["leaderboard", *base[1:]], root, resamples=500)
    rows = board.set_index(["method", "selection", "length"])
    assert sorted(set(board["length"])) == ["2048", "2048+4096", "4096"]
    assert set(board.loc[board["length"] == "2048+4096", "n"]) == {40}
    assert rows.loc[("snapkv", "attention", "2048"), "score"] == pytest.approx(50.0)       # (40 + 60) / 2
    assert rows.loc[("snapkv", "attention", "4096"), "score"] == pytest.approx(30.0)       # (40 + 20) / 2
    assert rows.loc[("snapkv", "attention", "2048+4096"), "score"] == pytest.approx(40.0)  # (40 + 60 + 40 + 20) / 4
    # strata differences: +10, 0 at 2048; -30, +40 at 4096 -> +5 over the four
    assert rows.loc[("snapkv", "perturbation", "2048+4096"), "effect"] == pytest.approx(5.0)
    assert rows.loc[("snapkv", "perturbation", "4096"), "effect"] == pytest.approx(5.0)
    out = tmp_path / "board"
    assert main(["--results", str(root), "--leaderboard", "leaderboard", *base[1:], "--out", str(out),
                 "--resamples", "200"]) == 0
    readme = (out / "README.md").read_text()
    assert readme.index("### smollm2, 2048 and 4096 tokens together, question inside (40 samples per run)") \
        < readme.index("### smollm2, 2048 tokens, question inside (20 samples") \
        < readme.index("### smollm2, 4096 tokens, question inside (20 samples")
    assert (out / "smollm2_2048+4096.png").read_bytes()[:8] == PNG


def test_a_bench_file_says_how_each_context_was_measured():
    # One file: 8192 measured once, 4096 rerun on its own with two rounds; each clause names its contexts.
    rows = ([{"context": 8192, "repeats": 1, "decode_tokens": 16}] * 3
            + [{"context": 4096, "repeats": 2, "decode_tokens": 16}] * 3)
    assert bench_rounds(rows) == ("4096 tokens, medians of 2 rounds, 16 tokens decoded per round; "
                                  "8192 tokens, medians of 1 round, 16 tokens decoded per round")
    same = [{"context": c, "repeats": 2, "decode_tokens": 16} for c in (2048, 4096)]
    assert bench_rounds(same) == "2048, 4096 tokens, medians of 2 rounds, 16 tokens decoded per round"


def test_a_follow_up_table_scores_the_follow_ups_beside_the_first_question(tmp_path):
    """experiment=leaderboard_follow_ups: the score is the follow-ups' mean, the first question's is beside it, and
    the follow-ups minus the first question is paired within each task."""
    root, base = tmp_path / "results", ["experiment=leaderboard_follow_ups", "benchmark.n_samples=10"]
    write_answers(root, ["method=full"], {"niah_single_1": range(10), "niah_single_2": range(10)}, kept=1.0,
                  base=base, follow_ups={"niah_single_1": range(10), "niah_single_2": range(8)})
    write_answers(root, ["method=snapkv", "selection=attention", "budget=512"],
                  {"niah_single_1": range(9), "niah_single_2": range(7)}, base=base,
                  follow_ups={"niah_single_1": range(2), "niah_single_2": range(1)})
    board = leaderboard(["leaderboard_follow_ups", base[1]], root, resamples=500)
    rows = board.set_index("method")
    assert rows.loc["snapkv", "score"] == pytest.approx(15.0)          # (20 + 10) / 2: the follow-ups
    assert rows.loc["snapkv", "first"] == pytest.approx(80.0)          # (90 + 70) / 2: the first question
    assert rows.loc["snapkv", "loss"] == pytest.approx(-65.0)
    assert rows.loc["snapkv", "loss_low"] < -65.0 < rows.loc["snapkv", "loss_high"] < 0
    assert rows.loc["full", "protocol"] == "question inside + 3 follow-ups after compression"
    out = tmp_path / "board"
    assert main(["--results", str(root), "--leaderboard", "leaderboard_follow_ups", base[1], "--out", str(out),
                 "--resamples", "200"]) == 0
    readme = (out / "README.md").read_text()
    assert "| first question [95 %] | follow-ups - first [95 %] |" in readme
    assert "| snapkv | attention | 512 | 15.0 [" in readme and "| 80.0 [" in readme and "| -65.0 [" in readme
    assert "By compression ratio" not in readme           # entries, not shares: no such table


def test_shares_of_the_prompt_are_also_tabled_by_compression_ratio_as_kvpress_does(tmp_path):
    root = tmp_path / "results"
    base = ["experiment=leaderboard_gemma", "benchmark.n_samples=10", "benchmark.lengths=[4096]"]
    both = {"niah_single_1": range(10), "niah_single_2": range(10)}
    write_answers(root, ["method=full"], both, kept=1.0, lengths=(4096,), base=base)
    for budget, right in ((0.5, range(8)), (0.25, range(3))):
        write_answers(root, ["method=knorm", "selection=attention", f"budget={budget}"],
                      {"niah_single_1": right, "niah_single_2": right}, lengths=(4096,), base=base)
    write_answers(root, ["method=tova", "selection=attention", "budget=0.5"],
                  {"niah_single_1": range(10), "niah_single_2": range(9)}, lengths=(4096,), base=base)
    out = tmp_path / "board"
    assert main(["--results", str(root), "--leaderboard", "leaderboard_gemma", *base[1:], "--out", str(out),
                 "--resamples", "200"]) == 0
    readme = (out / "README.md").read_text()
    table = readme[readme.index("By compression ratio"):]
    assert "the full cache scores 100.0" in table.splitlines()[0]
    assert "| method | selection | 0.5 | 0.75 |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| knorm", "| tova"))]
    assert rows[0].startswith("| tova | attention | 95.0 [") and rows[0].endswith("| - |")   # best mean first
    assert rows[1].startswith("| knorm | attention | 80.0 [") and "| 30.0 [" in rows[1]
