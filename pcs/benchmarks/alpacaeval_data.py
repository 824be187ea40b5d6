"""AlpacaEval's files: the instructions and reference outputs of ``tatsu-lab/alpaca_eval`` (a local JSON
list, or the hub), and the model outputs in alpaca_eval's format."""
from __future__ import annotations

import json
from pathlib import Path

from ..paths import write_atomic

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


def write_model_outputs(rows: list[dict], generator: str, run_dir: Path) -> Path:
    path = Path(run_dir) / "model_outputs.json"
    outputs = [{"instruction": r["instruction"], "output": r["prediction"], "generator": generator,
                "dataset": r.get("dataset", "")} for r in rows]
    write_atomic(path, json.dumps(outputs, indent=2, ensure_ascii=False))
    return path
