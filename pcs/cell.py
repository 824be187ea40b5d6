"""One run of a group as every stage sees it: built by the runner, read by the step that answers its samples
(``pcs.generate``, ``pcs.output_perturbation``), written through its folder. The group's model is apart
(``pcs.models.Loaded``): one for every cell."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from .options import EngineOptions

if TYPE_CHECKING:
    from .eviction.base import Method


@dataclass
class RunCell:
    """``cfg``: the run's whole config; ``identity``: its ``pcs.identity.RunIdentity``; ``benchmark``: its
    checked benchmark (samples, scoring, when an answer is decided); ``methods``: variant key -> ``Method`` (one
    for a generation benchmark); ``folder``: its ``pcs.run_folder.RunFolder``; ``options``: how the engine runs it
    (its ``engine`` group)."""
    cfg: DictConfig
    identity: object
    benchmark: object
    methods: dict
    folder: object
    options: EngineOptions

    @property
    def run_dir(self) -> Path:
        return self.folder.path

    @property
    def method(self) -> Method:
        """A generation benchmark's one method."""
        (method,) = self.methods.values()
        return method
