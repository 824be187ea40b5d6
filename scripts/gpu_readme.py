"""Puts a GPU bench file's table (``python -m pcs.bench --report``) into results/bench/README.md, in a section of
its own per device that a later run of the same device replaces.

    .venv/bin/python scripts/gpu_readme.py results/bench/gpu_NVIDIA_H100_80GB_HBM3.jsonl
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcs.paths import read_jsonl          # noqa: E402

README = Path(__file__).resolve().parents[1] / "results" / "bench" / "README.md"


HOW = "`bash scripts/gpu_check.sh`"


def section(path: Path, device: str, report: str, how: str = HOW) -> str:
    return (f"<!-- gpu {device} -->\n## {path.name}: Llama-3.1-8B shapes on {device.replace('_', ' ')}\n\n"
            f"Written by {how} (random bfloat16 weights, 32 layers; medians over each row's "
            f"`repeats` rounds).\n\n{report}\n<!-- /gpu {device} -->")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a gpu_<device>.jsonl written by scripts/gpu_check.sh")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--how", default=HOW, help="the command that wrote the rows, for the section's first line")
    args = parser.parse_args(argv)
    rows = read_jsonl(args.results)
    if not rows:
        sys.exit(f"{args.results}: no rows")
    device = re.sub(r"[^A-Za-z0-9]+", "_", rows[0]["device_name"]).strip("_")
    report = subprocess.run([sys.executable, "-m", "pcs.bench", "--report", str(args.results)], check=True,
                            capture_output=True, text=True).stdout
    begin, end = f"<!-- gpu {device} -->", f"<!-- /gpu {device} -->"
    text = args.readme.read_text()
    new = section(args.results, device, report, args.how)
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: new, text, flags=re.S) if begin in text \
        else text.rstrip("\n") + "\n\n" + new + "\n"
    args.readme.write_text(text)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
