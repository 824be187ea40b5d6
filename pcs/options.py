"""Every choice of how pcs computes, as opposed to what it computes: the decode pool, CUDA graphs, how far behind
the forward a prefill compresses, and how stage 2 of perturbation selection searches for its top entries. None of
them changes a kept entry or a score (tests hold each against its alternative); some change the time and memory a
run takes. The defaults are written once, in the ``engine`` block of ``pcs/conf/config.yaml`` (``defaults``);
``python -m pcs.bench`` changes them through the same object. Torch-free, so config validation and
the bench's command line read it without loading a model.

An options object is passed down explicitly (runner -> decode pool -> prefill -> compression -> selection); no
module keeps a switch that a caller flips at run time, and nothing a process computed earlier changes how a later
prompt is computed (stage 2's tally of how loose its bounds are is kept per prompt, ``Stage2Search``).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

SEARCHES = ("auto", "bounded", "exhaustive")


@dataclass(frozen=True)
class Stage2Search:
    """How stage 2 finds each head's top entries by ``A x ||v W^O_h||_1``; every search keeps the same entries.

    On a CPU stage 2 always bounds the norms and scores only the entries the bounds leave: multiply-adds are what
    cost there. On an accelerator, where each round of the bounded search costs launches and a wait for the
    device, ``search`` chooses: ``bounded``; ``exhaustive`` (every entry's norm in one pass, no wait); or
    ``auto``: every entry in layers shorter than ``exhaustive_below`` entries (a short layer's forward is too
    brief to hide the bounded search's waits), bounded in longer ones, until the prompt's first ``loose_after``
    bounded layers have left more than ``loose_share`` of their entries to score exactly, after which its later
    layers score every entry (bounds that loose spare fewer norms than their rounds cost; how loose they are
    follows the model and the selection's knobs, which a prompt's own first layers show).
    ``value_norm_kernel``: on CUDA, the exact norms come from ``pcs.kernels.value_norms``'s one kernel instead of
    batched products (the same norms to float32 rounding, each entry's bits independent of its batch)."""
    search: str
    exhaustive_below: int
    loose_share: float
    loose_after: int
    value_norm_kernel: bool

    def __post_init__(self):
        if self.search not in SEARCHES:
            raise ValueError(f"engine.stage2.search={self.search}: choose one of {', '.join(SEARCHES)}")


@dataclass(frozen=True)
class EngineOptions:
    """How a run's answers are computed. ``pool``: most answers decoding together (None: 32 on a CPU, 256 on
    CUDA, fewer as free memory requires). ``cuda_graphs``: on CUDA each decoding step replays a captured graph. ``decode_kernel``: on CUDA, a
    pool's decoding attention goes through ``pcs.kernels.decode_attention``, each (row, KV head) reading its own
    entries (else one masked SDPA call over the padded capacity, which every row reads). ``compile_step``: on CUDA,
    the decoding step's forward is compiled (``pcs.engine.compiled``: norms, rotary, activations and cache writes
    fused), once per model and process before its first step.
    ``stop_when_scored``: an answer ends once its score is decided (benchmarks that declare it). ``layers_behind``:
    on CUDA, each layer is compressed this many layers behind the prefill's forward, on a stream of its own, so the
    host's waits inside a selection overlap the forward (0: right after its own forward; each layer behind holds one
    more full layer during the prefill); on a CPU always 0. ``stage2``: stage 2's search."""
    pool: int | None
    cuda_graphs: bool
    decode_kernel: bool
    compile_step: bool
    stop_when_scored: bool
    layers_behind: int
    stage2: Stage2Search

    @classmethod
    def from_config(cls, engine, base: EngineOptions | None = None) -> EngineOptions:
        """From a config's ``engine`` block; a field it lacks or leaves null takes ``base``'s (by default the
        config tree's, ``defaults``)."""
        given = {k: v for k, v in dict(engine or {}).items() if v is not None}
        search = {k: v for k, v in dict(given.pop("stage2", None) or {}).items() if v is not None}
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"engine.{unknown[0]} is not an engine option")
        base = base or defaults()
        return dataclasses.replace(base, **given, stage2=dataclasses.replace(base.stage2, **search))

    def with_(self, **changes) -> EngineOptions:
        """A copy with fields changed, as a config block would change them; ``stage2_<field>``: the search's."""
        search = {k.removeprefix("stage2_"): changes.pop(k) for k in list(changes) if k.startswith("stage2_")}
        return EngineOptions.from_config({**changes, "stage2": search}, base=self)


@functools.cache
def defaults() -> EngineOptions:
    """The engine block of ``pcs/conf/config.yaml``, the one place the defaults are written."""
    from omegaconf import OmegaConf
    engine = OmegaConf.to_container(OmegaConf.load(Path(__file__).parent / "conf" / "config.yaml").engine)
    engine["stage2"] = Stage2Search(**engine["stage2"])
    return EngineOptions(**engine)
