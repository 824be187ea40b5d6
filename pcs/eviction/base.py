"""What an eviction method is: an object that says, layer by layer, which cache entries each KV head keeps.

Compression after the prefill, decoding-time recompression and the perturbation analysis all call the
interface below and nothing else. A method's module is its class; its config file
(``pcs/conf/method/<name>.yaml``) names the class, its knobs and the run-level settings it reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from .. import budget
from .scores import SharedScores
from .stage2_search import Stage2Run

# Per layer: None (the layer is kept whole) or one ascending LongTensor of kept positions per KV head.
Kept = Optional[list[torch.Tensor]]


@dataclass(frozen=True)
class Reconstruction:
    """Scores a method reads from a reconstruction of the prompt after its prefill (KVzip's; ``pcs.reconstruction``
    computes them once for every method that asks the same): the model asked to repeat the context ``chunk`` tokens
    at a time, each entry scored by the most attention any query of a repetition pays it, among the first ``sinks``
    entries, the chunk and the repetition's own. ``normalised``: each attention divided by its query's input norm and
    times the entry's ``||v W^O_h||_2`` (KVzip+)."""
    chunk: int
    sinks: int
    normalised: bool = False


class Prompt(Protocol):
    """Every query of a layer's prompt (``pcs.compression.PromptQueries`` computes them when first read)."""
    n_tokens: int
    unrotated: torch.Tensor     # (H_q, n, d) before rotary, unscaled, as the attention module computes them
    rotated: torch.Tensor       # (H_q, n, d) at their positions, scaled as ``window_queries`` are

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's rotary (cos, sin), each (len(positions), d), at ``positions``."""


@dataclass
class LayerState:
    """What a method may look at for one layer right after prefill."""
    layer_idx: int
    n_layers: int
    keys: torch.Tensor            # (H_kv, n, d), rotary already applied
    values: torch.Tensor          # (H_kv, n, d)
    window_queries: torch.Tensor  # (H_q, w, d), the last w queries, rotary applied
    o_proj_weight: torch.Tensor   # (hidden, H_q * d)
    pad: torch.Tensor | None = None   # (H_kv,) leading padding entries per head (decode-time recompression)
    compressed: tuple[int, ...] | None = None   # the model's layers methods choose in (None: all of them; a
                                                # hybrid model's sliding-window layers keep their window)
    shared: SharedScores | None = None   # scores computed once for every run sharing this prefill
    prompt: Prompt | None = None         # every query of the prompt, on demand (after a prefill; not when decoding)

    def seen_by(self, window_queries: torch.Tensor) -> LayerState:
        """The same layer as a method with another observation window sees it (its own last queries)."""
        return dataclasses.replace(self, window_queries=window_queries)

    @property
    def depth(self) -> tuple[int, int]:
        """(index, count) of this layer among the layers methods choose in: what a per-layer schedule
        (PyramidKV's) runs over."""
        if self.compressed is None:
            return self.layer_idx, self.n_layers
        return self.compressed.index(self.layer_idx), len(self.compressed)

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[1]

    def valid_entries(self) -> torch.Tensor | None:
        """(H_kv, n) True for real entries when heads are padded at the front, else None."""
        if self.pad is None:
            return None
        return torch.arange(self.n_tokens, device=self.keys.device)[None, :] >= self.pad[:, None]


