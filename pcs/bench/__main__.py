"""What each method and selection costs and saves: prefill-plus-compression time, decode speed on the
compressed cache against the memory-traffic bound, KV bytes and peak memory.

    python -m pcs.bench --model smollm2 --contexts 4096 8192 --methods snapkv adakv \\
        --selections attention perturbation --budgets 128 --repeats 3 [--decode-tokens 32] [--json]
    python -m pcs.bench --model llama31-shape --layers 32 --contexts 8192 32768 131072 --device cuda  # random weights
    python -m pcs.bench --perturbation-analysis --model llama31-shape --layers 32 --contexts 32768 --device cuda
    python -m pcs.bench --model smollm2 --contexts 2048 4096 --methods snapkv pyramidkv adakv streamingllm laprox \
        --budgets 128 1024 --pools 1 8 32 --repeats 1 --json        # decode pools: tokens/s and ms per step
    python -m pcs.bench --decode --model llama31-shape --layers 32 --contexts 8192 32768 --budgets 128 1024 \
        --pools 1 8 64 --decode-tokens 16 --json         # decoding steps against their memory-traffic bound
    python -m pcs.bench --report results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl    # its table and the targets
    python -m pcs.bench --project experiment=table1 --bench results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl

One process, random prompt tokens, a warm-up of every configuration, then ``--repeats`` rounds that
each measure every configuration once (drift falls on all alike); medians. The full cache is always
measured first, as the baseline of ``decode_speedup`` and ``decode_bound``:
``decode_bound = (weight bytes + full KV bytes) / (weight bytes + kept KV bytes)``, the speed-up a
decoding step limited by memory traffic would get from the smaller cache. ``--report`` reads a results file
against the engine's targets (pcs/bench/targets.yaml).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli import command

def budget_arg(text: str) -> int | float:
    from ..budget import from_text
    from ..errors import ConfigError
    try:
        return from_text(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse(argv=None):
    parser = command("pcs.bench", __doc__)
    parser.add_argument("--model", default="smollm2", help="an option of pcs/conf/model, or llama31-shape (random weights)")
    parser.add_argument("--model-path", help="local transformers weights for --model's config")
    parser.add_argument("--layers", type=int, default=4, help="llama31-shape: number of layers")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192],
                        help="prompt lengths in tokens, each measured on its own random prompt (default 4096 8192)")
    parser.add_argument("--methods", nargs="+", default=["snapkv", "adakv"],
                        help="options of pcs/conf/method (default snapkv adakv); the full cache is always measured")
    parser.add_argument("--selections", nargs="+", default=["attention", "perturbation"],
                        help="options of pcs/conf/selection, for the methods that take one (default attention "
                             "perturbation)")
    parser.add_argument("--budgets", type=budget_arg, nargs="+", default=[128], help="entries per KV head, or a "
                        "fraction in (0, 1): that share of each prompt, as budget= reads it (default 128)")
    parser.add_argument("--presets", nargs="+", default=[], help="also each method under these presets (e.g. "
                        "criticalkv), with attention selection and the preset's own")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, each measuring every configuration "
                        "once, after one warm-up (default 3; rows report medians and each round)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per configuration and "
                        "round (default 32; decode targets read rows of at least 8)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where it is available")
    parser.add_argument("--pools", type=int, nargs="+", default=[], help="also decode with pools of these many "
                        "sequences (copies of the prompt's compressed cache): ms per step and tokens per second")
    parser.add_argument("--eager", action="store_true", help="on CUDA, pools decode without CUDA graphs")
    parser.add_argument("--layers-behind", type=int, help="on CUDA, how many layers behind the forward each layer is "
                        "compressed, on a stream of its own (0: right after its own forward, on the forward's stream; "
                        "default: engine.layers_behind in pcs/conf/config.yaml)")
    parser.add_argument("--value-norm-kernel", action=argparse.BooleanOptionalAction, help="on CUDA, stage 2's "
                        "exact norms from pcs.kernels.value_norms's one kernel, or (--no-value-norm-kernel) from "
                        "batched products (default: engine.stage2.value_norm_kernel); rows say which in "
                        "value_norm_kernel, and the report pairs only rows alike")
    parser.add_argument("--decode-kernel", action=argparse.BooleanOptionalAction, help="on CUDA, a pool's "
                        "decoding attention through pcs.kernels.decode_attention (each row's own entries), or "
                        "(--no-decode-kernel) one masked SDPA call over the padded capacity (default: "
                        "engine.decode_kernel); --decode rows say which in decode_kernel")
    parser.add_argument("--compile-step", action=argparse.BooleanOptionalAction, help="on CUDA, the decoding "
                        "step's forward compiled by torch.compile, or (--no-compile-step) as transformers runs it "
                        "(default: engine.compile_step); --decode rows say which in compiled")
    parser.add_argument("--stage2-search", choices=["auto", "bounded", "exhaustive"], help="on an accelerator, "
                        "stage 2 bounds its norms and scores the entries the bounds leave (bounded), scores every "
                        "entry (exhaustive; the same entries are kept), or (auto) scores every entry in layers "
                        "shorter than engine.stage2.exhaustive_below and bounds longer ones until a prompt's bounds "
                        "prove loose (pcs/options.py). Default: engine.stage2.search; rows say which search they "
                        "started with in stage2_search and, under auto, how much of it scored every entry in "
                        "stage2_every_entry_share")
    parser.add_argument("--project", metavar="OVERRIDE", nargs="+", help="print the GPU-hours a sweep would take "
                        "(e.g. experiment=table1), from --bench's measured costs; measures nothing")
    parser.add_argument("--bench", metavar="JSONL", help="--project: the bench results to project from")
    parser.add_argument("--decode-bench", metavar="JSONL", help="--project: price decoding from these --decode rows "
                        "(graph-captured steps, batch 1 and the mixed pool) instead of --bench's")
    parser.add_argument("--tokens-per-word", type=float, default=1.3, help="--project: prompt tokens per word "
                        "where the benchmark gives lengths in words")
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--perturbation-analysis", action="store_true", help="time the perturbation analysis "
                        "(benchmark=perturbation) instead: --methods[0] with --selections at --budgets")
    parser.add_argument("--decode", action="store_true", help="time decoding steps instead (pcs/bench/decode.py): "
                        "the full cache and --methods x --budgets as pools of --pools copies, and a mixed pool, each "
                        "against its bound (weights and the rows' own entries over the copy bandwidth measured in "
                        "the same process); on CUDA with and without graphs (--eager: without only)")
    parser.add_argument("--report", metavar="JSONL", help="print a results file's markdown table and the engine's "
                        "targets read off it, and measure nothing")
    parser.add_argument("--profile", metavar="DIR", help="also profile one prefill per configuration "
                        "(torch.profiler op table into DIR; compress_share = time under pcs.compress)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    # What each mode needs loads only once the arguments are read: --help, --report and --project need no torch.
    if args.report:
        from ..paths import read_jsonl
        from .tables import decode_rows, decode_table, decode_targets, markdown, pool_table, selection_table, targets
        rows = read_jsonl(Path(args.report))
        decoded = decode_rows(rows)
        if decoded:
            print(decode_table(decoded) + "\n\n" + "\n".join(f"- {line}" for line in decode_targets(decoded)))
            return 0
        pools, selections = pool_table(rows), selection_table(rows)
        print(markdown(rows) + "\n\n" + (pools + "\n\n" if pools else "") + (selections + "\n\n" if selections else "")
              + "\n".join(f"- {line}" for line in targets(rows)))
        return 0
    if args.project:
        from ..projection import project
        if not args.bench:
            raise SystemExit("--project needs --bench JSONL: the measured costs to project from")
        if args.decode_bench and args.pools:
            raise SystemExit("--pools has no effect with --decode-bench: its mixed pools set the pool")
        print(project(args.project, args.bench, max(args.pools) if args.pools else None, args.tokens_per_word,
                      args.decode_bench))
        return 0
    if args.decode:
        from .decode import run as decode
        decode(args)
        return 0
    from .measure import analysis, run
    analysis(args) if args.perturbation_analysis else run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
