"""RULER's niah generator: draw for draw what RULER's own script gives (a transcription of it below), prompts
that fit their length, RULER's wording, and RULER's scoring."""
import random
import re
import uuid

import pytest

from pcs.benchmarks.ruler_data import (NIAH, NIAH_NEW_TOKENS, CweGenerator, FweGenerator, NiahGenerator,
                                       QaGenerator, cwe_vocabulary, normalize_kvpress, normalize_ruler, read_hotpotqa,
                                       read_squad, string_match_all, string_match_part)
from oracles import hotpot_like, squad_like

WORDS = sorted(f"{a}-{n}" for a in ("red", "big", "odd", "shy") for n in ("cat", "sea", "hat", "owl", "fig"))
count_words = lambda text: len(text.split())     # a whitespace "tokenizer"


def ruler_niah(task, max_seq_length, num_samples, words, seed=42):
    """hsiehjackson/RULER scripts/data/synthetic/niah.py (e40fae1), repeat and needle haystacks: the module's
    set-up (lines 62-92), generate_input_output (105-181) and generate_samples (184-241), with the global
    ``random`` as there; the template is RULER's niah template plus its answer prefix."""
    random.seed(seed)
    num_needle_k, num_needle_v, num_needle_q = max(task.k, task.q), task.v, task.q
    template = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                "{type_needle_v} for {query} mentioned in the provided text?"
                " The special magic {type_needle_v} for {query} mentioned in the provided text are")
    needle = "One of the special magic {type_needle_v} for {key} is: {value}."
    haystack = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
                if task.haystack == "repeat" else needle)

    def generate_random(type_needle):
        if type_needle == "numbers":
            return str(random.randint(10 ** 6, 10 ** 7 - 1))
        if type_needle == "words":
            return random.choice(words)
        return str(uuid.UUID(int=random.getrandbits(128), version=4))

    def generate_input_output(num_haystack):
        keys, values, needles = [], [], []
        for _ in range(num_needle_k):
            keys.append(generate_random(task.type_k))
            value = []
            for _ in range(num_needle_v):
                value.append(generate_random(task.type_v))
                needles.append(needle.format(type_needle_v=task.type_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(seed).shuffle(needles)
        if task.haystack == "repeat":
            sentences = [haystack] * num_haystack
        else:
            sentences = [haystack.format(type_needle_v=task.type_v, key=generate_random(task.type_k),
                                         value=generate_random(task.type_v)) for _ in range(num_haystack)]
        indexes = sorted(random.sample(range(num_haystack), len(needles)), reverse=True)
        for index, element in zip(indexes, needles):
            sentences.insert(index, element)
        context = "\n".join(sentences)
        indices = random.sample(range(num_needle_k), num_needle_q)
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        t, type_needle_v = template, task.type_v
        if num_needle_q * num_needle_v == 1:
            t = t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
            type_needle_v = type_needle_v[:-1]
        return t.format(type_needle_v=type_needle_v, context=context, query=query), answers

    incremental = 5 if max_seq_length < 4096 else 25
    num_haystack, total_tokens = incremental, 0
    while total_tokens + NIAH_NEW_TOKENS < max_seq_length:
        input_text, answer = generate_input_output(num_haystack)
        total_tokens = count_words(input_text + " ".join(answer))
        if total_tokens + NIAH_NEW_TOKENS > max_seq_length:
            num_haystack -= incremental
            break
        num_haystack += incremental
    out = []
    for index in range(num_samples):
        used_haystack = num_haystack
        while True:
            input_text, answer = generate_input_output(used_haystack)
            length = count_words(input_text) + NIAH_NEW_TOKENS
            if length <= max_seq_length:
                break
            if used_haystack > incremental:
                used_haystack -= incremental
        out.append({"index": index, "input": input_text, "outputs": answer, "length": length})
    return out


@pytest.mark.parametrize("name", ["niah_single_1", "niah_multikey_2", "niah_multikey_3"])
@pytest.mark.parametrize("length", [1024, 5000])
def test_offline_niah_tasks_are_rulers_draw_for_draw(name, length):
    ours = NiahGenerator(NIAH[name], count_words, length, WORDS).samples(6)
    assert ours == ruler_niah(NIAH[name], length, 6, WORDS)


@pytest.mark.parametrize("name", sorted(NIAH))
def test_every_prompt_fits_its_length_and_hides_its_answers(name):
    essay = ("It was a bright cold day in April. The clocks were striking thirteen! Nobody knew why? " * 400).split()
    generator = NiahGenerator(NIAH[name], count_words, 2048, WORDS, essay)
    samples = generator.samples(5)
    for s in samples:
        assert s["length"] == count_words(s["input"]) + NIAH_NEW_TOKENS <= 2048
        for answer in s["outputs"]:
            assert f"is: {answer}." in s["input"]
    assert max(s["length"] for s in samples) > 2048 - generator.step() - 150     # filled to within one step
    assert samples == NiahGenerator(NIAH[name], count_words, 2048, WORDS, essay).samples(5)   # same seed, same samples


def test_rulers_wording_singular_and_plural():
    single = NiahGenerator(NIAH["niah_single_2"], count_words, 1500, WORDS, ["Word."] * 3000).samples(1)[0]
    assert single["input"].startswith("A special magic number is hidden within the following text.")
    assert re.search(r"What is the special magic number for [a-z]+-[a-z]+ mentioned in the provided text\? "
                     r"The special magic number for [a-z]+-[a-z]+ mentioned in the provided text is$", single["input"])
    query = NiahGenerator(NIAH["niah_multiquery"], count_words, 1500, WORDS, ["Word."] * 3000).samples(1)[0]
    assert query["input"].startswith("Some special magic numbers are hidden")
    assert re.search(r"for [a-z-]+, [a-z-]+, [a-z-]+, and [a-z-]+ mentioned in the provided text are$", query["input"])
    assert len(query["outputs"]) == 4


def test_scoring_as_ruler_and_kvpress():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111", "2222222"]) == 50
    assert string_match_all("ANSWER: Red-Cat", ["red-cat"]) == 100
    assert string_match_part("Paris, I think", ["London", "paris"]) == 100
    assert string_match_part("Rome", ["London", "Paris"]) == 0
    assert normalize_ruler("  12\x0034\t ") == "12\n34" and normalize_kvpress("  12\x0034\t ") == "1234"


def ruler_vt(max_seq_length, num_samples, n_tokens, seed=42):
    """hsiehjackson/RULER scripts/data/synthetic/variable_tracking.py (e40fae1): generate_chains,
    generate_input_output, sys_vartrack_w_noise_random and main (one chain, 4 hops, the one-shot example), with
    the global ``random`` and numpy's global stream as there; template = RULER's vt template + answer prefix."""
    import string
    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    task_template = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                     "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
    answer_prefix = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                     "variables are assgined the value {query}, they are: ")
    full_template = task_template + answer_prefix

    def generate_chains(num_chains, num_hops, is_icl):
        k = 5 if not is_icl else 3
        num_hops = num_hops if not is_icl else min(10, num_hops)
        vars_all = ["".join(random.choices(string.ascii_uppercase, k=k)).upper() for _ in range((num_hops + 1) * num_chains)]
        while len(set(vars_all)) < num_chains * (num_hops + 1):
            vars_all.append("".join(random.choices(string.ascii_uppercase, k=k)).upper())
        vars_ret, chains_ret = [], []
        for i in range(0, len(vars_all), num_hops + 1):
            this_vars = vars_all[i:i + num_hops + 1]
            vars_ret.append(this_vars)
            this_chain = [f"VAR {this_vars[0]} = {np.random.randint(10000, 99999)}"]
            for j in range(num_hops):
                this_chain.append(f"VAR {this_vars[j + 1]} = VAR {this_vars[j]} ")
            chains_ret.append(this_chain)
        return vars_ret, chains_ret

    def generate_input_output(num_noises, is_icl):
        vars_, chains = generate_chains(1, 4, is_icl)
        noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        sentences = [noise] * num_noises
        if len(sentences) <= len(chains[0]):
            sentences = [n + "." if len(n.strip()) > 0 else n for n in [x for noise in sentences for x in noise.split(".")]]
            if not len(sentences) > len(chains[0]):
                chains = [chain[:len(sentences) - 1] for chain in chains]
        for chain_i in chains:
            positions = list(sorted(random.sample(range(len(sentences)), len(chain_i))))
            for insert_pi, j in zip(positions, range(len(chain_i))):
                sentences.insert(insert_pi + j, chain_i[j])
        context = " ".join(sentences).replace(". \n", ".\n")
        template = full_template
        if is_icl:
            cutoff = template.index(task_template[:20])
            cutoff_ans = template.index(answer_prefix[:10])
            template = " ".join(template[cutoff:cutoff_ans].split()[:-1]) + template[cutoff_ans:]
        value = chains[0][0].split("=")[-1].strip()
        return template.format(context=context, query=value, num_v=5), vars_[0]

    def sys_vartrack(num_samples, max_seq_length, incremental=10, icl_example=None):
        out, num_noises, total_tokens, example_tokens = [], incremental, 0, 0
        if icl_example is not None:
            icl_example = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n\n"
            example_tokens = n_tokens(icl_example)
        while total_tokens + 30 + example_tokens < max_seq_length:
            input_text, answer = generate_input_output(num_noises, icl_example is None)
            total_tokens = n_tokens(input_text + f" {answer}")
            if total_tokens + 30 + example_tokens > max_seq_length:
                num_noises -= incremental
                break
            num_noises += incremental
        for index in range(num_samples):
            used_noises = num_noises
            while True:
                input_text, answer = generate_input_output(used_noises, icl_example is None)
                length = n_tokens(input_text) + 30 + example_tokens
                if length <= max_seq_length:
                    break
                if used_noises > incremental:
                    used_noises -= incremental
            if icl_example is not None:
                cutoff = input_text.index(task_template[:20])
                input_text = input_text[:cutoff] + " " + icl_example + "\n\n" + input_text[cutoff:]
            out.append({"index": index, "input": input_text, "outputs": answer, "length": length})
        return out

    icl = sys_vartrack(1, 500, incremental=5)[0]
    return sys_vartrack(num_samples, max_seq_length, icl_example=icl)


@pytest.mark.parametrize("length", [1024, 3000])
def test_vt_is_rulers_draw_for_draw(length):
    from pcs.benchmarks.ruler_data import VtGenerator
    ours = VtGenerator(count_words, length).samples(5)
    assert ours == ruler_vt(length, 5, count_words)
    for s in ours:
        assert s["length"] <= length and len(s["outputs"]) == 5
        assert s["input"].count("Question: Find all variables") == 2     # the one-shot example's and its own


CWE_WORDS = [f"w{i:03d}" for i in range(400)]


def ruler_cwe(max_seq_length, num_samples, n_tokens, words, seed=42):
    """hsiehjackson/RULER scripts/data/synthetic/common_words_extraction.py (e40fae1): the module's set-up
    (lines 60-70, the word list given), get_example (72-81), generate_input_output (83-103) and
    sys_word_pair_random (105-154), with the global ``random`` as there; the template is RULER's cwe template
    plus its answer prefix; freq_cw 30, freq_ucw 3, num_cw 10, tokens_to_generate 120 (synthetic.yaml)."""
    random.seed(seed)
    words = sorted(set(words))
    random.Random(seed).shuffle(words)
    template = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list? Answer: The top 10 words that appear most often in the list are:")

    def get_example(num_words, common_repeats=30, uncommon_repeats=3, common_nums=10):
        word_list_full = random.sample(words, num_words)
        common, uncommon = word_list_full[:common_nums], word_list_full[common_nums:]
        word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(seed).shuffle(word_list)
        return " ".join([f"{i + 1}. {word}" for i, word in enumerate(word_list)]), common

    def generate_input_output(num_words):
        if max_seq_length < 4096:
            context_example, answer_example = get_example(20, 3, 1, 10)
            context, answer = get_example(num_words, 6, 1, 10)
        else:
            context_example, answer_example = get_example(40, 10, 3, 10)
            context, answer = get_example(num_words, 30, 3, 10)
        input_example = template.format(context=context_example, query="") + " ".join(
            [f"{i + 1}. {word}" for i, word in enumerate(answer_example)])
        return input_example + "\n" + template.format(context=context, query=""), answer

    tokens_to_generate, incremental = 120, 10
    num_words, total_tokens = incremental, 0
    while total_tokens + tokens_to_generate < max_seq_length:
        input_text, answer = generate_input_output(num_words)
        total_tokens = n_tokens(input_text + " " + " ".join([f"{i + 1}. {word}" for i, word in enumerate(answer)]))
        if total_tokens + tokens_to_generate > max_seq_length:
            num_words -= incremental
            break
        num_words += incremental
        if num_words > len(words):
            num_words = len(words)
            break
    out = []
    for index in range(num_samples):
        used_words = num_words
        while True:
            try:
                input_text, answer = generate_input_output(used_words)
                length = n_tokens(input_text) + tokens_to_generate
                assert length <= max_seq_length
                break
            except AssertionError:
                if used_words > incremental:
                    used_words -= incremental
        out.append({"index": index, "input": input_text, "outputs": answer, "length": length})
    return out


@pytest.mark.parametrize("length", [1024, 3000, 5000])
def test_cwe_is_rulers_draw_for_draw(length, tmp_path):
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):   # overlapping lists, as wonderwords'
        (tmp_path / name).write_text("".join(w + "\n" for w in CWE_WORDS[:300] + CWE_WORDS[250:260]))
    (tmp_path / "verblist.txt").write_text("".join(w + "\n" for w in CWE_WORDS[200:]))
    vocabulary = cwe_vocabulary(tmp_path)
    ours = CweGenerator(count_words, length, vocabulary).samples(6)
    assert ours == ruler_cwe(length, 6, count_words, CWE_WORDS[:300] + CWE_WORDS[250:260] + CWE_WORDS[200:])
    for row in ours:
        assert row["length"] <= length and len(set(row["outputs"])) == 10
        listed = re.findall(r"\d+\. (\w+)", row["input"].split("\n")[-2])   # the sample's own list
        counts = {w: listed.count(w) for w in set(listed)}
        common = 6 if length < 4096 else 30
        assert {w for w, c in counts.items() if c == common} == set(row["outputs"])


