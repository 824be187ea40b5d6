"""LongBench's official metrics, checked against values worked out by hand from the official
definitions (eval.py / metrics.py and the ``rouge`` package's ROUGE-L), quirks included."""
import json
import subprocess
import sys

import numpy as np
import pytest

import pcs.metrics
from pcs.metrics import (code_similarity, fuzz_ratio, length_bucket, longbench_e_scores, longbench_score,
                         qa_f1, qa_f1_zh, rouge_l, rouge_l_zh, sample_score)

TREC_CLASSES = ["Abbreviation", "Animal", "Location", "City", "Human being", "Description of something"]


def test_qa_f1_normalises_like_squad():
    assert qa_f1("The Cat, sat!", "a cat sat") == 1.0          # case, punctuation, articles
    assert qa_f1("Paris France", "Paris") == pytest.approx(2 / 3)  # p = 1/2, r = 1
    assert qa_f1("theater", "the ater") == 0                  # articles go only as whole words
    assert qa_f1("the-end", "theend") == 1.0                   # punctuation is dropped before articles
    assert qa_f1("", "Paris") == 0 and qa_f1("the a an", "Paris") == 0
    # Repeated words count with multiplicity: common = min(2, 1) = 1; p = 1/2, r = 1.
    assert qa_f1("yes yes", "yes") == pytest.approx(2 / 3)


def test_qa_f1_chinese_uses_jieba_words_without_punctuation():
    assert qa_f1_zh("厦门大学。", "厦门大学") == 1.0
    assert qa_f1_zh("北京 上海", "北京") == pytest.approx(2 / 3)  # words 北京, 上海 vs 北京
    assert qa_f1_zh("。", "北京") == 0


def test_rouge_l_follows_the_rouge_package():
    # Same text: F = 2pr / (p + r + 1e-8) with p = r = 1.
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(2 / (2 + 1e-8), abs=1e-12)
    # Words are sets: hyp {a, b} (n = 2), ref {a, b, c} (m = 3), union LCS {a, b}: r = 2/3, p = 1, F = 0.8.
    assert rouge_l("a a a b", "a b c") == pytest.approx(0.8, abs=1e-7)
    assert rouge_l("The Cat", "the cat") == 0.0                 # case-sensitive
    # Sentences split on ".": hyp sentences "b a" and "c"; union of their LCS with "a b c" has 2 words of 3.
    assert rouge_l("b a. c", "a b c") == pytest.approx(2 / 3, abs=1e-7)


@pytest.mark.parametrize("prediction", ["", "...", " . . "])
def test_rouge_l_is_zero_where_the_official_call_raises(prediction):
    assert rouge_l(prediction, "a reference summary") == 0.0
    assert sample_score("gov_report", prediction, ["a reference summary"]) == 0.0


def test_rouge_l_chinese_joins_jieba_words():
    # hyp words {北京, 上海}, ref {北京}: r = 1, p = 1/2, F = 2 * 0.5 / 1.5.
    assert rouge_l_zh("北京 上海", "北京") == pytest.approx(2 / 3, abs=1e-7)


OFFICIAL_SHAPE = """
import json
from rouge import Rouge
def rouge_score(p, g):
    rouge = Rouge()
    try:
        scores = rouge.get_scores([p], [g], avg=True)
    except:
        return 0.0
    return scores["rouge-l"]["f"]
def scorer(preds, ref):
    out = []
    for p in preds:
        out.append(rouge_score(p, ref))
    return out
ref = " ".join(f"r{i}" for i in range(40)) + " common"
preds = [" ".join(f"w{i}" for i in range(k)) + " common" for k in range(930, 1000)]
print(json.dumps(scorer(preds, ref)))
"""


def test_long_pairs_fail_exactly_where_the_official_script_hits_the_recursion_limit():
    """A fresh interpreter shaped like ``python eval.py`` is the reference: the same pairs must score 0.0."""
    official = json.loads(subprocess.run([sys.executable, "-c", OFFICIAL_SHAPE], capture_output=True,
                                         text=True, check=True).stdout)
    assert 0 < official.count(0.0) < len(official)    # the range straddles the limit
    ref = " ".join(f"r{i}" for i in range(40)) + " common"

    def ours(depth):  # called from deeper in the stack than eval.py ever is
        if depth:
            return ours(depth - 1)
        return [rouge_l(" ".join(f"w{i}" for i in range(k)) + " common", ref) for k in range(930, 1000)]
    assert ours(0) == official
    assert ours(200) == official


OFFICIAL_ZH_SHAPE = OFFICIAL_SHAPE.replace("def scorer(preds, ref):", """import jieba
def rouge_zh_score(p, g):
    p = " ".join(list(jieba.cut(p, cut_all=False)))
    g = " ".join(list(jieba.cut(g, cut_all=False)))
    return rouge_score(p, g)
def scorer(preds, ref):""").replace("out.append(rouge_score(p, ref))", "out.append(rouge_zh_score(p, ref))")


