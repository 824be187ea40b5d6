"""benchmark.follow_up: further questions about other needles of the same context, each answered from its own copy
of the sample's compressed cache. Checked against RULER's needles as the prompt holds them, the tokenization of a
prompt asked the follow-up alone, and a prefill and decode of each question on its own (batch 1)."""
import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from pcs.benchmarks.base import build_benchmark, checked_benchmark
from pcs.benchmarks.ruler_data import NIAH
from pcs.cache import CompressedCache
from pcs.engine import Arrival, Cell, DecodePool, decode, prefill
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.generate import greedy_generate
from pcs.runner import run

from conftest import compose_cfg, tiny_model

TASKS = ["niah_single_2", "niah_multikey_1", "niah_multikey_2"]   # multivalue, multiquery: more keys do not fit 1,024


def ruler(tmp_path, *extra, tasks=TASKS):
    cfg = compose_cfg("benchmark=ruler", "benchmark.n_samples=3", "benchmark.lengths=[1024]",
                      f"benchmark.tasks=[{','.join(tasks)}]", f"benchmark.cache_dir={tmp_path}", *extra)
    return checked_benchmark(cfg), cfg


def needles(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"One of the special magic \w+ for (.+?) is: (\S+)\.", text):
        found.setdefault(key, []).append(value)
    return found


def asked_keys(sample) -> set[str]:
    query = re.findall(r"for (.+?) mentioned in the provided text\?", sample.prompt)[-1]
    return set(re.split(r",\s*(?:and\s+)?", query))


def test_follow_ups_ask_for_other_needles_of_the_context(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    bench, _ = ruler(tmp_path, "benchmark.follow_up=3")
    plain, _ = ruler(tmp_path / "plain")
    samples, alone = bench.samples(tokenizer), {s.id: s for s in plain.samples(tokenizer)}
    assert len(samples) == 9
    for s in samples:
        held, asked = needles(s.prompt), asked_keys(s)
        keys = [re.search(r"for (.+?) mentioned", up.question).group(1) for up in s.follow_ups]
        assert len(s.follow_ups) == 3 and len(set(keys)) == 3 and not set(keys) & asked
        for key, up in zip(keys, s.follow_ups):
            assert up.meta["outputs"] == held[key]            # every value of the key's needles, in order
            singular = len(held[key]) == 1
            assert up.question.startswith("What is the special magic" if singular else "What are all the special magic")
            assert up.answer_prefix == f" The special magic {NIAH[s.meta['task']].type_v[:-1] if singular else NIAH[s.meta['task']].type_v} for {key} mentioned in the provided text {'is' if singular else 'are'}"
        assert s.reply == " " + ", ".join(s.meta["outputs"]) + "."
        # the tasks with keys enough keep RULER's own samples; niah_single_2 and multivalue draw 3 more keys
        same = alone[s.id].prompt == s.prompt
        assert same == (s.meta["task"] in ("niah_multikey_1", "niah_multikey_2")), s.id
        if s.meta["task"] == "niah_single_2":
            assert len(held) == 4            # the asked key's needles and 3 more keys' (their values each)


def test_a_follow_up_replaces_the_question_kept_out_or_follows_the_first_answer(embedded_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    for aware in (False, True):
        bench, cfg = ruler(tmp_path / str(aware), "benchmark.follow_up=2", f"benchmark.query_aware={aware}",
                           tasks=["niah_multikey_1"])
        for s in bench.samples(tokenizer):
            ids = bench.encode(s, tokenizer, cfg.model)
            assert len(ids.follow_ups) == 2
            for up, tail in zip(s.follow_ups, ids.follow_ups):
                text = tokenizer.decode(tail)
                if aware:      # the next turn: the first answer's reference, then the follow-up
                    assert ids.question is None
                    assert text == (s.reply + "<|im_end|>\n<|im_start|>user\n" + up.question
                                    + "<|im_end|>\n<|im_start|>assistant\n" + up.answer_prefix)
                else:          # the prompt as if the follow-up were its question: the same context before it
                    alone = tokenizer.apply_chat_template(
                        [{"role": "user", "content": s.prompt[:s.prompt.rfind(s.question)] + up.question}],
                        tokenize=False, add_generation_prompt=True) + up.answer_prefix
                    assert tokenizer.decode(ids.context) + text == alone
                    assert text.startswith(up.question)


def test_tasks_without_other_facts_refuse_follow_ups_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="benchmark.follow_up=1: vt, cwe have no other facts"):
        ruler(tmp_path, "benchmark.follow_up=1", tasks=["niah_single_1", "vt", "cwe"])


CELLS = [("method=snapkv", "budget=40", "method.window=8", "method.kernel=3"),
         ("method=adakv", "budget=40", "method.window=8", "method.kernel=3", "selection=attention"),
         ("method=full",)]


@pytest.mark.parametrize("inside,trigger", [(True, None), (False, None), (False, 70)])
def test_each_question_gets_what_a_prefill_of_its_own_gives(arch, inside, trigger):
    """Every cell's answer to the prompt's question and to each follow-up equals greedy decoding of that question
    alone on a prefill of its own: the copies share nothing a question writes (the last question takes the
    original cache, after the others were fed on copies)."""
    model = tiny_model(arch)
    draw = lambda n, seed: torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))
    ids, question = draw(120, 3), None if inside else draw(7, 4)
    ups = (draw(5, 5), draw(9, 6))
    cells = [c for c in CELLS if trigger is None or "method=full" not in c]
    methods = [build_method(compose_cfg(*c)) for c in cells]
    arrival = Arrival(model, ids, [Cell(m, trigger) for m in methods], 12, set(), question,
                      owners=[(i, j) for i in range(len(methods)) for j in range(3)], follow_ups=ups)
    got = {seq.owner: seq.result for seq in decode(DecodePool(model, 1), [arrival])}
    for i, method in enumerate(methods):
        for j, asked in enumerate((question, *ups)):
            alone = greedy_generate(model, ids, method, 12, set(), question_ids=asked, trigger=trigger)
            assert got[(i, j)].token_ids == alone.token_ids and got[(i, j)].kv_cache_bytes == alone.kv_cache_bytes
            assert got[(i, j)].prompt_tokens == alone.prompt_tokens


