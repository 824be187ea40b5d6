"""Which weights answered a run: the fingerprint sees a changed config, tensor or sampled block and not where the
files lie; a run started with one model's weights is never resumed, grown or merged with another's."""
import json
import shutil

import pytest

import pcs.runner
from pcs.identity import RunIdentity
from pcs.run_folder import OtherWeights, RunFolder
from pcs.runner import run
from pcs.weights import BLOCK, fingerprint

from conftest import compose_cfg


def cfg_of(model_dir, results, *extra):
    return compose_cfg(f"model.path={model_dir}", f"results_dir={results}", "progress=false",
                       "benchmark.context_lengths=[200,300]", "benchmark.depth_percents=[0,100]",
                       "benchmark.max_new_tokens=3", "budget=64", *extra)


@pytest.fixture
def copy_of(tiny_model_dir, tmp_path):
    def copy(name):
        return shutil.copytree(tiny_model_dir, tmp_path / name)
    return copy


def test_the_fingerprint_names_the_files_not_their_place(tiny_model_dir, copy_of):
    original, moved = fingerprint(str(tiny_model_dir)), fingerprint(str(copy_of("moved")))
    assert original["id"] == moved["id"] and original["source"] != moved["source"]
    assert original["files"] >= 3 and original["tensors"] is not None


def test_the_fingerprint_sees_a_config_a_tensor_and_a_sampled_block(tiny_model_dir, copy_of):
    original = fingerprint(str(tiny_model_dir))
    config = copy_of("config")
    data = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**data, "rms_norm_eps": 1e-3}))
    assert fingerprint(str(config))["id"] != original["id"]
    block = copy_of("block")
    weights = block / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-BLOCK // 2] ^= 0xFF                      # inside the last block, which is always read
    weights.write_bytes(bytes(raw))
    changed = fingerprint(str(block))
    assert changed["id"] != original["id"] and changed["tensors"] == original["tensors"]


def test_a_hub_id_not_in_the_cache_has_no_fingerprint():
    assert fingerprint("no-such-owner/no-such-model")["id"] is None


def test_a_run_is_not_resumed_with_other_weights(tiny_model_dir, copy_of, tmp_path, monkeypatch):
    """A run stopped after one sample with one model, resumed with another's weights: refused, naming both, and
    its rows are left as they were; with its own weights it resumes."""
    results = tmp_path / "results"
    first = cfg_of(tiny_model_dir, results)
    real = pcs.runner.generate_rows

    def one_answer(requests, pool, loaded):
        for n, answer in enumerate(real(requests, pool, loaded)):
            yield answer
            if n == 0:
                raise KeyboardInterrupt
    monkeypatch.setitem(pcs.runner.STEPS, "generate", one_answer)
    with pytest.raises(KeyboardInterrupt):
        run(first)
    monkeypatch.setitem(pcs.runner.STEPS, "generate", real)
    run_dir = results / RunIdentity(first).folder
    rows = (run_dir / "predictions.jsonl").read_text()
    other = copy_of("other")
    data = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**data, "rms_norm_eps": 1e-3}))
    with pytest.raises(OtherWeights, match=f"{fingerprint(str(tiny_model_dir))['id']}.*{fingerprint(str(other))['id']}"):
        run(cfg_of(other, results))
    assert (run_dir / "predictions.jsonl").read_text() == rows
    metrics = run(cfg_of(tiny_model_dir, results))
    assert metrics["n_samples"] == 4 and metrics["weights"]["id"] == fingerprint(str(tiny_model_dir))["id"]


def test_shards_answered_by_two_models_are_not_merged(tmp_path):
    folder = RunFolder(tmp_path / "run", (0, 2))
    for index, weights in ((0, "a" * 16), (1, "b" * 16)):
        shard = tmp_path / "run" / "shards" / f"{index}-of-2"
        shard.mkdir(parents=True)
        (shard / "weights.json").write_text(json.dumps({"id": weights, "source": f"/w/{weights[0]}"}))
    with pytest.raises(OtherWeights, match="aaaa.*bbbb"), folder.merge({"s0"}):
        pytest.fail("merged")
