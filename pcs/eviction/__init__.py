"""Eviction methods and their registry: ``build_method(cfg)`` is the only place that reads method names."""
from __future__ import annotations

from .laprox import LaProx
from .methods import (FullCache, LayerState, StreamingLLM, WindowEviction, adaptive_allocator,
                      pyramid_allocator, uniform_allocator)
from .selection import AttentionSelection, PerturbationSelection

METHODS = ("full", "streamingllm", "snapkv", "pyramidkv", "adakv", "laprox")
METHODS_WITHOUT_SELECTION = ("full", "streamingllm", "laprox")    # they rank entries by their own rule, or not at all
SELECTIONS = ("attention", "perturbation")


def build_selection(sel):
    if sel.name == "attention":
        return AttentionSelection()
    return PerturbationSelection(alpha=sel.alpha, stage2_source=sel.stage2_source,
                                 epsilon=sel.epsilon, gqa=sel.gqa)


def build_method(cfg):
    """Method object for the config's ``method`` and ``selection`` groups (validated beforehand)."""
    m, budget = cfg.method, cfg.budget
    if m.name == "full":
        return FullCache()
    if m.name == "streamingllm":
        return StreamingLLM(budget=budget, sinks=m.sinks)
    if m.name == "laprox":
        return LaProx(budget=budget, window=m.window, kernel=m.kernel, gqa=m.gqa, pool_on=m.pool_on,
                      scope=m.scope, sinks=m.sinks)
    allocators = {
        "snapkv": lambda: uniform_allocator(budget, m.window),
        "pyramidkv": lambda: pyramid_allocator(budget, m.window, m.beta),
        "adakv": lambda: adaptive_allocator(budget, m.window, m.floor),
    }
    return WindowEviction(budget=budget, window=m.window, kernel=m.kernel, pooling=m.pooling,
                          allocator=allocators[m.name](), selection=build_selection(cfg.selection))


__all__ = ["METHODS", "METHODS_WITHOUT_SELECTION", "SELECTIONS", "LaProx", "LayerState", "build_method", "FullCache", "StreamingLLM",
           "WindowEviction"]
