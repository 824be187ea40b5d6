"""LongBench v1's official metrics, reproduced exactly (THUDM/LongBench ``metrics.py`` and ``eval.py``).

Exact means the same number as the official evaluation for the same predictions, quirks included:
- QA-F1 after SQuAD normalisation (ASCII punctuation, articles a/an/the); the Chinese variant on jieba words;
- ROUGE-L F from the ``rouge`` package (sentences split on ".", case-sensitive, words as sets), and 0.0
  whenever it raises: an empty prediction, or a long sentence pair exhausting Python's recursion limit
  (reproduced at the stack depth of the official script, see ``_official_recursion_limit``);
- classification removes matches from the list it iterates over, skipping the item after each removal;
- code similarity is ``fuzz.ratio``, an integer, with a selectable matcher (``FUZZY_BACKENDS``);
- trec, triviaqa, samsum and lsht keep the first line of the prediction; a sample scores the max over
  its references; a task scores ``round(100 * sum / n, 2)`` summed in order, as ``eval.py`` does.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import logging
import re
import string
import subprocess
import sys
import warnings
from collections import Counter


@functools.cache
def _jieba():
    """jieba, imported on the first Chinese text: with pkg_resources it is about 0.1 s of import (``-X
    importtime``), which config checks and the English tasks need not pay."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # jieba imports the deprecated pkg_resources
        import jieba
    jieba.setLogLevel(logging.WARNING)
    return jieba


FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
CN_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛"
                  "〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, then the articles a/an/the, then squeeze whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, remove all whitespace."""
    drop = set(string.punctuation + CN_PUNCTUATION)
    return "".join("".join(ch for ch in s.lower() if ch not in drop).split())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str, **_) -> float:
    def words(text):
        return [w for w in (normalize_zh_answer(t) for t in _jieba().cut(text, cut_all=False)) if w]
    return token_f1(words(prediction), words(reference))


def _recursion_headroom(depth: int = 0) -> int:
    """How many more nested Python calls fit under the recursion limit from the caller's frame."""
    try:
        return _recursion_headroom(depth + 1)
    except RecursionError:
        return depth


# eval.py calls Rouge from module -> scorer -> rouge_score under the default limit of 1000. The
# recursion in ``rouge`` fails on the same long pairs here only if we grant the same headroom.
OFFICIAL_CALL_SHAPE = f"""
import sys
sys.setrecursionlimit(1000)
{inspect.getsource(_recursion_headroom)}
def rouge_score(): return _recursion_headroom()
def scorer(): return rouge_score()
print(scorer())
"""


@functools.cache
def official_headroom() -> int:
    """Measured once in a fresh interpreter shaped like ``python eval.py``."""
    out = subprocess.run([sys.executable, "-c", OFFICIAL_CALL_SHAPE], capture_output=True, text=True, check=True)
    return int(out.stdout)


def rouge_l(prediction: str, reference: str, official_frames_above: int = 0, **_) -> float:
    """ROUGE-L F of the ``rouge`` package, with the recursion headroom the official ``rouge_score`` has
    when ``official_frames_above`` more official frames sit between it and ``scorer``."""
    from rouge import Rouge     # here, not at the top: a config check imports this module and scores nothing
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(old_limit - _recursion_headroom() + official_headroom() - official_frames_above)
    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:   # the official bare ``except``: empty text, recursion depth, ...
        return 0.0
    finally:
        sys.setrecursionlimit(old_limit)


def rouge_l_zh(prediction: str, reference: str, **_) -> float:
    def spaced(text):
        return " ".join(_jieba().cut(text, cut_all=False))
    # Officially scorer -> rouge_zh_score -> rouge_score: one frame more than the English path.
    return rouge_l(spaced(prediction), spaced(reference), official_frames_above=1)


def classification(prediction: str, reference: str, all_classes=None, **_) -> float:
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in reference and term != reference:
            matches.remove(term)
        i += 1   # the official loop advances even after a removal, so it skips the next match
    return 1.0 / len(matches) if reference in matches else 0.0


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else float(sum(n == target for n in numbers) / len(numbers))


