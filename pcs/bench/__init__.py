"""``python -m pcs.bench``: what each method and selection costs and saves (``measure``), the instruments it
measures with (``instrument``), its results files' tables and the targets they are read against (``tables``,
``targets.yaml``), and its command line (``__main__``). This package's top imports nothing heavy, so ``--help``,
``--report`` and ``--project`` answer without loading torch."""
