"""Benchmark registry: name -> class. Each takes the run's config."""
from .alpacaeval import AlpacaEval
from .base import Benchmark, RunContext, Sample
from .longbench import LongBench
from .needle import Needle
from .perturbation import Perturbation

BENCHMARKS = {"needle": Needle, "longbench": LongBench, "perturbation": Perturbation, "alpacaeval": AlpacaEval}


def build_benchmark(cfg) -> Benchmark:
    """The benchmark of a run's whole config (``cfg.benchmark.name``)."""
    return BENCHMARKS[cfg.benchmark.name](cfg)


__all__ = ["BENCHMARKS", "Benchmark", "RunContext", "Sample", "build_benchmark"]
