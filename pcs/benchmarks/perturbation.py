"""Perturbation analysis as a benchmark: how far each selection moves head and layer outputs at the
first decoding token, compared on the same contexts (the paper's Figures 2 to 6).

Contexts: needle-test haystacks (Paul Graham's essays from different starting points, the needle
in the middle, the needle question after them), or the first samples of a LongBench task (the paper
uses Qasper) with the official prompt and truncation. ``benchmark.selections`` lists the variants:
the first is the baseline (attention), the second the candidate; ``name:key=value,...`` adds a
variant with changed knobs, e.g. ``perturbation:alpha=0.0``; ``method/selection`` uses another method
(``adakv/perturbation``), and ``laprox[:key=value,...]`` compares LaProx.

``score`` = 100 x ``heads_improved_frac``: the share of (layer, query head) pairs whose perturbation,
averaged over the contexts, is lower with the candidate than with the baseline.
"""
from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from ..eviction import METHODS_WITHOUT_SELECTION, build_method
from ..generate import full_kv_bytes
from ..perturbation import measure, run_prefill
from ..provenance import sha256_files, sha256_text
from .base import Benchmark, RunContext, Sample
from .longbench import LongBench
from .needle import PROMPT, default_haystack_dir, insert_needle, repeat_to

from .. import CONF_DIR
WINDOW_METHODS = ("snapkv", "pyramidkv", "adakv")


def load_group(group: str, name: str, text: str):
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"benchmark.selections: no {group} {name!r} (from {text!r})")
    return OmegaConf.load(path)


def parse_variant(text: str, run_method) -> dict:
    """A variant label -> the ``method`` and ``selection`` configs it runs with:
    ``selection[:key=value,...]`` (the run's method), ``method/selection[:...]`` (another method with
    its default knobs), or ``method[:...]`` for a method that needs no selection (e.g. ``laprox``;
    the changes then apply to the method)."""
    spec, _, changes = str(text).partition(":")
    method_name, _, name = spec.rpartition("/")
    if not method_name and name in METHODS_WITHOUT_SELECTION:
        method, selection, changed = load_group("method", name, text), None, "method"
    else:
        method = load_group("method", method_name, text) if method_name else run_method
        selection, changed = load_group("selection", name, text), "selection"
    if method.name not in WINDOW_METHODS + ("laprox",):
        raise ValueError(f"benchmark.selections: {text!r} uses method {method.name}; the analysis compares "
                         f"{', '.join(WINDOW_METHODS)} and laprox")
    target = method if changed == "method" else selection
    for change in filter(None, changes.split(",")):
        key, _, value = change.partition("=")
        if key not in target or key == "name":
            raise ValueError(f"benchmark.selections: {text!r} changes {key!r}, not a knob of {changed} {target.name}")
        target[key] = yaml.safe_load(value)
    return {"method": method, **({"selection": selection} if selection is not None else {})}


