"""Adding a method is one module and one config file: KeyNorm (tests/key_norm.py) and its YAML, in a copy
of the config tree, run end to end on a tiny model without touching any pcs file."""
import json
import shutil

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, DynamicCache

import pcs.config
from pcs.cache import CompressedCache
from pcs.compression import compress_after_prefill
from pcs.eviction import build_method
from pcs.identity import RunIdentity
from pcs.models import prepare
from pcs.report.collect import collect
from pcs.runner import run

YAML = """# KeyNorm: the budget entries with the smallest key norm, in every KV head.
name: key_norm
_target_: key_norm.KeyNorm
_uses_: [budget]
"""


def test_a_method_registered_by_its_yaml_runs_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(pcs.config.CONF_DIR, conf)
    (conf / "method" / "key_norm.yaml").write_text(YAML)
    monkeypatch.setattr(pcs.config, "CONF_DIR", conf)
    cfg = pcs.config.compose(["method=key_norm", "budget=32", f"model.path={tiny_model_dir}",
                              f"results_dir={tmp_path / 'results'}", "progress=false",
                              "benchmark.context_lengths=[200]", "benchmark.depth_percents=[0,100]",
                              "benchmark.max_new_tokens=4"])
    metrics = run(cfg)
    run_dir = tmp_path / "results" / "needle" / "smollm2" / \
        "key_norm_none_b32_context_lengths=200_depth_percents=0+100_max_new_tokens=4"
    assert RunIdentity(cfg).folder == str(run_dir.relative_to(tmp_path / "results"))
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    # Every head holds exactly the budget: layers x KV heads x 32 entries x (K and V) x head dim x 4 bytes.
    model_cfg = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    per_sample = model_cfg["num_hidden_layers"] * model_cfg["num_key_value_heads"] * 32 * 2 * head_dim * 4
    assert [r["kv_cache_bytes"] for r in rows] == [per_sample] * 2 and metrics["n_samples"] == 2
    # The report files it as a method without selection.
    table = collect(tmp_path / "results")
    assert set(table["selection"]) == {"none"} and set(table["method"]) == {"key_norm"}
    assert OmegaConf.load(run_dir / "config.yaml").method == {"name": "key_norm"}


def test_the_compressed_cache_holds_the_smallest_norm_keys(tiny_model_dir, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(pcs.config.CONF_DIR, conf)
    (conf / "method" / "key_norm.yaml").write_text(YAML)
    monkeypatch.setattr(pcs.config, "CONF_DIR", conf)
    method = build_method(pcs.config.compose(["method=key_norm", "budget=20"]))
    model = prepare(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    ids = torch.randint(0, 1000, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=reference)
        cache = CompressedCache.of(model.config)
        with compress_after_prefill(model, method, cache):
            model(input_ids=ids, past_key_values=cache)
    for full, compressed in zip(reference.layers, cache.layers):
        for h, (kept, _) in enumerate(compressed.heads()):
            keys = full.keys[0, h]
            smallest = keys.norm(dim=-1).argsort()[:20].sort().values   # brute force over the full cache
            torch.testing.assert_close(kept, keys[smallest])
