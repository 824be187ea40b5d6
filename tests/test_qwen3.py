"""model=qwen3_8b on a tiny random Qwen3 (the 8B weights are the hub's): the full cache decodes as transformers'
own greedy generation does, and the config composes with its chat template's arguments. Its per-head query and key
norms go through every hybrid-model test (``tests/test_hybrid.py``'s qwen3: the queries the methods score with are
the ones it attends with)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from pcs.validation import validate
from pcs.errors import ConfigError
from pcs.eviction import build_method
from pcs.generate import greedy_generate
from pcs.hybrid import attention_windows
from pcs.models import prepare
from pcs.prompts import encode_prompt

from conftest import TINY, compose_cfg


def tiny_qwen3():
    torch.manual_seed(0)
    return prepare(AutoModelForCausalLM.from_config(Qwen3Config(**TINY, head_dim=8)))


@torch.no_grad()
def test_the_full_cache_decodes_as_transformers_greedy_generation_does():
    model = tiny_qwen3()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    ours = greedy_generate(model, ids, build_method(compose_cfg("method=full")), 12, set())
    model.set_attn_implementation("sdpa")
    theirs = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == theirs[0, ids.shape[1]:].tolist()
    assert attention_windows(model.config) == [None] * TINY["num_hidden_layers"]     # full attention throughout


class ThinkingTemplate:
    """A tokenizer whose template, as Qwen3's, opens an empty think block when thinking is off."""
    chat_template = "qwen3-like"

    def apply_chat_template(self, turns, tokenize, add_generation_prompt, enable_thinking=True):
        text = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)
        return text + "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [ord(c) for c in text]})


def test_qwen3_8b_composes_and_prompts_without_thinking():
    cfg = compose_cfg("model=qwen3_8b", "benchmark=ruler")
    validate(cfg)
    assert cfg.model.hf_id == "Qwen/Qwen3-8B" and dict(cfg.model.chat_template_kwargs) == {"enable_thinking": False}
    ids = encode_prompt(ThinkingTemplate(), "Context. Question?", cfg.model, question="Question?")
    tail = "".join(map(chr, ids.question))
    assert tail == "Question?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    with pytest.raises(ConfigError, match="model.context_window"):
        validate(compose_cfg("model=qwen3_8b", "model.context_window=0"))
