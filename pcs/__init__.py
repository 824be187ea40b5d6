"""pcs: a benchmark harness for KV-cache eviction with perturbation-constrained selection."""
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"   # the Hydra config tree
