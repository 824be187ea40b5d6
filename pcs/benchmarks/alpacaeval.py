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
from pathlib import Path

from ..errors import ConfigError
from ..identity import RunIdentity
from ..provenance import sha256_text
from .alpacaeval_data import HUB_INSTRUCTIONS, HUB_REPO, hub_file, read_records, write_model_outputs
from .alpacaeval_judge import annotate_run, annotation_problems
from .base import Benchmark, Sample


class AlpacaEval(Benchmark):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.records: list[dict] = []

    def check(self) -> None:
        if not self.run_cfg.model.chat_template:
            raise ConfigError(f"benchmark=alpacaeval answers instructions in a chat model's template; "
                              f"model={self.run_cfg.model.name} is a pretrained model (model.chat_template=false)")
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
            for problem in annotation_problems(self.cfg):
                print(f"[pcs] warning: {problem}")

    def data_hashes(self) -> dict:
        return {"instructions": sha256_text(json.dumps([r["instruction"] for r in self.records]))}

    def samples(self, tokenizer=None) -> list[Sample]:
        return [Sample(id=str(i), prompt=r["instruction"], max_new_tokens=self.cfg.max_new_tokens,
                       meta={"instruction": r["instruction"], "dataset": r.get("dataset", "")})
                for i, r in enumerate(self.records)]

    def score(self, row: dict) -> None:
        return None   # judged pairwise over the whole set, not per sample

    def metrics(self, rows: list[dict]) -> dict:
        return {"score": None, "win_rate": None, "lc_win_rate": None,
                "avg_new_tokens": sum(r["new_tokens"] for r in rows) / len(rows)}

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        outputs = write_model_outputs(rows, RunIdentity(self.run_cfg).generator, run_dir)
        if not self.cfg.annotate:
            print(f"[pcs] outputs in {outputs}; judge them with `python -m pcs.annotate {run_dir}`")
            return
        metrics.update(annotate_run(run_dir, self.cfg))