class Method:
    """The interface every method implements.

    ``window``: how many of the newest queries the method reads (its observation window; 0: none).
    The compression hooks rebuild them from each layer's input and pass them in ``LayerState``.

    ``model_wide``: False, ``keep`` chooses a layer as soon as its prefill forward is done, so only one
    full layer is ever held. True, ``score`` rates each layer as it passes and ``choose`` picks for
    every layer at once when the prefill ends (the full cache lives until then); ``keep`` still
    chooses within one layer, for decoding-time recompression.

    ``two_stage``: the method keeps some entries (``stage1``) before an output-aware second stage, as
    perturbation-constrained selection does; the perturbation analysis measures their attention mass
    (the paper's Assumption 1).

    ``exhaustive_stage2``: a two-stage method whose second stage scores every entry whatever
    ``engine.stage2.search`` says (its first stage's scores may be negative, which the bounded search excludes).

    ``evicts``: False for a method that keeps every entry (``keep`` returns None): decoding-time compression
    has nothing to do for it.

    ``reconstruction``: a model-wide method scored by a reconstruction after the prefill (KVzip) says which; its
    ``choose`` then receives those scores instead of ``score``'s.

    ``choice_reads_layers``: a model-wide method whose ``choose`` reads the layers themselves, not only their scores
    (a two-stage selection within each head's count reads the entries' values and the output projection): ``choose``
    then gets every layer's ``LayerState`` as the prefill handed it, less the prompt's queries, as ``layers``. Such a
    method's ``two_stage`` stays False: the perturbation analysis and ``pcs.bench``'s stage-2 counts read layer-by-layer
    methods only.
    """
    window: int = 0
    model_wide: bool = False
    two_stage: bool = False
    exhaustive_stage2: bool = False
    evicts: bool = True
    reconstruction: Reconstruction | None = None
    choice_reads_layers: bool = False

    def keep(self, layer: LayerState, stage2: Stage2Run | None = None) -> Kept:
        """The layer's kept entries; ``stage2``: how a selection's stage 2 searches and where it counts what it
        computed (None: the engine's defaults, counted for this layer alone)."""
        raise NotImplementedError

    def score(self, layer: LayerState) -> torch.Tensor | None:
        """A model-wide method's scores of one layer ((H_kv, m), comparable across layers, or what its ``choose``
        reads of the layer; None: kept whole)."""
        raise NotImplementedError(f"{type(self).__name__} chooses layer by layer (model_wide is False)")

    def choose(self, scores: dict[int, torch.Tensor], n_tokens: int, layers: dict[int, LayerState] | None = None,
               stage2: Stage2Run | None = None) -> dict[int, list[torch.Tensor]]:
        """A model-wide method's kept positions per layer and KV head, from every layer's ``score`` (``layers``: the
        layers themselves, and ``stage2`` as ``keep`` takes it, where ``choice_reads_layers``)."""
        raise NotImplementedError(f"{type(self).__name__} chooses layer by layer (model_wide is False)")

    def stage1(self, layer: LayerState) -> list[torch.Tensor] | None:
        """A two-stage method's first-stage picks per KV head, window excluded (None: kept whole)."""
        return None

    def for_prompt(self, n_tokens: int) -> Method:
        """The method for one prompt of ``n_tokens``: itself, or, where its ``budget`` is a share of each prompt
        (``pcs.budget``), a copy whose budget is that share in entries (at least its window and sinks)."""
        share = getattr(self, "budget", None)
        if not budget.is_share(share):
            return self
        least = self.window + getattr(self, "sinks", 0)
        return dataclasses.replace(self, budget=budget.entries(share, n_tokens, least))


def window_positions(n_tokens: int, window: int, device=None) -> torch.Tensor:
    """The last ``window`` positions, kept in every head."""
    return torch.arange(n_tokens - window, n_tokens, device=device)


class Watched:
    """A method whose every ``keep`` runs inside ``watch()`` (a context-manager factory), everything else its own:
    the declared way to observe a compression (``pcs.bench`` times it and counts its operations) without changing
    the method or replacing its code. A prompt's copy (``for_prompt``) is watched too."""

    def __init__(self, method, watch):
        self.inner, self.watch = method, watch

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def keep(self, layer: LayerState, stage2: Stage2Run | None = None) -> Kept:
        with self.watch():
            return self.inner.keep(layer, stage2)

    def for_prompt(self, n_tokens: int) -> Watched:
        return Watched(self.inner.for_prompt(n_tokens), self.watch)
