"""Shared fixtures: composed configs, random-weight tiny models of the supported architectures."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # tests never reach the hub (read when huggingface_hub loads)
# One OpenMP thread per process (read when torch loads; the sweep tests' job processes inherit it). The tests'
# tensors are small, and OpenMP threads spin-waiting for a core another process holds made the suite several times
# slower on a busy 2-core machine; alone, one thread is as fast here (the pool tests: 49.8 s against 49.2 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from pcs.config import CONF_DIR, compose
from pcs.models import prepare

CONF = str(CONF_DIR)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**TINY),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY),
    # Hybrid attention: two layers through a 16-position sliding window, two full; a query norm and an attention
    # scale (query_pre_attn_scalar) other than 1/sqrt(head_dim), as Gemma 3 has.
    "gemma3": lambda: Gemma3TextConfig(**TINY, head_dim=8, query_pre_attn_scalar=16, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"] * 2),
}
SLIDING_WINDOW = 16


def longbench_files(folder: Path) -> Path:
    """One well-formed record per LongBench task (and LongBench-E file), as the official files hold them: a dry
    run checks each cell's data as its job will, and the docs' SLURM commands name a cluster's data folder."""
    from pcs.benchmarks.longbench_data import ALL_TASKS, ANSWER_PATTERNS, CLASSIFICATION_TASKS, E_TASKS
    folder.mkdir(parents=True, exist_ok=True)
    for task, suffix in [(t, "") for t in ALL_TASKS] + [(t, "_e") for t in E_TASKS]:
        record = {"input": "q", "context": "c", "answers": [ANSWER_PATTERNS.get(task, "") + "1"], "length": 10,
                  "dataset": task, "language": "en", "_id": "0",
                  "all_classes": ["a", "b"] if task in CLASSIFICATION_TASKS else None}
        (folder / f"{task}{suffix}.jsonl").write_text(json.dumps(record) + "\n")
    return folder


def kvpress_ruler_files(folder: Path, lengths=(4096,)) -> Path:
    """One row per RULER task at each length, laid out as kvpress's hub dataset ``simonjegou/ruler`` holds them
    (``<length>/*.parquet``): what benchmark=ruler_kvpress reads, so that a dry run checks its data."""
    import pandas as pd
    from pcs.benchmarks.ruler_data import TASKS
    row = {"context": "c", "question": "q", "answer_prefix": "a", "answer": ["x"], "max_new_tokens": 32}
    for length in lengths:
        (folder / str(length)).mkdir(parents=True, exist_ok=True)
        pd.DataFrame([{**row, "task": t} for t in TASKS]).to_parquet(folder / str(length) / "test-00000-of-00001.parquet")
    return folder


def compose_cfg(*overrides: str):
    return compose(overrides)


def tiny_model(arch: str = "llama", seed: int = 0, layers: int | None = None):
    """A random-weight model of ``arch``; ``layers`` keeps its first layers only (Gemma 3's first two: one sliding,
    one full), for tests whose cost grows with each layer traced by torch.compile."""
    config = ARCHITECTURES[arch]()
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    return prepare(AutoModelForCausalLM.from_config(config))


