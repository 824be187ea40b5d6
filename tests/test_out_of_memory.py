"""Out of device memory, decoding goes on with fewer answers in flight and gives the answers it gives with room
to spare; a sample that does not fit alone stops the run with a message naming it, its token count and the knobs
that would make it fit, after every answer finished before it is on disk.

The faults are injected where a GPU raises them: ``torch.OutOfMemoryError`` from the model's forward (a prefill,
or a decoding step over more answers than a pretend device holds) and from the pool's buffers as a sequence
joins."""
import json
from pathlib import Path

import pytest
import torch

import pcs.models
import pcs.runner
from pcs.engine import Arrival, Cell, DecodePool, DoesNotFit, decode
from pcs.engine.pool import PoolLayer
from pcs.engine.pool_cache import PoolCache
from pcs.identity import RunIdentity
from pcs.runner import SampleDoesNotFit, run_cells

from conftest import compose_cfg, tiny_model
from oracles import build, samples

CELLS = [("method=snapkv",), ("method=adakv", "selection=perturbation"), ("method=pyramidkv", "profile=kvpress"),
         ("method=streamingllm",), ("method=full",)]
TIMINGS = ("prefill_s", "decode_s")


def out_of_memory():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


def fail_forward(model, when):
    """The model's forward raises out-of-memory whenever ``when(kind, input_ids)`` says so; kind is 'prefill'
    (a prompt or a question on a batch-1 cache) or 'decode' (a pool's step)."""
    def hook(module, args, kwargs):
        kind = "decode" if isinstance(kwargs.get("past_key_values"), PoolCache) else "prefill"
        if when(kind, kwargs["input_ids"]):
            raise out_of_memory()
    return model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(model):
    return samples(model)           # 4 prompts of 90, 150, 30 and 120 tokens, one with its question after


def arrivals(model, prompts):
    triggers = [None, None, 60, None, None]      # one cell recompresses while it decodes
    return [Arrival(model, s["ids"], [Cell(build(c), t) for c, t in zip(CELLS, triggers)], s["max_new"], s["stops"],
                    s["question"], s["min_new"], owners=[(i, j) for j in range(len(CELLS))], name=f"sample-{i}")
            for i, s in enumerate(prompts)]


def answers(pool, model, prompts) -> dict:
    out = {}
    for seq in decode(pool, arrivals(model, prompts)):
        assert seq.owner not in out                    # each answer once
        out[seq.owner] = (seq.result.token_ids, seq.result.kv_cache_bytes, seq.result.max_kv_entries)
    return out


@pytest.fixture(scope="module")
def roomy(model, prompts):
    """Every answer with no fault, 8 in flight."""
    got = answers(DecodePool(model, 8), model, prompts)
    assert len(got) == len(prompts) * len(CELLS)
    return got


def test_a_step_out_of_memory_goes_on_with_half_as_many_in_flight(model, prompts, roomy, capsys):
    hook = fail_forward(model, lambda kind, ids: kind == "decode" and ids.shape[0] > 3)   # the device holds 3
    try:
        pool = DecodePool(model, 8)
        assert answers(pool, model, prompts) == roomy
    finally:
        hook.remove()
    assert pool.limit == 2                               # 8 -> 4 -> 2
    assert "out of memory decoding 8 answers" in capsys.readouterr().out


def test_a_prefill_out_of_memory_waits_for_the_answers_in_flight(model, prompts, roomy, capsys):
    pool = DecodePool(model, 8)
    hook = fail_forward(model, lambda kind, ids: kind == "prefill" and ids.shape[1] > 1 and bool(pool.sequences))
    try:
        assert answers(pool, model, prompts) == roomy
    finally:
        hook.remove()
    assert "it is prefilled alone once they finish" in capsys.readouterr().out


def test_a_question_fed_out_of_memory_waits_for_the_answers_in_flight(model, prompts, roomy, capsys):
    """A question fed after compression is fed as its answer is about to join the pool: out of memory there, its
    sample is prefilled again alone once the answers in flight finish."""
    (asked,) = [s["question"].shape[1] for s in prompts if s["question"] is not None]
    pool, failed = DecodePool(model, 8), []

    def when(kind, ids):
        if kind == "prefill" and ids.shape[1] == asked and pool.sequences and not failed:
            failed.append(len(pool.sequences))
            return True
        return False

    hook = fail_forward(model, when)
    try:
        assert answers(pool, model, prompts) == roomy
    finally:
        hook.remove()
    assert failed and "ran out of memory feeding its question with" in capsys.readouterr().out


def test_a_sequence_that_cannot_join_waits_and_the_pool_admits_fewer(model, prompts, roomy, monkeypatch):
    load, failed = PoolLayer.load, []

    def load_or_fail(layer, slot, held, room):
        if slot == 3 and not failed:            # the buffers cannot grow for a fourth answer, once
            failed.append(slot)
            raise out_of_memory()
        return load(layer, slot, held, room)

    monkeypatch.setattr(PoolLayer, "load", load_or_fail)
    pool = DecodePool(model, 8)
    assert answers(pool, model, prompts) == roomy
    assert failed and pool.limit == 3


