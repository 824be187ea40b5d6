"""AlpacaEval: outputs in alpaca_eval's format, judged by the real alpaca_eval code against a stub
OpenAI-compatible judge on 127.0.0.1, retries, failures that keep the outputs, and a full run."""
import json

import pytest

from pcs.identity import RunIdentity
from pcs.annotate import annotate_run, main as annotate_main
from pcs.runner import run

from conftest import compose_cfg
from stub_judge import StubJudge

INSTRUCTIONS = ["Name a colour.", "Say hello.", "Count to three."]
REFERENCE = ["Blue is a colour.", "Hi", "One, two, three."]
MODEL = ["Red.", "Hello there, nice to meet you!", "1 2 3, and that is counting to three."]


def bench_cfg(tmp_path, judge, *extra):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps([{"instruction": i, "output": o, "generator": "ref"}
                                     for i, o in zip(INSTRUCTIONS, REFERENCE)]))
    return compose_cfg("benchmark=alpacaeval", f"benchmark.reference_file={reference}",
                       f"benchmark.judge.base_url={judge.base_url}", "benchmark.judge.api_key_env=PCS_STUB_KEY",
                       "benchmark.judge.max_retries=3", "benchmark.judge.timeout_s=10", *extra)


def write_outputs(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "model_outputs.json").write_text(json.dumps(
        [{"instruction": i, "output": o, "generator": "tiny-snapkv", "dataset": "t"} for i, o in zip(INSTRUCTIONS, MODEL)]))


def expected_win_rate(confidence=0.9):
    # The stub prefers the longer output with probability `confidence`: the model is longer on 2 of 3.
    wins = [confidence if len(m) > len(r) else 1 - confidence for m, r in zip(MODEL, REFERENCE)]
    return 100 * sum(wins) / len(wins)


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("PCS_STUB_KEY", "sk-stub")


def test_win_rate_from_outputs_through_alpaca_eval(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)        # a relative run folder, as `python -m pcs.annotate results/...` gives
    with StubJudge() as judge:
        write_outputs(tmp_path / "run")
        result = annotate_run("run", bench_cfg(tmp_path, judge).benchmark)
    assert result["annotation_error"] is None
    assert result["win_rate"] == pytest.approx(expected_win_rate()) == pytest.approx(63.3333, abs=1e-3)
    assert result["score"] == result["win_rate"]
    assert result["n_judged"] == 3 and result["n_not_judged"] == 0
    assert judge.requests == 3
    assert (tmp_path / "run" / "annotations" / "deepseek-chat" / "annotations.json").exists()
    # Offline, the LC win rate cannot get alpaca_eval's instruction difficulties: reported, not fatal.
    assert result["lc_win_rate"] is None and result["lc_win_rate_error"]


def test_http_errors_are_retried(tmp_path):
    with StubJudge(fail_first=2) as judge:
        write_outputs(tmp_path / "run")
        result = annotate_run(tmp_path / "run", bench_cfg(tmp_path, judge).benchmark)
    assert judge.requests == 3 + 2
    assert result["win_rate"] == pytest.approx(expected_win_rate())


def test_a_broken_judge_is_reported_and_keeps_the_outputs(tmp_path):
    with StubJudge(mode="broken") as judge:
        write_outputs(tmp_path / "run")
        before = (tmp_path / "run" / "model_outputs.json").read_text()
        result = annotate_run(tmp_path / "run", bench_cfg(tmp_path, judge, "benchmark.judge.max_retries=1").benchmark)
    assert "judging failed" in result["annotation_error"] and "pcs.annotate" in result["annotation_error"]
    assert (tmp_path / "run" / "model_outputs.json").read_text() == before


def test_without_a_key_nothing_is_sent_and_the_message_says_how(tmp_path, monkeypatch):
    monkeypatch.delenv("PCS_STUB_KEY")
    with StubJudge() as judge:
        write_outputs(tmp_path / "run")
        result = annotate_run(tmp_path / "run", bench_cfg(tmp_path, judge).benchmark)
    assert judge.requests == 0
    assert "PCS_STUB_KEY" in result["annotation_error"] and "python -m pcs.annotate" in result["annotation_error"]


def test_generation_with_decoding_compression_then_judging(tiny_model_dir, tmp_path):
    data = tmp_path / "instructions.json"
    data.write_text(json.dumps([{"instruction": i, "dataset": "t"} for i in INSTRUCTIONS]))
    with StubJudge() as judge:
        cfg = bench_cfg(tmp_path, judge, f"model.path={tiny_model_dir}", f"results_dir={tmp_path / 'results'}",
                        "progress=false", f"benchmark.data_file={data}", "benchmark.max_new_tokens=80",
                        "budget=24", "method.window=8", "compress.trigger=40", "benchmark.annotate=true")
        metrics = run(cfg)
    run_dir = tmp_path / "results" / RunIdentity(cfg).folder
    assert run_dir.name == "snapkv_perturbation_b24_window=8_max_new_tokens=80_trigger=40"
    outputs = json.loads((run_dir / "model_outputs.json").read_text())
    assert [o["instruction"] for o in outputs] == INSTRUCTIONS
    # The generator names every knob the run reads, as the folder does.
    assert {o["generator"] for o in outputs} == {"smollm2-snapkv-perturbation-b24-window=8-max_new_tokens=80-trigger=40"}
    assert all(set(o) == {"instruction", "output", "generator", "dataset"} for o in outputs)
    assert metrics["max_kv_entries"] <= 41 and metrics["n_compressions"] >= 1
    assert metrics["score"] == metrics["win_rate"] and 0 <= metrics["win_rate"] <= 100
    assert judge.requests == 3
    # The separate command judges again from the saved outputs (answers are cached: no new requests).
    with StubJudge() as judge2:
        code = annotate_main([str(run_dir), "--base-url", judge2.base_url, "--api-key-env", "PCS_STUB_KEY",
                              "--reference-file", str(tmp_path / "reference.json")])
    assert code == 0
    assert json.loads((run_dir / "metrics.json").read_text())["judges"]["deepseek-chat"]["win_rate"] == \
        pytest.approx(metrics["win_rate"])


def test_a_sweeps_job_still_loads_its_instructions(tiny_model_dir, tmp_path):
    """A sweep's job runs configs validated at submission (``run_cells(..., checked=True)``): its benchmark's data is
    still checked and loaded where the job runs, so it answers every instruction (not none)."""
    from pcs.runner import run_cells
    data = tmp_path / "instructions.json"
    data.write_text(json.dumps([{"instruction": i, "dataset": "t"} for i in INSTRUCTIONS]))
    cfg = compose_cfg("benchmark=alpacaeval", f"model.path={tiny_model_dir}", f"results_dir={tmp_path / 'results'}",
                      "progress=false", f"benchmark.data_file={data}", "benchmark.max_new_tokens=4", "budget=24",
                      "method.window=8", "benchmark.annotate=false")
    (metrics,) = run_cells([cfg], checked=True)
    assert metrics["n_samples"] == len(INSTRUCTIONS)
