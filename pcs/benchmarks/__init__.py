"""Benchmark registry: name -> class. Each takes its ``benchmark`` config group."""
from .base import Benchmark, Sample
from .longbench import LongBench
from .needle import Needle

BENCHMARKS = {"needle": Needle, "longbench": LongBench}


def build_benchmark(cfg) -> Benchmark:
    return BENCHMARKS[cfg.name](cfg)


__all__ = ["BENCHMARKS", "Benchmark", "Sample", "build_benchmark"]
