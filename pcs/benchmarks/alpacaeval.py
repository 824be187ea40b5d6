"""AlpacaEval (the paper's Table 7): answers to the 805 instructions of ``tatsu-lab/alpaca_eval``,
judged against reference outputs by an LLM through the ``alpaca_eval`` package.

Instructions come from ``benchmark.data_file`` (a JSON list of objects with ``instruction``) or from
the hub (the dataset's loading script is refused by recent ``datasets``, so its ``alpaca_eval.json``
file is downloaded directly). Each is answered in the model's chat template with greedy decoding;
``model_outputs.json`` in alpaca_eval's format is written once all are done, then judged if
``benchmark.annotate`` (else ``python -m pcs.annotate RUN_DIR`` later).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..provenance import sha256_text
from .base import Benchmark, Sample

HUB_REPO = "tatsu-lab/alpaca_eval"
HUB_INSTRUCTIONS = "alpaca_eval.json"
HUB_REFERENCE = "alpaca_eval_gpt4_baseline.json"   # AlpacaEval 2.0's reference: GPT-4 Turbo's outputs


def hub_file(name: str) -> Path:
    from huggingface_hub import hf_hub_download
    return Path(hf_hub_download(HUB_REPO, name, repo_type="dataset"))


def read_records(path: Path, required: tuple[str, ...]) -> list[dict]:
    """A JSON list of objects holding ``required`` string fields; errors name the file and item."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of objects")
    for i, item in enumerate(data):
        missing = [k for k in required if not isinstance(item, dict) or not isinstance(item.get(k), str)]
        if missing:
            raise ValueError(f"{path}: item {i} lacks the string field(s) {missing}")
    return data


def generator_name(cfg) -> str:
    """Names model, method, selection and budget (and the trigger) for the leaderboard."""
    parts = [cfg.model.name, cfg.method.name]
    if cfg.method.name != "full":
        if cfg.method.name != "streamingllm":
            parts.append(cfg.selection.name)
        parts.append(f"b{cfg.budget}")
    if cfg.compress.trigger is not None:
        parts.append(f"trigger{cfg.compress.trigger}")
    return "-".join(parts)


class AlpacaEval(Benchmark):
    name = "alpacaeval"
    annotation_keys = ("judge", "annotate", "reference_file")   # change the judging, not the outputs

    def __init__(self, cfg):
        super().__init__(cfg)
        self.records: list[dict] = []

    def check(self) -> None:
        limit = self.cfg.limit
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"benchmark.limit={limit!r} must be a positive integer or null")
        if self.cfg.data_file:
            source = Path(self.cfg.data_file)
        else:
            try:
                source = hub_file(HUB_INSTRUCTIONS)
            except Exception as err:
                raise FileNotFoundError(f"cannot fetch {HUB_INSTRUCTIONS} of {HUB_REPO} from the hub ({err}); "
                                        f"pass benchmark.data_file=FILE, a JSON list of instructions") from None
        self.records = read_records(source, ("instruction",))[:limit]
        if self.cfg.annotate:
            from ..annotate import annotation_problems
            for problem in annotation_problems(self.cfg):
                print(f"[pcs] warning: {problem}")

    def data_hashes(self) -> dict:
        return {"instructions": sha256_text(json.dumps([r["instruction"] for r in self.records]))}

    def samples(self, tokenizer=None) -> list[Sample]:
        return [Sample(id=str(i), prompt=r["instruction"], max_new_tokens=self.cfg.max_new_tokens,
                       meta={"instruction": r["instruction"], "dataset": r.get("dataset", "")})
                for i, r in enumerate(self.records)]

    def score(self, meta: dict, prediction: str) -> None:
        return None   # judged pairwise over the whole set, not per sample

    def metrics(self, rows: list[dict]) -> dict:
        return {"score": None, "win_rate": None, "lc_win_rate": None,
                "avg_new_tokens": sum(r["new_tokens"] for r in rows) / len(rows)}

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        outputs = write_model_outputs(rows, generator_name(self.run_cfg), run_dir)
        if not self.cfg.annotate:
            print(f"[pcs] outputs in {outputs}; judge them with `python -m pcs.annotate {run_dir}`")
            return
        from ..annotate import annotate_run
        metrics.update(annotate_run(run_dir, self.cfg))


def write_model_outputs(rows: list[dict], generator: str, run_dir: Path) -> Path:
    path = Path(run_dir) / "model_outputs.json"
    outputs = [{"instruction": r["instruction"], "output": r["prediction"], "generator": generator,
                "dataset": r.get("dataset", "")} for r in rows]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outputs, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return path