def embedded_essay_layers(model_dir, n_tokens: int = 600, window: int = 32) -> tuple:
    """(model, ids, states): the model at ``model_dir`` (float32), the first ``n_tokens`` of Paul Graham's essays, and
    every layer's ``LayerState`` as their prefill hands it to a method with this observation window, every layer kept
    whole: the real layers a transcription of a reference implementation is held to."""
    from transformers import AutoTokenizer
    from pcs.benchmarks.needle import Haystack, essay_files
    from pcs.output_perturbation import run_prefill

    class Recording:
        model_wide, two_stage, evicts, reconstruction = False, False, True, None

        def __init__(self):
            self.window, self.states = window, []

        def for_prompt(self, n):
            return self

        def keep(self, layer, stage2=None):
            self.states.append(layer)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = Haystack(AutoTokenizer.from_pretrained(model_dir), essay_files(None), "").tokens[:n_tokens]
    recording = Recording()
    with torch.inference_mode():
        run_prefill(model, torch.tensor([ids]), {"r": recording})
    return model, torch.tensor([ids]), recording.states


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2, converted once (about 20 s the first time, then cached)."""
    from pcs.models import converted_gguf
    cfg = compose_cfg()
    return converted_gguf(cfg.model.gguf, None)


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_dir, tmp_path_factory):
    """A random-weight tiny Llama with the embedded tokenizer, saved as local weights (model.path)."""
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "vocab_size": 49152, "max_position_embeddings": 4096}))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_dir).save_pretrained(path)
    return path


# What a test costs, read from its source and the source of its module's helpers and fixtures it uses: a test carries the
# marker of each (pyproject.toml names them), so that the fast loop (docs/testing.md) leaves them out. Beside them,
# ``slow``: the test took at least ``SLOW_S`` seconds in the suite's last recorded run (``MEASURED``, written by
# ``make test-costs``); a test not recorded yet is not marked.
COSTS = {
    "subprocess": re.compile(r"subprocess\.|sys\.executable"),
    "compile": re.compile(r"torch\.compile|compile_step|compiled=True"),
    "embedded": re.compile(r"AutoModelForCausalLM\.from_pretrained\(embedded_dir|embedded_essay_layers\(|load_model\("
                           r"|converted_gguf\(|gemma3_270m"),
}


@functools.lru_cache(maxsize=None)
def module_helpers(path: str) -> dict[str, str]:
    """Source of each module-level function of a test file that is not a test, by name."""
    import ast
    source = Path(path).read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("test_")}


def costs(item) -> set[str]:
    import inspect
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return set()
    helpers = module_helpers(str(item.path))
    called = [helpers[name] for name in helpers                 # called, or named (a fixture, getfixturevalue)
              if re.search(rf"\b{name}\b", source) or name in item.fixturenames]
    text = "\n".join([source, *called])
    found = {name for name, pattern in COSTS.items() if pattern.search(text)}
    return found | ({"slow"} if measured_seconds().get(item.nodeid, 0.0) >= SLOW_S else set())


MEASURED = Path(__file__).with_name("costs.json")
SLOW_S = 1.5


@functools.lru_cache(maxsize=None)
def measured_seconds() -> dict[str, float]:
    return json.loads(MEASURED.read_text())["seconds"] if MEASURED.exists() else {}


def pytest_addoption(parser):
    parser.addoption("--record-costs", action="store_true",
                     help=f"write each test's seconds (setup, call and teardown) to {MEASURED.name}: what marks the "
                          f"tests of at least {SLOW_S:g} s slow")


def pytest_configure(config):
    if config.getoption("--record-costs"):
        config.pluginmanager.register(CostRecorder(), "pcs-cost-recorder")


class CostRecorder:
    """Sums each test's phases as the reports arrive (from every xdist worker) and, once the session ends, writes
    the tests that ran over their earlier figures (a run of some tests keeps the others'), those of at least a tenth
    of ``SLOW_S`` only, so that the file stays short."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):      # an xdist worker: the controller records
            return
        kept = {k: v for k, v in measured_seconds().items() if k not in self.seconds}
        kept |= {k: round(v, 2) for k, v in self.seconds.items() if v >= SLOW_S / 10}
        kept = dict(sorted(kept.items()))
        MEASURED.write_text(json.dumps({"seconds": kept}, indent=0) + "\n")


def pytest_collection_modifyitems(config, items):
    """Each test marked with what it costs (``COSTS``); GPU tests run where CUDA is (scripts/gpu_check.sh),
    elsewhere they are skipped, saying why."""
    for item in items:
        for cost in costs(item):
            item.add_marker(getattr(pytest.mark, cost))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
