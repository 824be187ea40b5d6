"""pcs's Hydra launchers: a sweep runs as one job per group of runs that can share each sample's prefill
(``pcs.sweep.plan``) and per shard of its samples (``shards=N``: N jobs per group, each answering every N-th
sample, the run's results written once all are done), in this process (``hydra/launcher=local``, the default,
one job after another), as a SLURM job array (``hydra/launcher=slurm``) or as local submitit jobs
(``hydra/launcher=local_jobs``). ``dry_run=true`` prints the jobs and runs nothing. Hydra's own
``hydra/launcher=basic`` runs one run at a time, unshared."""

import copy
import functools
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from hydra._internal.config_loader_impl import get_overrides_dirname
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.plugins.launcher import Launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from pcs.config import positive_int, split_overrides, values_set
from pcs.errors import ConfigError
from pcs.slurm_queue import ENDED_STATES, queue_states
from pcs.sweep import check, describe, left_unfinished, plan



class ComposedOnce:
    """Hydra's sweeper composes each cell's config to check it, then hands the launcher only the cell's overrides,
    to compose again (a quarter of a second a cell). Installed as the config loader's ``load_sweep_config`` by the
    launcher's ``setup``, this keeps the sweeper's composition for the launcher's ``cell_config``, which takes it
    (and the launcher owns it from then on). Cells that choose the same options and differ in plain values
    (``budget=256``) are composed once: each is a copy with its values set as ``pcs.config.compose`` sets them and
    its overrides recorded in the ``hydra`` node as Hydra records them (``tests/test_sweeps.py`` holds the two equal).
    Pickled with a submitted job as the plain loader (the job carries its configs and composes nothing)."""

    def __init__(self, loader) -> None:
        self.loader, self.kept, self.choices = loader, {}, {}

    def __call__(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        key = tuple(sweep_overrides)
        if key in self.kept:
            return self.kept.pop(key)
        self.kept[key] = composed = self.compose(master_config, list(sweep_overrides))
        return composed

    def compose(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        choices, values = split_overrides(sweep_overrides)
        if not values:
            return type(self.loader).load_sweep_config(self.loader, master_config, sweep_overrides)
        if tuple(choices) not in self.choices:
            self.choices[tuple(choices)] = type(self.loader).load_sweep_config(self.loader, master_config, choices)
        cfg = copy.deepcopy(self.choices[tuple(choices)])
        values_set(cfg, values)
        # What Hydra's loader records of a cell's overrides (its load_configuration): every task override in
        # order, and the directory name made of them.
        parsed = [o for o in OverridesParser.create().parse_overrides(sweep_overrides) if not o.is_hydra_override()]
        cfg.hydra.overrides.task = [o.input_line for o in parsed]
        named = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=parsed, kv_sep=named.kv_sep, item_sep=named.item_sep, exclude_keys=named.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    def __reduce__(self):
        return functools.partial, (type(self.loader).load_sweep_config, self.loader)

    @classmethod
    def install(cls, hydra_context) -> None:
        loader = hydra_context.config_loader
        if not isinstance(loader.load_sweep_config, cls):
            loader.load_sweep_config = cls(loader)


def cell_config(hydra_context, config: DictConfig, overrides: Sequence[str], job_num: int) -> DictConfig:
    """One run's config as Hydra's own launchers give it to the task function (without the ``hydra`` node)."""
    sweep = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep):
        sweep.hydra.job.num = sweep.hydra.job.id = job_num
    HydraConfig.instance().set_config(sweep)
    task = copy.deepcopy(sweep)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def planned(cfgs: list[DictConfig], launcher: str, shards: int) -> list[list[int]]:
    """The groups, printed, once every cell is checked as its job will check it (``pcs.sweep.check``: config,
    data, run folder): a problem stops the sweep before anything runs or is submitted, a dry run too
    (``ConfigError``: ``run.py`` reports it in one line, exit 2)."""
    if not positive_int(shards):
        raise ConfigError(f"hydra.launcher.shards={shards!r} must be a positive integer (jobs per group of runs, "
                          f"each answering every shards-th sample)")
    groups = plan(cfgs)
    for cfg in cfgs:
        check(cfg)
    print(describe(cfgs, groups, launcher, shards), flush=True)
    return groups


def returns(cfgs, overrides, status: JobStatus, values) -> list[JobReturn]:
    return [JobReturn(overrides=list(o), cfg=c, status=status, _return_value=v)
            for c, o, v in zip(cfgs, overrides, values)]


def run_group(cfgs: list[DictConfig], overrides: list[Sequence[str]], shard=(0, 1)) -> list[JobReturn]:
    """Run one group's runs together (one shard of their samples); a failure fails the group's runs (the sweep
    reports it at the end)."""
    from pcs.runner import run_cells   # torch: only where the runs execute
    try:
        return returns(cfgs, overrides, JobStatus.COMPLETED, run_cells(cfgs, tuple(shard), checked=True))
    except Exception as err:  # noqa: BLE001 - as Hydra's run_job: recorded, raised by the sweeper
        traceback.print_exc()
        return returns(cfgs, overrides, JobStatus.FAILED, [err] * len(cfgs))


def per_run(cfgs: list[DictConfig], groups: list[list[int]], done: list[list[JobReturn]],
            shards: int) -> list[JobReturn]:
    """One return per sweep cell from each group's shard jobs: a failed shard's, else the one whose job wrote the
    run's results (the others return None: their part is done, the run's is not yet). A run that no job finished
    although none failed fails (``left_unfinished``): the sweep must not end as if it were done."""
    out: list[JobReturn | None] = [None] * len(cfgs)
    for g, group in enumerate(groups):
        for k in range(shards):
            for i, ret in zip(group, done[g * shards + k]):
                if out[i] is None or ret.status == JobStatus.FAILED or (
                        out[i].status != JobStatus.FAILED and ret.return_value is not None):
                    out[i] = ret
    for i, ret in enumerate(out):
        if ret.status == JobStatus.COMPLETED and ret.return_value is None and (why := left_unfinished(cfgs[i])):
            out[i] = JobReturn(overrides=ret.overrides, cfg=ret.cfg, status=JobStatus.FAILED,
                               _return_value=RuntimeError(why))
    return out


class GroupingLauncher(Launcher):
    """Runs a sweep in this process, one group after another."""

    def __init__(self, dry_run: bool = False, shards: int = 1) -> None:
        self.dry_run, self.shards = dry_run, shards

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.hydra_context, self.config = hydra_context, config
        ComposedOnce.install(hydra_context)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        cfgs = [cell_config(self.hydra_context, self.config, o, initial_job_idx + i)
                for i, o in enumerate(job_overrides)]
        groups = planned(cfgs, "local", self.shards)
        if self.dry_run:
            return returns(cfgs, job_overrides, JobStatus.COMPLETED, [None] * len(cfgs))
        done = [run_group([cfgs[i] for i in group], [job_overrides[i] for i in group], (k, self.shards))
                for group in groups for k in range(self.shards)]
        return per_run(cfgs, groups, done, self.shards)


class Grouped:
    """Mixin for submitit's launchers: one submitted job per group instead of one per run."""

    def __init__(self, dry_run: bool = False, shards: int = 1, **params) -> None:
        super().__init__(**params)
        self.dry_run, self.shards = dry_run, shards

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        ComposedOnce.install(hydra_context)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        cfgs = [cell_config(self.hydra_context, self.config, o, initial_job_idx + i)
                for i, o in enumerate(job_overrides)]
        groups = planned(cfgs, self._EXECUTOR, self.shards)
        if self.dry_run:
            return returns(cfgs, job_overrides, JobStatus.COMPLETED, [None] * len(cfgs))
        # One task of the job array each, carrying its runs' configs as composed and checked here: a task that
        # starts (or is requeued) later runs exactly these, whatever the checkout's YAML files say by then.
        jobs = [{"runs": [list(job_overrides[i]) for i in group], "cfgs": [cfgs[i] for i in group],
                 "shard": [k, self.shards]} for group in groups for k in range(self.shards)]
        owners = [group for group in groups for _ in range(self.shards)]      # each job's group
        done = [result if not isinstance(result, BaseException) else     # a job that ended without its returns
                returns([cfgs[i] for i in group], [job_overrides[i] for i in group], JobStatus.FAILED,
                        [result] * len(group))
                for group, result in zip(owners, collect(self.submit(jobs, initial_job_idx), self._EXECUTOR == "slurm"))]
        return per_run(cfgs, groups, done, self.shards)

    def submit(self, jobs: list[dict], initial_job_idx: int) -> list:
        """The jobs submitted as hydra-submitit-launcher submits a sweep's (its executor, resources, folders and
        job arguments); they are waited on by ``collect``, not by submitit alone."""
        import submitit
        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:                 # requeues after a time limit (SLURM only)
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        arguments = [(job, "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                      Singleton.get_state()) for i, job in enumerate(jobs)]
        return executor.map_array(self, *zip(*arguments))

    def __call__(self, job: dict, job_dir_key, job_num, job_id, singleton_state) -> list[JobReturn]:
        """Runs on the cluster node: the group's runs, from the configs composed at submission (never composed
        again from the node's config files)."""
        Singleton.set_state(singleton_state)
        setup_globals()
        return run_group(job["cfgs"], job["runs"], job["shard"])


QUEUE_POLL_S = 15          # squeue at most this often
RESULT_GRACE_S = 15        # for a result file to appear on a shared filesystem after its job ended


def refreshed(path: Path) -> bool:
    """Whether ``path`` exists, asked after setting its folder's mode to what it is: an NFS client may answer from
    a directory listing cached for 30 s or more (acdirmin), hiding a file another node wrote, and a change of
    attributes makes it ask the server again (submitit does the same before it reads a result)."""
    try:
        os.chmod(path.parent, path.parent.stat().st_mode)
    except OSError:
        pass
    return path.exists()


def collect(jobs: list, watch_queue: bool) -> list:
    """Each submitted job's returns, or the exception that ended it. A SLURM job that ends without its result
    (``scancel``, a node lost, killed out of memory) fails its runs as soon as the queue says so: submitit on its
    own asks SLURM's accounting (sacct), which a cluster may not run (then it would wait forever) and which it
    polls only every few minutes. A requeued job is waited for. ``watch_queue``: the jobs are SLURM's."""
    results: dict[int, object] = {}
    ended: dict[int, tuple[float, str]] = {}      # job -> (when it was first seen ended, its state)
    last_poll = 0.0
    while len(results) < len(jobs):
        states = None
        if watch_queue and time.time() - last_poll >= QUEUE_POLL_S:
            states, last_poll = queue_states([job.job_id for job in jobs]), time.time()
        for i, job in enumerate(jobs):
            if i in results:
                continue
            if job.paths.result_pickle.exists() or (not watch_queue and job.done()):
                try:
                    results[i] = job.results()[0]
                except Exception as err:  # noqa: BLE001 - a job that raised, or timed out too often
                    results[i] = err
                continue
            if states is not None:
                state = states.get(job.job_id)          # None: SLURM no longer knows it
                if state is None or state in ENDED_STATES:
                    ended.setdefault(i, (time.time(), state or "gone from the queue"))
                else:
                    ended.pop(i, None)
            if i in ended and time.time() - ended[i][0] > RESULT_GRACE_S and not refreshed(job.paths.result_pickle):
                results[i] = RuntimeError(f"SLURM job {job.job_id} ended without a result ({ended[i][1]}): "
                                          f"resubmit the sweep; it resumes from the rows on disk")
        time.sleep(1)
    return [results[i] for i in range(len(jobs))]


class GroupedSlurmLauncher(Grouped, SlurmLauncher):
    pass


class GroupedLocalJobsLauncher(Grouped, LocalLauncher):
    pass


@dataclass
class LocalConf:
    _target_: str = "hydra_plugins.pcs_launcher.pcs_launcher.GroupingLauncher"
    dry_run: bool = False
    shards: int = 1          # jobs per group of runs, each answering every shards-th sample


@dataclass
class GroupedSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.pcs_launcher.pcs_launcher.GroupedSlurmLauncher"
    dry_run: bool = False
    shards: int = 1          # tasks of the job array per group of runs, each answering every shards-th sample


@dataclass
class GroupedLocalJobsConf(LocalQueueConf):
    _target_: str = "hydra_plugins.pcs_launcher.pcs_launcher.GroupedLocalJobsLauncher"
    dry_run: bool = False
    shards: int = 1          # processes per group of runs, each answering every shards-th sample


store = ConfigStore.instance()
store.store(group="hydra/launcher", name="pcs_local", node=LocalConf, provider="pcs")
store.store(group="hydra/launcher", name="pcs_slurm", node=GroupedSlurmConf, provider="pcs")
store.store(group="hydra/launcher", name="pcs_local_jobs", node=GroupedLocalJobsConf, provider="pcs")
