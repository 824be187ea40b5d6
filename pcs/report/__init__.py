"""Reports from run folders: tables and figures."""

# Every interval of the report and its commands: bootstrap resamples, seed and level (here, so that a command's
# ``--help`` can name them without loading pandas).
RESAMPLES, SEED, LEVEL = 10_000, 0, 0.95