class Perturbation(Benchmark):
    name = "perturbation"
    uses_selection = False   # it compares the selections listed in benchmark.selections

    def __init__(self, cfg):
        super().__init__(cfg)
        self.labels = [str(s) for s in self.cfg.selections]
        self.budgets = sorted(set(self.cfg.budgets) | {cfg.budget})
        self.longbench = None

    @cached_property
    def methods(self) -> dict:
        """(variant label, budget) -> method, built once for all samples."""
        return {(label, b): self.method_for(label, b) for label in self.labels for b in self.budgets}

    def method_for(self, label: str, budget: int):
        return build_method(self.config_with(budget=budget, **parse_variant(label, self.run_cfg.method)))

    def config_with(self, **groups):
        """A copy of the run's config with some top-level entries replaced."""
        cfg = OmegaConf.to_container(self.run_cfg, resolve=True)
        cfg.update({k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in groups.items()})
        return OmegaConf.create(cfg)

    def check(self) -> None:
        if self.run_cfg.method.name not in WINDOW_METHODS:
            raise ValueError(f"benchmark=perturbation compares selections, so it needs method= one of "
                             f"{', '.join(WINDOW_METHODS)}, not {self.run_cfg.method.name}")
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"benchmark.selections={self.labels}: give at least two different variants")
        window = max(parse_variant(label, self.run_cfg.method)["method"].window for label in self.labels)
        if any(b < window for b in self.budgets):
            raise ValueError(f"benchmark.budgets {list(self.cfg.budgets)}: each must hold the window ({window})")
        if self.cfg.source == "longbench":
            longbench = OmegaConf.load(CONF_DIR / "benchmark" / "longbench.yaml")
            longbench.update(tasks=[self.cfg.task], limit=self.cfg.n_samples, data_dir=self.cfg.data_dir)
            self.longbench = LongBench(self.config_with(benchmark=longbench))
            self.longbench.check()
        elif self.cfg.source != "needle":
            raise ValueError(f"benchmark.source={self.cfg.source!r}; choose needle or longbench")

    def data_hashes(self) -> dict:
        if self.longbench is not None:
            return self.longbench.data_hashes()
        return {"haystack": sha256_files(default_haystack_dir().glob("*.txt")), "prompt": sha256_text(PROMPT)}

    def samples(self, tokenizer) -> list[Sample]:
        if self.longbench is not None:
            return self.longbench.samples()
        essays = "\n\n".join(p.read_text() for p in sorted(default_haystack_dir().glob("*.txt")))
        haystack = tokenizer.encode(essays, add_special_tokens=False)
        needle = tokenizer.encode(" " + self.cfg.needle.strip(), add_special_tokens=False)
        out = []
        for i in range(self.cfg.n_samples):
            start = i * len(haystack) // self.cfg.n_samples
            body = repeat_to(haystack[start:] + haystack[:start], self.cfg.context_length - len(needle))
            context = tokenizer.decode(insert_needle(body, needle, 50, tokenizer)).strip()
            out.append(Sample(id=f"haystack{i}", prompt=PROMPT.format(context=context, question=self.cfg.question),
                              max_new_tokens=1, meta={"haystack_start": start}))
        return out

    def encode(self, sample, tokenizer, model_cfg):
        if self.longbench is not None:
            return self.longbench.encode(sample, tokenizer, model_cfg)
        return super().encode(sample, tokenizer, model_cfg)

    def run_sample(self, sample: Sample, ctx: RunContext) -> dict:
        main = ctx.cfg.budget
        candidate = self.labels[1]
        methods = self.methods
        assumption = next((m for (label, b), m in methods.items()
                           if b == main and hasattr(getattr(m, "selection", None), "stage1")), None)
        ids = self.encode(sample, ctx.tokenizer, ctx.cfg.model).context
        start = time.perf_counter()
        prefill = run_prefill(ctx.model, ids, methods, assumption)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        result = measure(ctx.model, prefill, [(label, main) for label in self.labels], list(methods))
        decode_s = time.perf_counter() - start
        base, cand = result.headwise[(self.labels[0], main)], result.headwise[(candidate, main)]
        decode = ctx.tokenizer.decode
        return {
            "prediction": decode([prefill.first_token]),
            "score": 100 * float((cand < base).float().mean()),
            "prompt_tokens": prefill.n_tokens, "new_tokens": 1,
            "kv_cache_bytes": result.kv_bytes[(candidate, main)],
            "kv_cache_bytes_full": full_kv_bytes(ctx.model.config, prefill.n_tokens, ctx.model.dtype),
            "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
            # The first token comes from the (uncompressed) prefill; the next is the first the cache can change.
            "next_token_full": decode([result.next_token_full]),
            "next_tokens": {label: decode([result.next_tokens[(label, main)]]) for label in self.labels},
            "headwise": {label: result.headwise[(label, main)].tolist() for label in self.labels},
            "layerwise": {label: result.layerwise[(label, main)].tolist() for label in self.labels},
            "final_layer": {label: {str(b): float(result.layerwise[(label, b)][-1]) for b in self.budgets}
                            for label in self.labels},
            "assumption1": nan_to_none(result.assumption1),
            "assumption1_without_window": nan_to_none(result.assumption1_prefix),
        }

    def score(self, meta: dict, prediction: str) -> float:
        return meta["score"]

    def metrics(self, rows: list[dict]) -> dict:
        from .perturbation_metrics import summarize
        return summarize(rows, self.labels, self.budgets, self.run_cfg.budget)

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        from ..report.perturbation_figures import write_figures
        write_figures(rows, metrics, run_dir)


def nan_to_none(t: torch.Tensor) -> list:
    return [[None if v != v else round(float(v), 6) for v in row] for row in t.tolist()]
