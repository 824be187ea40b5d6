"""AlpacaEval's judging: a run's outputs against the reference outputs, through the ``alpaca_eval``
package and an OpenAI-compatible judge (``benchmark.annotate=true``, or ``python -m pcs.annotate``).

The judge sees AlpacaEval 2.0's prompt (which of two outputs, "m" or "M", is better) and answers one
token; with ``weighted`` its top log-probabilities give a graded preference. alpaca_eval turns the
preferences into the win rate against the reference outputs, and, when its precomputed instruction
difficulties (``df_gamed.csv`` from the hub) are reachable or cached, the length-controlled win rate.
Requests are retried by the OpenAI client (timeouts, connection errors, 429, 5xx) and by alpaca_eval
(rate limits); finished judgements are cached under ``RUN_DIR/annotations/<judge>/``, so a rerun only
asks for what is missing. The outputs on disk are never touched by a failure.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import yaml

from .alpacaeval_data import HUB_REFERENCE, hub_file, read_records


def alpaca_eval_dir() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # alpaca_eval imports the deprecated pkg_resources
        import alpaca_eval
    return Path(alpaca_eval.__file__).parent


def annotation_problems(bench_cfg) -> list[str]:
    """What would stop annotation or the LC win rate, found before any generation starts."""
    judge = bench_cfg.judge
    problems = []
    if not os.environ.get(judge.api_key_env):
        problems.append(f"${judge.api_key_env} is not set: outputs will be generated but not judged; set it "
                        f"and run `python -m pcs.annotate RUN_DIR` afterwards")
    if not judge.base_url:
        problems.append("benchmark.judge.base_url is empty")
    if bench_cfg.reference_file and not Path(bench_cfg.reference_file).exists():
        problems.append(f"benchmark.reference_file={bench_cfg.reference_file} does not exist")
    try:
        from huggingface_hub import hf_hub_download
        hf_hub_download("tatsu-lab/alpaca_eval", "df_gamed.csv", repo_type="dataset", local_files_only=True)
    except Exception:
        problems.append("the length-controlled win rate needs alpaca_eval's df_gamed.csv (hub dataset "
                        "tatsu-lab/alpaca_eval) in the Hugging Face cache; without it only the win rate is reported")
    return problems


def write_judge_config(folder: Path, judge) -> Path:
    """alpaca_eval's annotator config for ``judge``; the key is passed at run time, never written."""
    folder.mkdir(parents=True, exist_ok=True)
    template = alpaca_eval_dir() / "evaluators_configs" / "alpaca_eval_clf_gpt4_turbo" / "alpaca_eval_clf.txt"
    config = {judge.name: {
        "prompt_template": str(template),
        "fn_completions": "openai_completions",
        "completions_kwargs": {
            "model_name": judge.model, "max_tokens": 1, "temperature": 1, "logprobs": True, "top_logprobs": 5,
            "requires_chatml": True, "num_procs": judge.concurrency,
            "client_kwargs": {"timeout": judge.timeout_s, "max_retries": judge.max_retries},
            "client_config_path": str(folder / "no_client_config.yaml"),   # keys come from the call
        },
        "fn_completion_parser": "logprob_parser",
        "completion_parser_kwargs": {"numerator_token": "m", "denominator_tokens": ["m", "M"],
                                     "is_binarize": not judge.weighted},
        "completion_key": "completions_all",
        "batch_size": 1,
    }}
    path = folder / "configs.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def reference_outputs(bench_cfg, instructions: list[str]) -> list[dict]:
    """The reference output of every instruction, in the order of the model's outputs."""
    path = Path(bench_cfg.reference_file) if bench_cfg.reference_file else hub_file(HUB_REFERENCE)
    by_instruction = {r["instruction"]: r for r in read_records(path, ("instruction", "output"))}
    missing = [i for i in instructions if i not in by_instruction]
    if missing:
        raise ValueError(f"{path} has no reference output for {len(missing)} instruction(s), e.g. {missing[0][:80]!r}")
    return [{"generator": "reference", **by_instruction[i]} for i in instructions]


def annotate_run(run_dir: Path, bench_cfg) -> dict:
    """Judge ``RUN_DIR/model_outputs.json``; the fields to merge into ``metrics.json``."""
    judge = bench_cfg.judge
    key = os.environ.get(judge.api_key_env)
    if not key:
        message = (f"not judged: ${judge.api_key_env} is not set; set it and run "
                   f"`python -m pcs.annotate {run_dir}`")
        print(f"[pcs] {message}")
        return {"annotation_error": message}
    run_dir = Path(run_dir).resolve()   # alpaca_eval reads relative config paths from its own folder
    outputs = json.loads((run_dir / "model_outputs.json").read_text(encoding="utf-8"))
    folder = run_dir / "annotations" / judge.name
    try:
        from alpaca_eval import evaluate
        from alpaca_eval.metrics import get_length_controlled_winrate
        references = reference_outputs(bench_cfg, [o["instruction"] for o in outputs])
        leaderboard, annotations = evaluate(
            model_outputs=outputs, reference_outputs=references,
            annotators_config=str(write_judge_config(folder, judge)), output_path=folder,
            precomputed_leaderboard=None, is_cache_leaderboard=False, is_return_instead_of_print=True,
            fn_metric="get_winrate", sort_by="win_rate",
            annotation_kwargs={"openai_api_keys": [key], "openai_api_base": judge.base_url})
    except Exception as err:   # the outputs stay on disk; a rerun resumes from the cache
        message = (f"judging failed ({type(err).__name__}: {err}); outputs are kept in model_outputs.json, "
                   f"rerun `python -m pcs.annotate {run_dir}`")
        print(f"[pcs] {message}")
        return {"annotation_error": message}
    row = leaderboard.loc[outputs[0]["generator"]]
    preferences = [a.get("preference") for a in annotations]
    missing = sum(p is None or (isinstance(p, float) and math.isnan(p)) for p in preferences)
    result = {"score": float(row["win_rate"]), "win_rate": float(row["win_rate"]),
              "standard_error": float(row["standard_error"]), "lc_win_rate": None,
              "judge": judge.name, "n_judged": len(preferences) - missing, "n_not_judged": missing}
    try:
        result["lc_win_rate"] = float(get_length_controlled_winrate(annotations)["length_controlled_winrate"])
    except Exception as err:
        result["lc_win_rate_error"] = f"{type(err).__name__}: {err}"
    if missing:
        print(f"[pcs] the judge gave no usable answer for {missing} output(s); rerun `python -m pcs.annotate "
              f"{run_dir}` to ask again")
    (folder / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return {**result, "annotation_error": None}
