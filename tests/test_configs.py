"""Every config option composes, validates and builds a method; run names stay distinct."""
from pathlib import Path

import pytest

from pcs.validation import validate
from pcs.identity import RunIdentity
from pcs.eviction import build_method

from conftest import CONF, compose_cfg

GROUPS = {g: sorted(p.stem for p in (Path(CONF) / g).glob("*.yaml")) for g in ("model", "method", "selection", "profile", "preset", "benchmark")}


def test_defaults_are_the_embedded_main_job():
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.benchmark.name, cfg.method.name, cfg.selection.name, cfg.budget) == \
        ("smollm2", "needle", "snapkv", "perturbation", 128)
    assert cfg.selection.alpha == 0.25 and cfg.method.window == 32 and cfg.method.kernel == 7
    assert RunIdentity(cfg).folder == "needle/smollm2/snapkv_perturbation_b128"


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_composes_and_builds(group):
    for option in GROUPS[group]:
        cfg = compose_cfg(f"{group}={option}")
        validate(cfg)
        build_method(cfg)


def test_models_declare_dtype_length_chat_and_path():
    for option in GROUPS["model"]:
        m = compose_cfg(f"model={option}").model
        assert m.dtype and 0 < m.max_length <= m.context_window and isinstance(m.chat_template, bool) and "path" in m
    # LongBench truncation lengths: the official 31,500 for 32K models.
    assert compose_cfg("model=mistral7b").model.max_length == compose_cfg("model=qwen25_32b").model.max_length == 31500


def test_run_names_distinguish_cells_and_knobs():
    names = {RunIdentity(compose_cfg(f"method={m}", f"selection={s}", f"budget={b}")).folder
             for m in GROUPS["method"] for s in ("attention", "perturbation") for b in (64, 128)}
    # full ignores selection and budget, streamingllm, laprox, the two DefensiveKVs and ChunkKV ignore selection; the
    # window methods, the scorers (knorm, keydiff, tova, expected_attention, observed_attention, lagkv, cur), the two
    # KVzips and CAKE read both.
    assert len(names) == 1 + 5 * 2 + 13 * 2 * 2
    assert "needle/smollm2/laprox_none_b64" in names
    assert RunIdentity(compose_cfg("selection.alpha=0")).folder == "needle/smollm2/snapkv_perturbation_b128_alpha=0"
    assert "stage2_source=pooled" in RunIdentity(compose_cfg("selection=perturbation_released")).folder
    # Model knobs change results too; where data lives does not; lists are joined by "+".
    assert RunIdentity(compose_cfg("benchmark=longbench", "benchmark.tasks=[trec,lcc]", "model.max_length=1500",
                                   "benchmark.data_dir=/some/where")).folder == \
        "longbench/smollm2/snapkv_perturbation_b128_max_length=1500_tasks=trec+lcc"


# Cells of every kind a sweep, the bench or a test composes: option choices with values set before and after them,
# lists, nested knobs, presets, ablations, experiments (kvpress's press= and share budgets among them).
SPLIT_CELLS = [
    [],
    ["experiment=leaderboard", "method=kvzip", "selection=perturbation", "budget=512"],
    ["experiment=leaderboard_gemma_question_after", "method=cake", "selection=attention", "budget=0.75"],
    ["experiment=kvpress_leaderboard", "press=query_aware_adakv_snapkv", "budget=0.125"],
    ["budget=512", "benchmark=ruler", "benchmark.tasks=[niah_single_1]", "benchmark.lengths=[2048]",
     "method=snapkv", "ablation=epsilon"],
    ["preset=criticalkv", "method=adakv", "budget=64", "selection.alpha=0.5"],
    ["selection.alpha=0", "selection=perturbation_released", "profile=kvpress", "method.window=16"],
    ["model=llama31", "engine.pool=4", "results_dir=elsewhere", "compress.trigger=300", "+extra.knob=1"],
]


@pytest.mark.parametrize("cell", SPLIT_CELLS, ids=[" ".join(c) or "defaults" for c in SPLIT_CELLS])
def test_values_set_on_a_composed_choice_give_hydras_whole_composition(cell):
    """``compose`` composes the option choices once and sets plain values on a copy (Hydra's own last step):
    the config equals Hydra composing every override at once, key for key and in order, struct mode included."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        whole = hydra_compose(config_name="config", overrides=cell)
    split = compose_cfg(*cell)
    assert OmegaConf.to_yaml(split) == OmegaConf.to_yaml(whole)
    assert OmegaConf.is_struct(split) and OmegaConf.is_struct(whole)


def test_cells_that_differ_in_values_compose_their_choices_once():
    """Two budgets and a knob of one method and selection cost one composition; a wrong key is refused as Hydra
    refuses it."""
    from hydra.errors import ConfigCompositionException
    from pcs.config import _composed
    cell = ["method=tova", "selection=attention", "profile=adakv"]
    before = _composed.cache_info().misses
    budgets = {compose_cfg(*cell, f"budget={b}", "engine.pool=4").budget for b in (17, 19)}
    assert budgets == {17, 19} and _composed.cache_info().misses == before + 1
    with pytest.raises(ConfigCompositionException, match="Could not override 'budgt'"):
        compose_cfg(*cell, "budgt=5")
