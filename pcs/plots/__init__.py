"""Figures, drawn from finished results only (metrics.json, config.yaml): by a benchmark for its own
run folder, and by the report for many runs."""
