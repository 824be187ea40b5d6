#!/usr/bin/env python
"""Fetch LongBench v1's official data (data.zip from the hub dataset THUDM/LongBench) and unpack
one <task>.jsonl per task into --out, e.g. on a cluster login node with internet:

    python scripts/fetch_longbench.py --out /shared/longbench
    python run.py benchmark=longbench benchmark.data_dir=/shared/longbench

HF_ENDPOINT (a mirror) and HF_TOKEN are honoured by huggingface_hub.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pcs.benchmarks.longbench_data import (ALL_TASKS, HUB_FILE, HUB_REPO, default_data_dir, fetch,  # noqa: E402
                                           read_task, task_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_data_dir(), help="default: %(default)s")
    parser.add_argument("--revision", help="a hub commit of THUDM/LongBench, for a pinned copy")
    args = parser.parse_args()
    try:
        out = fetch(args.out, args.revision)
    except Exception as err:
        sys.exit(f"error: could not download {HUB_FILE} of the dataset {HUB_REPO} ({type(err).__name__}: {err})")
    for task in ALL_TASKS:
        print(f"{task:22s} {len(read_task(task_file(out, task), task)):5d} samples")
    print(f"LongBench data in {out}")


if __name__ == "__main__":
    main()