def test_answers_wait_on_one_cache_per_cell_and_may_be_asked_in_any_order(monkeypatch):
    """A sample's answers hold one compressed cache per cell until each is asked (a follow-up's copy is made as it
    is about to join the pool, not at the prefill), and each answer, asked last-question first, holds what the
    prefill asked in order gives it: its own question's first logits and entries."""
    model = tiny_model("llama")
    draw = lambda n, seed: torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))
    ids, question, ups = draw(120, 3), draw(7, 4), (draw(5, 5), draw(9, 6))
    cells = [Cell(build_method(compose_cfg(*c))) for c in CELLS]
    in_order = prefill(model, ids, cells, 12, set(), question, follow_ups=ups)
    copies, copy = [], CompressedCache.copy
    monkeypatch.setattr(CompressedCache, "copy", lambda cache: copies.append(cache) or copy(cache))
    answers = Arrival(model, ids, cells, 12, set(), question, follow_ups=ups).answers()
    assert len(answers) == len(cells) * 3 and not copies
    asked = {answer.source[1]: answer.ask() for answer in reversed(answers)}
    assert len(copies) == len(cells) * 2                 # each cell's last answer asked takes its original
    for k, seq in enumerate(in_order):
        assert torch.equal(asked[k].logits, seq.logits), k
        for got, want in zip(asked[k].cache.layers, seq.cache.layers):
            assert got.entries_per_head() == want.entries_per_head()
            for (gk, gv), (wk, wv) in zip(got.heads(), want.heads()):
                assert torch.equal(gk, wk) and torch.equal(gv, wv), k


def test_a_run_scores_each_follow_up_on_its_own_references(tiny_model_dir, tmp_path):
    """A RULER run with follow-ups: one row per sample, its follow-ups' answers, scores and references in it, each
    answer the one decoding its question alone on a prefill of its own gives, and metrics that score the first
    questions and the follow-ups apart."""
    cfg = compose_cfg("benchmark=ruler", "benchmark.n_samples=2", "benchmark.lengths=[1024]",
                      "benchmark.tasks=[niah_multikey_1]", f"benchmark.cache_dir={tmp_path / 'ruler'}",
                      "benchmark.follow_up=2", "benchmark.query_aware=false", "method=snapkv", "budget=64",
                      f"model.path={tiny_model_dir}", f"results_dir={tmp_path / 'results'}", "progress=false")
    metrics = run(cfg)
    run_dir = next((tmp_path / "results").rglob("predictions.jsonl")).parent
    assert "follow_up=2" in run_dir.name
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    bench = build_benchmark(cfg)
    assert len(rows) == 2 and all(len(r["follow_ups"]) == 2 for r in rows)
    for row in rows:
        for up in row["follow_ups"]:
            assert up["score"] == bench.score({**row, **up}) and up["outputs"] != row["outputs"]
        assert row["follow_up_score"] == sum(up["score"] for up in row["follow_ups"]) / 2
    assert metrics["follow_up"]["n"] == 2
    assert metrics["follow_up"]["score"] == pytest.approx(sum(r["follow_up_score"] for r in rows) / 2)
    assert metrics["domains"]["follow_up_1024"] == pytest.approx(metrics["follow_up"]["score"])
    assert metrics["score"] == pytest.approx(sum(r["score"] for r in rows) / 2)
    # each follow-up's answer: its question alone on a prefill of its own
    from pcs.models import load_model, stop_token_ids
    model, tokenizer = load_model(cfg.model)
    stops = stop_token_ids(model, tokenizer, cfg.model.stop_tokens)
    method = build_method(cfg)
    samples = {s.id: s for s in bench.samples(tokenizer)}
    for row in rows:
        prompt = bench.encode(samples[row["id"]], tokenizer, cfg.model)
        for up, tail in zip(row["follow_ups"], prompt.follow_ups):
            alone = greedy_generate(model, torch.tensor([prompt.context]), method, samples[row["id"]].max_new_tokens,
                                    stops, question_ids=torch.tensor([tail]))
            assert up["prediction"] == tokenizer.decode(alone.token_ids, skip_special_tokens=True)


