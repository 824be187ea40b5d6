"""model=qwen3_8b: Qwen3's per-head query and key norms, on a tiny random Qwen3 (the 8B weights are the hub's).
The methods score with the queries the model attends with, the full cache decodes as transformers' own greedy
generation does, and the config composes with its chat template's arguments."""
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Qwen3Config

from pcs.compression import attention_modules, window_queries
from pcs.config import validate
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
def test_window_queries_are_the_normed_rotated_queries_qwen3_attends_with():
    model = tiny_qwen3()
    assert all(m.q_norm.weight.shape[-1] == 8 for m in attention_modules(model))     # per head, before rotary
    seen, rebuilt = {}, {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        seen[module.layer_idx] = query[0, :, -5:] * scaling * query.shape[-1] ** 0.5
        return torch.zeros_like(query).transpose(1, 2), None

    def rebuild(module, args, kwargs, output):
        rebuilt[module.layer_idx] = window_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"], 5)

    AttentionInterface.register("capture_qwen3_queries", capture)
    model.set_attn_implementation("capture_qwen3_queries")
    handles = [m.register_forward_hook(rebuild, with_kwargs=True) for m in attention_modules(model)]
    try:
        model(input_ids=torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1)))
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation("pcs")
    assert sorted(seen) == sorted(rebuilt) == list(range(TINY["num_hidden_layers"]))
    for layer in seen:
        torch.testing.assert_close(rebuilt[layer], seen[layer], rtol=1e-5, atol=1e-5)


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
