"""pcs: a benchmark harness for KV-cache eviction with perturbation-constrained selection."""
