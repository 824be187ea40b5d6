"""The package's shape: data flows one way (no import cycle), and the stages that need no model import
neither torch nor transformers."""
import ast
import subprocess
import sys
from pathlib import Path

PCS = Path(__file__).resolve().parent.parent / "pcs"
# Torch-free by contract: config validation and run identity, benchmarks (samples and scores), plots,
# the report, rescoring and judging work from saved results on any machine.
TORCH_FREE = ["pcs.config", "pcs.identity", "pcs.run_folder", "pcs.report.__main__", "pcs.report.document", "pcs.rescore", "pcs.annotate",
              "pcs.benchmarks.needle", "pcs.benchmarks.longbench", "pcs.benchmarks.alpacaeval",
              "pcs.benchmarks.perturbation_analysis", "pcs.plots.needle", "pcs.plots.savings",
              "pcs.plots.output_perturbation", "pcs.projection", "pcs.benchmarks.longbench_data", "pcs.status",
              "pcs.eviction.conventions", "pcs.benchmarks.ruler", "pcs.options", "pcs.cli", "pcs.bench.tables",
              "pcs.bench.__main__", "pcs.report.interim", "pcs.report.rerun"]
# What benchmarks and plots must not import: the model side, the per-sample steps, the runner, the report.
LATER_OR_MODEL = ("pcs.models", "pcs.cache", "pcs.compression", "pcs.eviction", "pcs.engine", "pcs.generate",
                  "pcs.output_perturbation", "pcs.runner", "pcs.report", "pcs.bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PCS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pcs modules it imports anywhere in its body (module level or inside functions)."""
    files = {module_name(p): p for p in PCS.rglob("*.py")}
    graph = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and name != "pcs":
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_pcs_modules():
    graph = import_graph()
    assert len(graph) > 30 and "pcs.identity" in graph["pcs.runner"]   # the walk sees the package
    assert cycles(graph) == []


def test_benchmarks_and_plots_import_no_model_code_and_no_later_stage():
    graph = import_graph()
    for mod, imported in graph.items():
        if mod.startswith(("pcs.benchmarks", "pcs.plots")):
            bad = [m for m in imported if any(m == p or m.startswith(p + ".") for p in LATER_OR_MODEL)]
            assert not bad, f"{mod} imports {bad}"


def test_config_identity_report_rescore_and_benchmarks_load_without_torch():
    code = (f"import sys\nimport {', '.join(TORCH_FREE)}\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PCS.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_name_a_script_imports_from_pcs_exists():
    """The maintainers' scripts import what the package offers now (they run where tests do not: kvpress's venv,
    a GPU machine), so a rename inside the package fails here rather than there."""
    import importlib
    scripts = sorted((PCS.parent / "scripts").glob("*.py"))
    assert scripts
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pcs":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{script.name}: {node.module}.{alias.name}"
