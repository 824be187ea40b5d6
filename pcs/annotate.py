"""Judge a run's AlpacaEval outputs, again or for the first time, with the ``alpaca_eval`` package.

    python -m pcs.annotate RUN_DIR                              # the paper's first judge (deepseek-chat)
    python -m pcs.annotate RUN_DIR --judge yi-large             # another judge (pcs/conf/benchmark/judge/)
    python -m pcs.annotate RUN_DIR --base-url http://127.0.0.1:8000/v1 --api-key-env MY_KEY

The result is merged into the run's ``metrics.json`` (see ``pcs.benchmarks.alpacaeval_judge``).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .benchmarks.alpacaeval_data import write_model_outputs
from .benchmarks.alpacaeval_judge import annotate_run
from .config import group_file
from .identity import RunIdentity
from .run_folder import load_config, read_rows, write_json_atomic
from .cli import command

DEFAULT_JUDGE = "deepseek-chat"


def main(argv: list[str] | None = None) -> int:
    parser = command("pcs.annotate", __doc__)
    parser.add_argument("run_dir", type=Path, help="a finished AlpacaEval run folder")
    parser.add_argument("--judge", default=DEFAULT_JUDGE, help="an option of pcs/conf/benchmark/judge/ (default: %(default)s)")
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint to judge with instead of the judge's own")
    parser.add_argument("--model", help="the judge model's name at the endpoint")
    parser.add_argument("--api-key-env", help="environment variable holding the key")
    parser.add_argument("--reference-file", type=Path,
                        help="a JSON list of {instruction, output, generator} to judge against (default: AlpacaEval "
                             "2.0's GPT-4 Turbo outputs)")
    args = parser.parse_args(argv)
    cfg = load_config(args.run_dir)
    bench = cfg.benchmark   # config.yaml holds no judging settings: they come from here
    bench.judge = OmegaConf.to_container(group_file("benchmark/judge", args.judge))   # a copy: edited below
    bench.reference_file = None
    for field, value in (("base_url", args.base_url), ("model", args.model), ("api_key_env", args.api_key_env)):
        if value:
            bench.judge[field] = value
    if args.reference_file:
        bench.reference_file = str(args.reference_file)
    if not (args.run_dir / "model_outputs.json").exists():
        write_model_outputs(read_rows(args.run_dir / "predictions.jsonl"), RunIdentity(cfg).generator, args.run_dir)
    logging.getLogger().setLevel(logging.WARNING)
    result = annotate_run(args.run_dir, bench)
    metrics_file = args.run_dir / "metrics.json"
    if metrics_file.exists() and result.get("annotation_error") is None:
        metrics = json.loads(metrics_file.read_text())
        metrics.update(result)
        metrics.setdefault("judges", {})[bench.judge.name] = {k: result[k] for k in ("win_rate", "lc_win_rate")}
        write_json_atomic(metrics_file, metrics)
    if result.get("annotation_error"):
        return 1
    print(f"[pcs] {bench.judge.name}: win rate {result['win_rate']:.2f}, LC win rate "
          f"{'n/a' if result['lc_win_rate'] is None else format(result['lc_win_rate'], '.2f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
