"""Entry point: ``python run.py [model=..] [method=..] [selection=..] [budget=..] [benchmark=..]``."""
import sys
from pathlib import Path

import hydra
import hydra._internal.utils as hydra_utils
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pcs.benchmarks.base import checked_benchmark
from pcs.config import check_named_selection, options
from pcs.errors import ConfigError
from pcs.identity import RunIdentity
from pcs.run_folder import RunFolder
from pcs.hydra_errors import arguments_in_one_line, reporting_in_one_line

# What Hydra itself rejects while composing (an unknown option or key, a missing +) is reported as pcs reports every
# user error: one line, exit 2 (hydra-core is pinned: pyproject.toml).
hydra_utils.run_and_report = reporting_in_one_line(hydra_utils.run_and_report)
sys.modules["hydra.main"].get_args_parser = arguments_in_one_line(hydra_utils.get_args_parser)
# --help lists each group's options as the config tree holds them (pcs/conf/hydra/help/pcs.yaml).
OmegaConf.register_new_resolver("pcs_options", lambda group: ", ".join(options(group)), replace=True)


@hydra.main(version_base="1.3", config_path="pcs/conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.RUN:      # one run: what its command line names must mean something
            check_named_selection(cfg, list(hydra_cfg.overrides.task))
        benchmark = checked_benchmark(cfg)   # before torch and transformers load: a user's error is reported at once
        identity = RunIdentity(cfg)
        RunFolder(Path(cfg.results_dir) / identity.folder, identity=identity).check()
        from pcs.runner import run
        run(cfg, benchmark)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def showing_a_sweep(argv: list[str]) -> bool:
    multirun = any(a in ("-m", "--multirun") for a in argv)
    return multirun and any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in argv)


def config_of_a_sweep(argv: list[str]) -> list[str]:
    """Hydra refuses ``-m`` together with ``--cfg``; showing a sweep's config needs no launch, so
    ``python run.py -m experiment=table1 hydra/launcher=slurm --cfg hydra`` drops the ``-m``, and the
    command line's swept values (``method=snapkv,adakv``), which only a sweep accepts: the config shown is
    the one every cell starts from, as for an experiment's ``hydra.sweeper.params``; the jobs that follow
    name each cell."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()

    def swept(arg: str) -> bool:
        if arg.startswith("-") or "=" not in arg:
            return False
        return parser.parse_override(arg).is_sweep_override()
    return [a for a in argv if a not in ("-m", "--multirun") and not swept(a)]


def jobs_of_a_sweep(argv: list[str]) -> list[str]:
    """The same sweep as a dry run of its launcher: the jobs it would launch, each run in them."""
    kept, skip = [], False
    for a in argv:
        if skip or a.startswith("--cfg=") or a.startswith("--package="):
            skip = False
            continue
        if a in ("--cfg", "-c", "--package", "-p"):
            skip = True
            continue
        kept.append(a)
    return kept + ["++hydra.launcher.dry_run=true"]


if __name__ == "__main__":
    if showing_a_sweep(sys.argv):
        argv = sys.argv
        sys.argv = config_of_a_sweep(argv)
        main()
        if "hydra/launcher=basic" not in argv:     # Hydra's own launcher has no dry run
            GlobalHydra.instance().clear()
            sys.argv = jobs_of_a_sweep(argv)
            main()
    else:
        main()