def ruler_fwe(max_seq_length, num_samples, n_tokens, seed=42):
    """hsiehjackson/RULER scripts/data/synthetic/freq_words_extraction.py (e40fae1): the module's seeding
    (lines 62-63), generate_input_output (68-101) and sys_kwext (103-143) with coded_wordlen 6, vocab_size
    max_seq_length // 50, alpha 2.0, tokens_to_generate 50, and the global ``random`` as there; the template is
    RULER's fwe template plus its answer prefix."""
    import string

    import numpy as np
    from scipy.special import zeta
    random.seed(seed)
    np.random.seed(seed)
    template = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text? Answer: "
                "According to the coded text above, the three most frequently appeared words are:")

    def generate_input_output(max_len, num_words=-1, coded_wordlen=6, vocab_size=2000, incremental=10, alpha=2.0):
        vocab = ["".join(random.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(random.choices(string.ascii_lowercase, k=coded_wordlen)))
        vocab = sorted(list(set(vocab)))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."

        def gen_text(num_words):
            k = np.arange(1, len(vocab) + 1)
            sampled_cnt = num_words * (k ** -alpha) / zeta(alpha)
            sampled_words = [[w] * zi for w, zi in zip(vocab, sampled_cnt.astype(int))]
            sampled_words = [x for wlst in sampled_words for x in wlst]
            random.Random(seed).shuffle(sampled_words)
            return template.format(context=" ".join(sampled_words), query=""), vocab[1:4]

        if num_words > 0:
            text, answer = gen_text(num_words)
            while n_tokens(text) > max_len:
                num_words -= incremental
                text, answer = gen_text(num_words)
        else:
            num_words = max_len // coded_wordlen
            text, answer = gen_text(num_words)
            while n_tokens(text) < max_len:
                num_words += incremental
                text, answer = gen_text(num_words)
            num_words -= incremental
        text, answer = gen_text(num_words)
        return text, answer, num_words

    vocab_size = max_seq_length // 50
    _, _, num_example_words = generate_input_output(max_seq_length, vocab_size=vocab_size,
                                                    incremental=max_seq_length // 32)
    out = []
    for index in range(num_samples):
        input_text, answer, _ = generate_input_output(max_seq_length, num_words=num_example_words,
                                                      vocab_size=vocab_size, incremental=max_seq_length // 32)
        out.append({"index": index, "input": input_text, "outputs": answer, "length": n_tokens(input_text) + 50})
    return out


@pytest.mark.parametrize("length", [1024, 3000, 5000])
def test_fwe_is_rulers_draw_for_draw(length):
    ours = FweGenerator(count_words, length).samples(5)
    assert ours == ruler_fwe(length, 5, count_words)
    for row in ours:
        assert row["length"] - 50 <= length     # RULER fits the prompt alone
        coded = row["input"].split("coded words. ")[1].split("\nQuestion")[0].split()
        counts = sorted(((coded.count(w), w) for w in set(coded) if w != "..."), reverse=True)
        assert [w for _, w in counts[:3]] == row["outputs"] and counts[2][0] > counts[3][0]


def ruler_qa(dataset, data, max_seq_length, num_samples, n_tokens, seed=42):
    """hsiehjackson/RULER scripts/data/synthetic/qa.py (e40fae1): the module's seeding (lines 58-59),
    read_squad (64-85), read_hotpotqa (87-103), generate_input_output (115-138) and generate_samples (141-187)
    with tokens_to_generate 32 and the global ``random`` as there; the template is RULER's qa template plus its
    answer prefix."""
    random.seed(seed)
    template = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: "
                "{query} Answer:")
    if dataset == "squad":
        total_docs = sorted(list(set([p["context"] for d in data["data"] for p in d["paragraphs"]])))
        total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}
        QAS = []
        for d in data["data"]:
            more_docs = [total_docs_dict[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qas in p["qas"]:
                    if not qas["is_impossible"]:
                        QAS.append({"query": qas["question"], "outputs": [a["text"] for a in qas["answers"]],
                                    "context": [total_docs_dict[p["context"]]],
                                    "more_context": [idx for idx in more_docs if idx != total_docs_dict[p["context"]]]})
    else:
        total_docs = sorted(list(set([f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]])))
        total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}
        QAS = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [total_docs_dict[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    DOCS = total_docs

    def generate_input_output(index, num_docs):
        curr_q, curr_a = QAS[index]["query"], QAS[index]["outputs"]
        curr_docs, curr_more = QAS[index]["context"], QAS[index].get("more_context", [])
        if num_docs < len(DOCS):
            if (num_docs - len(curr_docs)) > len(curr_more):
                addition_docs = [i for i, d in enumerate(DOCS) if i not in curr_docs + curr_more]
                all_docs = curr_docs + curr_more + random.sample(
                    addition_docs, max(0, num_docs - len(curr_docs) - len(curr_more)))
            else:
                all_docs = curr_docs + random.sample(curr_more, num_docs - len(curr_docs))
            all_docs = [DOCS[idx] for idx in all_docs]
        else:
            all_docs = DOCS
        random.Random(seed).shuffle(all_docs)
        context = "\n\n".join(["Document {i}:\n{document}".format(i=i + 1, document=d) for i, d in enumerate(all_docs)])
        return template.format(context=context, query=curr_q), curr_a

    tokens_to_generate, incremental = 32, 10
    num_docs, total_tokens = incremental, 0
    while total_tokens + tokens_to_generate < max_seq_length:
        input_text, answer = generate_input_output(0, num_docs)
        total_tokens = n_tokens(input_text + f" {answer}")
        if total_tokens + tokens_to_generate > max_seq_length:
            num_docs -= incremental
            break
        num_docs += incremental
        if num_docs > len(DOCS):
            num_docs = len(DOCS)
            break
    out = []
    for index in range(num_samples):
        used_docs = num_docs
        while True:
            try:
                input_text, answer = generate_input_output(index, used_docs)
                length = n_tokens(input_text) + tokens_to_generate
                assert length <= max_seq_length
                break
            except AssertionError:
                if used_docs > incremental:
                    used_docs -= incremental
        out.append({"index": index, "input": input_text, "outputs": answer, "length": length})
    return out


@pytest.mark.parametrize("length", [600, 1500, 4000])
@pytest.mark.parametrize("dataset", ["squad", "hotpotqa"])
def test_qa_is_rulers_draw_for_draw(dataset, length):
    """At 4,000 words every document fits, where RULER shuffles its own document list: replayed too."""
    data = squad_like() if dataset == "squad" else hotpot_like()
    read = read_squad if dataset == "squad" else read_hotpotqa
    ours = QaGenerator(count_words, length, read(data)).samples(6)
    assert ours == ruler_qa(dataset, data, length, 6, count_words)
    every = ours[0]["input"].count("\nDocument ") == len(read(data).documents)
    assert every == (length == 4000)
    for row in ours:
        assert row["length"] <= length
        question = read(data).questions[row["index"]]
        assert all(f"Document {i + 1}:\n" in row["input"] for i in range(len(question["context"])))
        assert row["input"].endswith(f"Question: {question['query']} Answer:") and row["outputs"] == question["outputs"]
