"""What ``budget`` means (torch-free: config checks, run folders and reports read it).

An integer: entries each KV head keeps (SnapKV's ``max_capacity_prompt``, the paper's B), the observation window
included. A fraction in (0, 1): that share of each prompt, ``int(share x n)`` entries per KV head for a prompt of
n tokens (kvpress's ``compression_ratio`` is one minus it), never fewer than the method's window and sinks. A
hybrid model's sliding-window layers keep their window either way.
"""
from __future__ import annotations

from .errors import ConfigError


def is_share(budget) -> bool:
    """Whether ``budget`` is a share of each prompt rather than a number of entries."""
    return isinstance(budget, float)


def check(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ConfigError(f"budget={budget!r} must be a positive integer (entries per KV head) or a fraction in "
                          f"(0, 1) (a share of each prompt)")
    if is_share(budget) and not 0 < budget < 1:
        raise ConfigError(f"budget={budget!r}: a fractional budget is a share of each prompt and lies in (0, 1); "
                          f"write an integer for entries per KV head")
    if not is_share(budget) and budget <= 0:
        raise ConfigError(f"budget={budget!r} must be a positive integer (entries per KV head)")


def from_text(text: str) -> int | float:
    """A budget as a command line writes it (``128``, ``0.25``), checked."""
    try:
        budget = int(text)
    except ValueError:
        try:
            budget = float(text)
        except ValueError:
            raise ConfigError(f"budget {text!r} is neither an integer nor a fraction") from None
    check(budget)
    return budget


def entries(budget, n_tokens: int, least: int = 0) -> int:
    """Entries per KV head for a prompt of ``n_tokens``: the budget itself, or its share of the prompt (at least
    ``least``: what the method keeps whatever it chooses, its window and sinks)."""
    if not is_share(budget):
        return budget
    return max(int(budget * n_tokens), least)

