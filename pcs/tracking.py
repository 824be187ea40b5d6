"""Experiment tracking (``logger=wandb``): a finished run's config, metrics, per-task scores and plots.

Called after ``metrics.json`` is written, so tracking can never lose or block results; any failure
is printed and swallowed. ``wandb`` is imported only when this logger is chosen.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def scalars(metrics: dict, prefix: str = "") -> dict:
    """Numeric leaves of ``metrics`` as flat ``a/b`` keys (lists such as per-head arrays are skipped)."""
    out = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def log_run(cfg, run_name: str, run_dir: Path, metrics: dict) -> None:
    if cfg.logger.name != "wandb":
        return
    try:
        import wandb
        log = cfg.logger
        run = wandb.init(project=log.project, entity=log.entity, group=log.group, tags=list(log.tags),
                         mode=log.mode, dir=log.dir, name=run_name, reinit="finish_previous",
                         config=OmegaConf.to_container(cfg, resolve=True))
        values = scalars(metrics)
        run.summary.update(values)
        logged = dict(values)
        if "tasks" in metrics:   # LongBench: the per-task table
            logged["tasks_table"] = wandb.Table(columns=["task", "score"],
                                                data=[[t, s] for t, s in metrics["tasks"].items()])
        for png in sorted(Path(run_dir).glob("*.png")):
            logged[f"plots/{png.stem}"] = wandb.Image(str(png))
        run.log(logged)
        run.finish()
    except Exception as err:   # tracking is optional; the run folder is already complete
        print(f"[pcs] warning: W&B logging failed ({type(err).__name__}: {err}); results on disk are complete")
