"""Benchmarks: samples and how their answers are scored, with no model code (see base.py). Each is
one module named by its config file, ``pcs/conf/benchmark/<name>.yaml``."""