def test_chinese_long_pairs_fail_where_the_official_chinese_path_does():
    """eval.py reaches ``rouge_score`` through ``rouge_zh_score`` (THUDM/LongBench metrics.py), one frame
    deeper than the English path, so its limit comes one word earlier."""
    official = json.loads(subprocess.run([sys.executable, "-c", OFFICIAL_ZH_SHAPE], capture_output=True,
                                         text=True, check=True).stdout)
    english = json.loads(subprocess.run([sys.executable, "-c", OFFICIAL_SHAPE], capture_output=True,
                                        text=True, check=True).stdout)
    assert official.count(0.0) == english.count(0.0) + 1   # the reference shows the one-frame shift
    ref = " ".join(f"r{i}" for i in range(40)) + " common"
    ours = [rouge_l_zh(" ".join(f"w{i}" for i in range(k)) + " common", ref) for k in range(930, 1000)]
    assert ours == official


def test_classification_keeps_the_official_removal_quirk():
    gt = "Description of something"
    # Plain case: one class named.
    assert sample_score("trec", "Location", ["Location"], TREC_CLASSES) == 1.0
    # Two classes named, one of them right: 1/2.
    assert sample_score("trec", "City or Location", ["Location"], TREC_CLASSES) == 0.5
    # Matches that are substrings of the truth are removed while iterating, so the item after each
    # removal is skipped: [c, ca, category] -> remove "c" -> "ca" skipped -> [ca, category] -> 1/2.
    assert sample_score("trec", "category", ["category"], ["c", "ca", "category"]) == 0.5
    assert sample_score("trec", "nothing", [gt], TREC_CLASSES) == 0.0
    # First line only (trec, triviaqa, samsum, lsht).
    assert sample_score("trec", "\nLocation\nHuman being", ["Location"], TREC_CLASSES) == 1.0
    assert sample_score("trec", "Type:\nLocation", ["Location"], TREC_CLASSES) == 0.0


def test_retrieval_and_count_score_the_share_of_right_numbers():
    assert sample_score("passage_retrieval_en", "Paragraph 3, not 13 or 3", ["Paragraph 3"]) == pytest.approx(2 / 3)
    assert sample_score("passage_retrieval_en", "none", ["Paragraph 3"]) == 0.0
    assert sample_score("passage_retrieval_zh", "段落5", ["段落5"]) == 1.0
    assert sample_score("passage_count", "There are 12 unique paragraphs out of 20", [12]) == 0.5


def test_code_similarity_takes_the_first_plain_line_and_an_integer_ratio():
    prediction = "```python\n# a comment\nx = foo(1)\n// more\n"
    assert code_similarity(prediction, "x = foo(2)") == 0.9     # 2 * 9 / 20
    # fuzz.ratio is an integer: 2 * 8 / 18 = 0.888... -> 89 -> 0.89.
    assert code_similarity("abcdefghi", "abcdefghj") == 0.89
    assert code_similarity("# only comments", "x = 1") == 0.0   # no plain line -> "" -> 0
    assert code_similarity("", "") == 1.0                       # equal strings are 100 before the empty check


def test_fuzzy_backends_differ_as_their_matchers_do():
    # difflib takes the longest block "aa" and nothing else matches: 2 * 2 / 7 -> 57.
    # Levenshtein's ratio uses the indel distance, i.e. the LCS "aaa": 2 * 3 / 7 -> 86.
    assert fuzz_ratio("aaa", "abaa", "difflib") == 57
    assert fuzz_ratio("aaa", "abaa", "levenshtein") == 86
    assert code_similarity("aaa", "abaa", fuzzy_backend="levenshtein") == 0.86


def test_fuzz_ratio_matches_fuzzywuzzy_with_its_active_matcher():
    from fuzzywuzzy import fuzz
    backend = "levenshtein" if fuzz.SequenceMatcher.__module__.endswith("StringMatcher") else "difflib"
    pairs = [("aaa", "abaa"), ("x = foo(1)", "x = foo(2)"), ("", "a"), ("same", "same"), ("return a+b", "return b+a")]
    assert [fuzz_ratio(a, b, backend) for a, b in pairs] == [fuzz.ratio(a, b) for a, b in pairs]


def test_task_score_is_the_rounded_mean_of_best_reference_scores():
    predictions = ["Paris", "London", "Rome Italy"]
    answers = [["Paris"], ["Berlin", "london"], ["Rome"]]          # 1, max(0, 1), 2/3
    assert longbench_score("hotpotqa", predictions, answers) == round(100 * (1 + 1 + 2 / 3) / 3, 2) == 88.89
    assert longbench_score("trec", ["Location", "City"], [["Location"], ["Animal"]], TREC_CLASSES) == 50.0
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench_score("nope", ["a"], [["a"]])


def test_longbench_e_rounds_a_numpy_float_as_the_official_script(monkeypatch):
    """eval.py's scorer_e: ``scores[key] = round(100 * np.mean(scores[key]), 2)``, numpy's rounding."""
    monkeypatch.setattr(pcs.metrics, "sample_score", lambda task, prediction, *a: float(prediction))
    for mean in (0.28945, 0.55555, 0.14285):
        got = longbench_e_scores("hotpotqa", [str(mean)], [["x"]], [100])["0-4k"]
        assert got == float(round(100 * np.mean([mean]), 2)) != round(100 * mean, 2)


def test_longbench_e_buckets_by_length():
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    scores = longbench_e_scores("hotpotqa", ["paris", "b", "c"], [["paris"], ["x"], ["c"]], [100, 200, 9000])
    assert scores == {"0-4k": 50.0, "4-8k": None, "8k+": 100.0}
