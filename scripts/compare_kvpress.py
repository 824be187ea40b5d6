"""Prefill-plus-compression time of pcs against NVIDIA's kvpress on the same model and the same prompt,
the two implementations alternated in one measurement, so that drift of the machine falls on both alike.

kvpress 0.5.5 needs transformers<5.3 and pcs needs >=5.20, so kvpress runs in its own virtual
environment. Each implementation runs in a worker process that loads the model once and answers
timing requests on stdin; this driver (run with the project's Python) sends each request to both
workers in turn, alternating which goes first, and reports medians:

    make compare-kvpress          # builds .venv-kvpress (torch 2.13.0 CPU, kvpress 0.5.5), runs the defaults
    .venv/bin/python scripts/compare_kvpress.py --kvpress-python .venv-kvpress/bin/python \\
        --contexts 4096 8192 --repeats 3 [--json]

Same method on both sides: window 32, average pooling with kernel 7, budget counted with the window
(kvpress: ``compression_ratio = 1 - budget / context``); perturbation selection is kvpress's
CriticalKVPress / CriticalAdaKVPress (the same paper) with ``first_stage_ratio = alpha``; AdaKV's
floor is kvpress's ``alpha_safeguard``. kvpress's AdaKV masks evicted entries instead of removing
them, so its cache stays full size (its ``kv_bytes`` column shows it). KVzip and KVzip+ (``--methods kvzip
kvzip_plus``, attention selection) time the prefill with the model's repetition of its context on both sides:
kvpress's ``KVzipPress`` and pcs's ``profile=kvpress``, each reading the tokenizer's chat template.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WINDOW, KERNEL, ALPHA, FLOOR = 32, 7, 0.25, 0.2
KVZIP = {"kvzip": {}, "kvzip_plus": {"kvzip_plus_normalization": True}}     # KVzipPress's parameters per pcs method


def prompt_ids(context: int, vocab_size: int) -> list[int]:
    import torch
    generator = torch.Generator().manual_seed(context)
    return torch.randint(100, vocab_size - 100, (context,), generator=generator).tolist()


class PcsWorker:
    def __init__(self, model_dir: str):
        from pcs.bench.measure import composed
        from pcs.models import load_model
        self.compose = composed
        from pcs.bench.measure import bench_repeat
        self.model, _ = load_model(composed(model="smollm2", **{"model.path": model_dir, "model.device": "cpu"}).model)
        self.repeat = bench_repeat("smollm2", model_dir)     # KVzip's request to repeat the context

    def time(self, request: dict) -> dict:
        import torch
        from pcs.eviction import build_method
        from pcs.generate import greedy_generate
        overrides = {"method": request["method"], "budget": request["budget"]}
        if request["method"] in KVZIP:
            overrides |= {"selection": request["selection"], "profile": "kvpress"}
        elif request["method"] != "full":
            overrides |= {"selection": request["selection"], "method.window": WINDOW, "method.kernel": KERNEL,
                          "method.pooling": "avg"}
            overrides |= {"method.floor": FLOOR} if request["method"] == "adakv" else {}
            overrides |= {"selection.alpha": ALPHA} if request["selection"] == "perturbation" else {}
        method = build_method(self.compose(**overrides))
        gen = greedy_generate(self.model, torch.tensor([request["ids"]]), method, 1, set(), repeat=self.repeat)
        return {"seconds": gen.prefill_s, "kv_bytes": gen.kv_cache_bytes}


class KvpressWorker:
    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
        logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()

    def press(self, request: dict):
        import kvpress
        if request["method"] == "full":
            return None
        ratio = 1 - request["budget"] / len(request["ids"])
        if request["method"] in KVZIP:
            return kvpress.KVzipPress(compression_ratio=ratio, **KVZIP[request["method"]])
        scorer = kvpress.SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)
        perturbation = request["selection"] == "perturbation"
        if request["method"] == "snapkv":
            return kvpress.CriticalKVPress(scorer, first_stage_ratio=ALPHA) if perturbation else scorer
        if request["method"] == "adakv":
            if perturbation:
                return kvpress.CriticalAdaKVPress(scorer, alpha_safeguard=FLOOR, first_stage_ratio=ALPHA)
            return kvpress.AdaKVPress(scorer, alpha_safeguard=FLOOR)
        raise ValueError(f"no kvpress counterpart for {request['method']!r}")

    def time(self, request: dict) -> dict:
        import contextlib
        import torch
        from transformers import DynamicCache
        press, cache = self.press(request), DynamicCache()
        start = time.perf_counter()
        with torch.inference_mode(), (press(self.model) if press else contextlib.nullcontext()):
            self.model(input_ids=torch.tensor([request["ids"]]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
        seconds = time.perf_counter() - start
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return {"seconds": seconds, "kv_bytes": kv_bytes}


def serve(kind: str, model_dir: str) -> None:
    """Worker loop: one JSON request per stdin line, one JSON answer per stdout line."""
    worker = (PcsWorker if kind == "pcs" else KvpressWorker)(model_dir)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(worker.time(json.loads(line))), flush=True)


class Client:
    def __init__(self, python: str, kind: str, model_dir: str):
        self.kind = kind
        self.process = subprocess.Popen([python, __file__, "--worker", kind, "--model-dir", model_dir],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker exited (its error is above)")
        return json.loads(line)

    def time(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def configurations(methods, selections):
    yield "full", "none"
    for method in methods:
        for selection in ["attention"] if method in KVZIP else selections:
            yield method, selection


def compare(args) -> list[dict]:
    from pcs.bench.measure import composed
    from pcs.models import weights_location
    from transformers import AutoConfig
    model_dir = weights_location(composed(model="smollm2").model)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    clients = [Client(sys.executable, "pcs", model_dir), Client(args.kvpress_python, "kvpress", model_dir)]
    rows = []
    try:
        for context in args.contexts:
            ids = prompt_ids(context, vocab_size)
            for method, selection in configurations(args.methods, args.selections):
                request = {"method": method, "selection": selection, "budget": args.budget, "ids": ids}
                for client in clients:
                    client.time(request)                                  # warm-up
                seconds, kv_bytes = {client.kind: [] for client in clients}, {}
                for repeat in range(args.repeats):
                    for client in clients if repeat % 2 == 0 else clients[::-1]:
                        answer = client.time(request)
                        seconds[client.kind].append(answer["seconds"])
                        kv_bytes[client.kind] = answer["kv_bytes"]
                pcs_s, kvpress_s = statistics.median(seconds["pcs"]), statistics.median(seconds["kvpress"])
                row = {"context": context, "method": method, "selection": selection,
                       "budget": None if method == "full" else args.budget, "repeats": args.repeats,
                       "pcs_s": pcs_s, "kvpress_s": kvpress_s, "pcs_over_kvpress": pcs_s / kvpress_s,
                       "pcs_kv_bytes": kv_bytes["pcs"], "kvpress_kv_bytes": kv_bytes["kvpress"]}
                rows.append(row)
                print(json.dumps(row) if args.json else format_row(row), flush=True)
    finally:
        for client in clients:
            client.close()
    return rows


def format_row(row: dict) -> str:
    return (f"{row['context']:>6} {row['method']:<10} {row['selection']:<13} pcs {row['pcs_s']:7.2f} s  "
            f"kvpress {row['kvpress_s']:7.2f} s  pcs/kvpress {row['pcs_over_kvpress']:5.3f}  "
            f"KV MiB pcs {row['pcs_kv_bytes'] / 2**20:6.1f} kvpress {row['kvpress_kv_bytes'] / 2**20:6.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress-python", help="the Python of a virtual environment with kvpress installed")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--methods", nargs="+", default=["snapkv", "adakv"], choices=["snapkv", "adakv", *KVZIP])
    parser.add_argument("--selections", nargs="+", default=["attention", "perturbation"],
                        choices=["attention", "perturbation"])
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--worker", choices=["pcs", "kvpress"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve(args.worker, args.model_dir)
        return 0
    if not args.kvpress_python:
        parser.error("--kvpress-python is required (see the module docstring for the environment)")
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