def test_needle_follow_ups_are_needles_of_their_own_scored_on_their_own(embedded_dir):
    from pcs.benchmarks.needle import FOLLOW_UP_FACTS
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    cfg = compose_cfg("benchmark.follow_up=2", "benchmark.context_lengths=[600]", "benchmark.depth_percents=[0,75]",
                      "benchmark.query_aware=false")
    bench = checked_benchmark(cfg)
    for s in bench.samples(tokenizer):
        ups = s.follow_ups
        assert [up.meta["needle"] for up in ups] == [needle for needle, _ in FOLLOW_UP_FACTS[:2]]
        assert [up.meta["depth_percent"] for up in ups] == [(s.meta["depth_percent"] + d) % 100 for d in (100 / 3, 200 / 3)]
        context = s.prompt[:s.prompt.rfind(s.question)]
        assert cfg.benchmark.needle in context and all(up.meta["needle"] in context for up in ups)
        assert len(tokenizer.encode(context, add_special_tokens=False)) <= 600 + 8
        ids = bench.encode(s, tokenizer, cfg.model)
        assert [tokenizer.decode(t).startswith(up.question) for t, up in zip(ids.follow_ups, ups)] == [True, True]
        # each answer is scored on its own needle: the first question's needle scores a follow-up's answer low
        row = {**s.meta, "prediction": FOLLOW_UP_FACTS[0][0], "follow_ups": [{**ups[0].meta, "prediction": FOLLOW_UP_FACTS[0][0]}]}
        scored = bench.scored(row)
        assert scored["follow_ups"][0]["score"] == 100.0 and scored["score"] < 50
    with pytest.raises(ConfigError, match="benchmark.follow_up=5"):
        checked_benchmark(compose_cfg("benchmark.follow_up=5"))


def test_protocols_are_named_and_never_share_a_leaderboard_table():
    import pandas as pd
    from pcs.identity import RunIdentity
    from pcs.report.leaderboard import COLUMNS, markdown, tables
    named = {o: RunIdentity(compose_cfg("benchmark=ruler", *o)).protocol for o in
             [(), ("benchmark.query_aware=false",), ("benchmark.follow_up=3",),
              ("benchmark.follow_up=1", "benchmark.query_aware=false")]}
    assert list(named.values()) == ["question inside", "question after compression",
                                    "question inside + 3 follow-ups after compression",
                                    "question after compression + 1 follow-up after compression"]
    assert RunIdentity(compose_cfg("benchmark=alpacaeval")).protocol is None
    rows = [dict.fromkeys(COLUMNS) | {"model": "m", "length": "2048", "method": "snapkv", "selection": "attention",
                                      "budget": 256, "n": 10, "score": s, "kv_kept": 0.1, "protocol": p}
            for p, s in [("question inside", 50.0), ("question after compression", 20.0)]]
    board = pd.DataFrame(rows, columns=COLUMNS)
    split = tables(board)
    assert [(p, len(block)) for _, p, _, _, block in split] == [("question inside", 1), ("question after compression", 1)]
    text = "\n".join(markdown(board))
    assert "### m, 2048 tokens, question inside (10 samples per run)" in text
    assert "### m, 2048 tokens, question after compression (10 samples per run)" in text


def test_facts_are_the_needles_of_keys_the_question_does_not_ask():
    """niah_multiquery asks several keys (RULER joins them ``a, b, and c``), niah_multivalue one key of several
    values: a follow-up asks another key, for all of its values."""
    from pcs.benchmarks.ruler_data import niah_facts
    needle = "One of the special magic numbers for {} is: {}."
    context = " ".join([needle.format("red-fox", 1), "Some text.", needle.format("blue-owl", 2),
                        needle.format("old-elm", 3), needle.format("blue-owl", 4), needle.format("tan-cat", 5)])
    asked = "What are all the special magic numbers for red-fox, old-elm, and tan-cat mentioned in the provided text?"
    assert niah_facts(context, asked) == {"blue-owl": ["2", "4"]}
    one = "What is the special magic number for blue-owl mentioned in the provided text?"
    assert niah_facts(context, one) == {"red-fox": ["1"], "old-elm": ["3"], "tan-cat": ["5"]}
    # a key of two words (RULER's list has "contact lens"), asked or not
    spaced = context + " " + needle.format("judicious-contact lens", 6)
    assert niah_facts(spaced, one)["judicious-contact lens"] == ["6"]
    asked = "What is the special magic number for judicious-contact lens mentioned in the provided text?"
    assert "judicious-contact lens" not in niah_facts(spaced, asked) and len(niah_facts(spaced, asked)) == 4
