"""Greedy answers of pcs (profile=kvpress) against NVIDIA kvpress 0.5.5's, token for token, on RULER samples.

    make conformance-answers    # kvpress in its own environment (.venv-kvpress), as make conformance
    .venv/bin/python scripts/kvpress_answers.py --kvpress-python .venv-kvpress/bin/python [--samples 2]

scripts/conformance.py checks that both keep the same entries; this checks what is built on them: the answer
decoded on the compressed cache. pcs decodes on its own cache (per-head buffers, one attention call per layer);
kvpress on transformers' DynamicCache with the evicted entries removed (score-based presses) or masked (AdaKV
presses), its question and answer fed as its pipeline's ``generate_answer`` feeds them (positions continue from
the uncompressed context). On the embedded model, RULER niah_single_1/2/3 at 2,048 tokens (the first samples of
each), with the question compressed with the context (budgets 256, 512) and fed after compression (1,024,
1,536), as the reference sweep of results/embedded/ruler; SnapKV, AdaKV, CriticalKV, CriticalAdaKV, Expected
Attention, observed attention, LagKV, CUR, ChunkKV, KVzip and KVzip+ (``--cases``: any of scripts/conformance.py's;
``--merge`` keeps the other cases' rows). Writes results/conformance/answers.csv and answers.md; exits 1 if any
answer differs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from conformance import (CASES, EAGER, FLOOR, PRESSES, ROOT, SCORED, KvpressWorker, arguments, earlier_rows,
                         embedded_model, kvpress_press, write_csv)

WINDOW, KERNEL = 32, 7
ANSWER_CASES = ["snapkv", "adakv", "criticalkv", "criticaladakv", "expected_attention", "observed_attention", "lagkv",
                "cur", "chunkkv", "kvzip", "kvzip_plus"]
SETTINGS = {"question inside": (True, [256, 512]), "question after": (False, [1024, 1536])}


# ---- kvpress side (runs in kvpress's environment; imports nothing from pcs) ----

def kvpress_worker(model_dir: str) -> None:
    """Reads requests (JSON lines), answers each with kvpress's greedy answer tokens."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    transformers.utils.logging.disable_progress_bar()
    models = {kind: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=kind).eval()
              for kind in ("sdpa", "eager")}   # eager where the press reads attention weights
    for line in sys.stdin:
        request = json.loads(line)
        model = models["eager" if request["case"] in EAGER else "sdpa"]
        context = torch.tensor([request["context"]])
        press = kvpress_press(request["case"], request["ratio"], request["window"], request["kernel"])
        cache = DynamicCache()
        with torch.inference_mode():
            with press(model):
                logits = model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            position = context.shape[1]
            if request["question"]:            # kvpress's pipeline: the question on the compressed cache
                question = torch.tensor([request["question"]])
                positions = torch.arange(position, position + question.shape[1])[None]
                logits = model(input_ids=question, past_key_values=cache, position_ids=positions,
                               logits_to_keep=1).logits
                position += question.shape[1]
            tokens = []
            while len(tokens) < request["max_new_tokens"]:
                token = int(logits[0, -1].argmax())
                if token in request["stops"]:
                    break
                tokens.append(token)
                logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                               position_ids=torch.tensor([[position]])).logits
                position += 1
        print(json.dumps({"tokens": tokens}), flush=True)


# ---- pcs side ----

EAGER_PREFILL = "pcs_eager_prefill"


