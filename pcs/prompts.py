"""Turn a benchmark's user text into model input ids, with or without the chat template."""
from __future__ import annotations

import torch


def encode_prompt(tokenizer, text: str, model_cfg, use_chat: bool = True) -> torch.Tensor:
    """(1, n) input ids. The chat template adds its own special tokens; plain text gets the BOS."""
    if model_cfg.chat_template and use_chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text).input_ids
    return torch.tensor([ids])
