"""Entry point: ``python run.py [model=..] [method=..] [selection=..] [budget=..] [benchmark=..]``."""
import sys

import hydra
from omegaconf import DictConfig

from pcs.config import ConfigError
from pcs.runner import run


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