def register_eager_prefill() -> None:
    """pcs's attention, except that a dense forward (the prefill) is transformers' eager attention: the prefill
    kvpress's worker runs for a press that reads attention weights, whose keys differ from SDPA's in the last bits
    (enough to move an entry at a near-tie); decoding still reads pcs's compressed cache."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward
    from pcs.cache import HeldKeys, held_attention

    def attention(module, query, key, value, attention_mask, **kwargs):
        forward = held_attention if isinstance(key, HeldKeys) else eager_attention_forward
        return forward(module, query, key, value, attention_mask, **kwargs)
    AttentionInterface.register(EAGER_PREFILL, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER_PREFILL, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def pcs_answers(model, prompt, methods: dict, sample, stops: set[int], repeat) -> dict[str, list[int]]:
    """Each method's greedy answer, as a run generates it: one shared prefill for the methods kvpress runs on SDPA,
    another, eager, for those whose press reads attention weights (``register_eager_prefill``); ``repeat``: the
    model's request to repeat a context (KVzip's)."""
    import torch
    from pcs.generate import greedy_generate_each
    from pcs.models import ATTN_IMPLEMENTATION
    question = None if prompt.question is None else torch.tensor([prompt.question])
    answers = {}
    for kind in (ATTN_IMPLEMENTATION, EAGER_PREFILL):
        mine = {key: m for key, m in methods.items() if (key[0] in EAGER) == (kind == EAGER_PREFILL)}
        if not mine:
            continue
        model.set_attn_implementation(kind)
        generations = greedy_generate_each(model, torch.tensor([prompt.context]), list(mine.values()),
                                           sample.max_new_tokens, stops, question_ids=question, repeat=repeat)
        answers.update({key: g.token_ids for key, g in zip(mine, generations)})
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return answers


def compare(args) -> list[dict]:
    from pcs.config import compose
    from pcs.eviction import build_method
    from pcs.eviction.conventions import kvpress_ratio
    from pcs.models import stop_token_ids
    from pcs.benchmarks.base import checked_benchmark
    from pcs.prompts import repeat_prompt
    model_cfg, model, tokenizer = embedded_model()
    repeat = repeat_prompt(tokenizer, model_cfg)     # KVzipPress's, from the tokenizer's chat template
    register_eager_prefill()
    worker = KvpressWorker(args.kvpress_python, __file__, model_cfg)
    rows = []
    for setting, (query_aware, budgets) in SETTINGS.items():
        cfg = compose(["benchmark=ruler", "benchmark.tasks=[niah_single_1,niah_single_2,niah_single_3]",
                       "benchmark.lengths=[2048]", f"benchmark.n_samples={args.samples}",
                       f"benchmark.query_aware={str(query_aware).lower()}"])
        benchmark = checked_benchmark(cfg)
        methods = {}
        for case in args.cases:
            method_name, overrides = CASES[case]
            knobs = [] if case in SCORED else [f"method.window={WINDOW}", f"method.kernel={KERNEL}", "method.pooling=avg"]
            knobs += [f"method.floor={FLOOR}"] if method_name == "adakv" else []
            for budget in budgets:
                methods[case, budget] = build_method(compose([f"method={method_name}", f"budget={budget}",
                                                              "profile=kvpress"] + overrides + knobs))
        for sample in benchmark.samples(tokenizer):
            prompt = benchmark.encode(sample, tokenizer, model_cfg)
            stops = stop_token_ids(model, tokenizer) | {tokenizer.encode(t, add_special_tokens=False)[-1]
                                                        for t in sample.stop_texts}
            ours = pcs_answers(model, prompt, methods, sample, stops, repeat)
            for (case, budget), tokens in ours.items():
                # A budget of the whole context keeps everything in pcs; kvpress refuses a negative ratio.
                ratio = max(0.0, kvpress_ratio(budget, len(prompt.context)))
                theirs = worker.ask({"context": prompt.context, "question": prompt.question, "case": case,
                                     "ratio": ratio, "window": WINDOW, "kernel": KERNEL, "stops": sorted(stops),
                                     "max_new_tokens": sample.max_new_tokens})["tokens"]
                row = {"setting": setting, "sample": sample.id, "pcs": case, "kvpress": PRESSES[case],
                       "budget": budget, "identical": tokens == theirs,
                       "answer_pcs": tokenizer.decode(tokens), "answer_kvpress": tokenizer.decode(theirs),
                       "score_pcs": benchmark.score({**sample.meta, "prediction": tokenizer.decode(tokens)}),
                       "score_kvpress": benchmark.score({**sample.meta, "prediction": tokenizer.decode(theirs)})}
                rows.append(row)
                print(f"{setting:<16} {sample.id:<22} {case:<14} b{budget:<5} "
                      f"{'same' if row['identical'] else 'DIFFERENT'}  pcs {row['answer_pcs']!r}  "
                      f"kvpress {row['answer_kvpress']!r}", flush=True)
    worker.close()
    return rows


def write(rows: list[dict], out: Path) -> None:
    write_csv(rows, out / "answers.csv")
    lines = ["# Answers: pcs (profile=kvpress) against NVIDIA kvpress 0.5.5", "",
             "Greedy answers decoded on the compressed cache, token for token, on the embedded SmolLM2 and RULER",
             "samples at 2,048 tokens; written by `make conformance-answers` (scripts/kvpress_answers.py).", "",
             "| setting | pcs | kvpress press | budget | answers | identical | RULER score pcs / kvpress |",
             "|---|---|---|---:|---:|---:|---|"]
    for setting, (_, budgets) in SETTINGS.items():
        for case in [c for c in CASES if any(r["pcs"] == c for r in rows)]:
            for budget in budgets:
                mine = [r for r in rows if (r["setting"], r["pcs"], r["budget"]) == (setting, case, budget)]
                mean = lambda key: sum(r[key] for r in mine) / len(mine)
                lines.append(f"| {setting} | {case} | {PRESSES[case]} | {budget} | {len(mine)} | "
                             f"{sum(r['identical'] for r in mine)} | {mean('score_pcs'):.1f} / {mean('score_kvpress'):.1f} |")
    lines += ["", "Samples: " + ", ".join(sorted({r["sample"] for r in rows})) + f". Window {WINDOW}, kernel {KERNEL},",
              "average pooling (the scorers: their presses' own); kvpress's compression ratio is 1 - budget / context tokens (0, nothing evicted, where",
              "the budget is the whole context: at 1,536 with the question after, the essay tasks' ~1,320 tokens).", ""]
    (out / "answers.md").write_text("\n".join(lines))


def main() -> int:
    def add_arguments(parser):
        parser.add_argument("--samples", type=int, default=2, help="the first samples of each task")
        parser.add_argument("--cases", nargs="+", choices=list(CASES), default=ANSWER_CASES)
        parser.add_argument("--merge", action="store_true", help="keep the other cases' rows of --out's answers.csv")
    args = arguments(__doc__, kvpress_worker, add_arguments)
    if args is None:
        return 0
    rows = compare(args)
    if args.merge:
        rows = earlier_rows(args.out / "answers.csv", args.cases) + rows
    write(rows, args.out)
    different = [r for r in rows if not r["identical"]]
    print(f"[pcs] answers: {len(rows) - len(different)} of {len(rows)} identical; {args.out / 'answers.md'}")
    return 1 if different else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
