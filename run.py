"""Entry point: ``python run.py [model=..] [method=..] [selection=..] [budget=..] [benchmark=..]``."""
import sys

import hydra
from omegaconf import DictConfig

from pcs.config import ConfigError
from pcs.runner import run


@hydra.main(version_base="1.3", config_path="pcs/conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def allow_showing_a_sweep(argv: list[str]) -> list[str]:
    """Hydra refuses ``-m`` together with ``--cfg``; showing a sweep's config needs no launch, so
    ``python run.py -m experiment=table1 hydra/launcher=slurm --cfg hydra`` drops the ``-m``."""
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in argv):
        return [a for a in argv if a not in ("-m", "--multirun")]
    return argv


if __name__ == "__main__":
    sys.argv = allow_showing_a_sweep(sys.argv)
    main()