def test_a_prompt_that_does_not_fit_alone_stops_after_the_answers_before_it(model, prompts, roomy):
    long_prompt = max(p["ids"].shape[1] for p in prompts)           # sample 1, 150 tokens, second to arrive
    hook = fail_forward(model, lambda kind, ids: kind == "prefill" and ids.shape[1] >= long_prompt)
    got = {}
    try:
        with pytest.raises(DoesNotFit) as err:
            for seq in decode(DecodePool(model, 8), arrivals(model, prompts)):
                got[seq.owner] = (seq.result.token_ids, seq.result.kv_cache_bytes, seq.result.max_kv_entries)
    finally:
        hook.remove()
    assert (err.value.name, err.value.tokens, err.value.stage) == ("sample-1", long_prompt, "in its prefill")
    assert got == {key: value for key, value in roomy.items() if key[0] == 0}    # sample 0's answers, all of them


def test_a_step_that_does_not_fit_with_one_answer_stops(model, prompts):
    hook = fail_forward(model, lambda kind, ids: kind == "decode")
    try:
        with pytest.raises(DoesNotFit) as err:
            list(decode(DecodePool(model, 8), arrivals(model, prompts)))
    finally:
        hook.remove()
    assert err.value.stage == "decoding"


def test_a_sequence_that_cannot_join_even_a_released_pool_does_not_fit(model, prompts, monkeypatch):
    """Every join runs out of memory: the pool is released once and tried again, then the sample is named."""
    joins = []

    def never(layer, slot, held, room):
        joins.append(slot)
        if len(joins) > 20:
            raise AssertionError("joined again and again: the sequence never gave up")
        raise out_of_memory()
    monkeypatch.setattr(PoolLayer, "load", never)
    with pytest.raises(DoesNotFit) as err:
        list(decode(DecodePool(model, 8), arrivals(model, prompts)))
    assert (err.value.name, err.value.stage) == ("sample-0", "joining the decode pool")
    assert len(joins) == 1                              # on a released pool: there is nothing more to free


def test_a_lone_answer_out_of_memory_on_grown_buffers_is_tried_again_on_fresh_ones(model, prompts, capsys):
    """The device holds one answer only in the smallest buffers: the last answer of a pool grown for 8, decoding
    alone once the others are done, runs out of memory, starts again from its prefill alone, and gives the answer
    it gives with no fault."""
    def two_arrivals():     # five answers of 12 tokens at most, then one of 16 that decodes alone at the end
        short, long = prompts[0], prompts[2]
        return [Arrival(model, short["ids"], [Cell(build(c)) for c in CELLS], short["max_new"], short["stops"],
                        owners=[(0, j) for j in range(len(CELLS))], name="sample-0"),
                Arrival(model, long["ids"], [Cell(build(CELLS[0]))], long["max_new"], set(), owners=[(2, 0)],
                        name="sample-2")]

    def run(pool):
        return {seq.owner: seq.result.token_ids for seq in decode(pool, two_arrivals())}
    want = run(DecodePool(model, 8))
    assert len(want[(2, 0)]) == prompts[2]["max_new"] > prompts[0]["max_new"]
    pool = DecodePool(model, 8)
    hook = fail_forward(model, lambda kind, ids: kind == "decode" and ids.shape[0] == 1 and pool.layers[0].slots > 1)
    try:
        assert run(pool) == want
    finally:
        hook.remove()
    assert "out of memory decoding 1 answers" in capsys.readouterr().out and pool.limit == 1


# -- a run ------------------------------------------------------------------------------------------------------

def needle(model_dir, results):
    return compose_cfg(f"model.path={model_dir}", f"results_dir={results}", "progress=false", "budget=64",
                       "method=snapkv", "engine.pool=4", "benchmark.context_lengths=[200,300,400]",
                       "benchmark.depth_percents=[0,50,100]", "benchmark.max_new_tokens=6")


def rows(cfg) -> list[dict]:
    path = Path(cfg.results_dir) / RunIdentity(cfg).folder / "predictions.jsonl"
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


def test_a_run_stops_on_a_sample_that_does_not_fit_keeps_every_earlier_row_and_resumes(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    want = needle(tiny_model_dir, tmp_path / "roomy")
    run_cells([want])
    reference = rows(want)
    longest = max(r["prompt_tokens"] for r in reference)
    first_long = next(i for i, r in enumerate(reference) if r["prompt_tokens"] > longest - 50)

    load_model = pcs.models.load_model

    def small_device(model_cfg, *location):
        model, tokenizer = load_model(model_cfg, *location)
        fail_forward(model, lambda kind, ids: kind == "prefill" and ids.shape[1] > longest - 50)
        return model, tokenizer

    cfg = needle(tiny_model_dir, tmp_path / "small")
    run_dir = Path(cfg.results_dir) / RunIdentity(cfg).folder
    monkeypatch.setattr(pcs.models, "load_model", small_device)
    with pytest.raises(SampleDoesNotFit) as err:
        run_cells([cfg])
    message = str(err.value)
    sample = reference[first_long]["id"]
    for needed in (f"sample {sample} ", f"({reference[first_long]['prompt_tokens']:,} prompt tokens)",
                   "benchmark.context_lengths", "model.device_map=auto", "engine.pool=4", "rerun resumes"):
        assert needed in message
    by_id = {r["id"]: r for r in reference}
    kept = rows(cfg)                                      # in the order answers finished
    assert sorted(r["id"] for r in kept) == sorted(r["id"] for r in reference[:first_long])
    assert all(r == by_id[r["id"]] for r in kept)         # every earlier row, complete; none after
    assert not (run_dir / "metrics.json").exists()
    assert "SampleDoesNotFit" in (run_dir / "error.txt").read_text()

    monkeypatch.setattr(pcs.models, "load_model", load_model)       # a device with room: the rerun completes it
    (metrics,) = run_cells([cfg])
    assert rows(cfg) == reference and metrics["n_resumed"] == first_long