def count(prediction: str, reference: str, **_) -> float:
    return _share_of_numbers_equal(prediction, str(reference))


def retrieval(prediction: str, reference: str, **_) -> float:
    return _share_of_numbers_equal(prediction, re.findall(r"Paragraph (\d+)", reference)[0])


def retrieval_zh(prediction: str, reference: str, **_) -> float:
    return _share_of_numbers_equal(prediction, re.findall(r"段落(\d+)", reference)[0])


def _levenshtein_ratio(a: str, b: str) -> float:
    import Levenshtein
    return Levenshtein.ratio(a, b)


# fuzzywuzzy computes ``fuzz.ratio`` with python-Levenshtein when installed, else difflib; the two
# disagree on some pairs. difflib is what a plain ``pip install fuzzywuzzy`` gives.
FUZZY_BACKENDS = {
    "difflib": lambda a, b: difflib.SequenceMatcher(None, a, b).ratio(),
    "levenshtein": _levenshtein_ratio,
}


def fuzz_ratio(a: str, b: str, backend: str = "difflib") -> int:
    """``fuzzywuzzy.fuzz.ratio``: 100 if equal, 0 if either is empty, else round(100 * ratio)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * FUZZY_BACKENDS[backend](a, b)))


def code_similarity(prediction: str, reference: str, fuzzy_backend: str = "difflib", **_) -> float:
    """``fuzz.ratio / 100`` of the first line holding no backtick, ``#`` or ``//`` (else "")."""
    line = next((l for l in prediction.lstrip("\n").split("\n")
                 if "`" not in l and "#" not in l and "//" not in l), "")
    return fuzz_ratio(line, reference, fuzzy_backend) / 100


TASK_METRICS = {
    "narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1, "2wikimqa": qa_f1, "musique": qa_f1, "dureader": rouge_l_zh,
    "gov_report": rouge_l, "qmsum": rouge_l, "multi_news": rouge_l, "vcsum": rouge_l_zh,
    "trec": classification, "triviaqa": qa_f1, "samsum": rouge_l, "lsht": classification,
    "passage_retrieval_en": retrieval, "passage_count": count, "passage_retrieval_zh": retrieval_zh,
    "lcc": code_similarity, "repobench-p": code_similarity,
}


def sample_score(task: str, prediction: str, answers: list[str], all_classes=None,
                 fuzzy_backend: str = "difflib") -> float:
    """One sample, 0-1: the first-line rule where official, then the best over the references."""
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = TASK_METRICS[task]
    score = 0.0
    for reference in answers:
        score = max(score, metric(prediction, reference, all_classes=all_classes, fuzzy_backend=fuzzy_backend))
    return score


def longbench_score(task: str, predictions: list[str], answers: list[list[str]], all_classes=None,
                    fuzzy_backend: str = "difflib") -> float:
    """The task's official score: ``round(100 * mean sample score, 2)``."""
    if task not in TASK_METRICS:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(TASK_METRICS)}")
    total = 0.0
    for prediction, references in zip(predictions, answers, strict=True):
        total += sample_score(task, prediction, references, all_classes, fuzzy_backend)
    return round(100 * total / len(predictions), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of a sample from its ``length`` field (words, or characters in Chinese)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def longbench_e_scores(task: str, predictions: list[str], answers: list[list[str]], lengths: list[int],
                       all_classes=None, fuzzy_backend: str = "difflib") -> dict[str, float | None]:
    """LongBench-E: the task's score per length bucket; None if empty (officially NaN).

    ``eval.py`` rounds the numpy float64 ``100 * np.mean(scores)``, and numpy's rounding (scale, rint,
    unscale) can differ from Python's correctly rounded ``round`` in the last digit, so it is kept."""
    import numpy as np
    buckets: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for prediction, references, length in zip(predictions, answers, lengths, strict=True):
        buckets[length_bucket(length)].append(sample_score(task, prediction, references, all_classes, fuzzy_backend))
    return {b: float(round(100 * np.mean(s), 2)) if s else None for b, s in buckets.items()}
