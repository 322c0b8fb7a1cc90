"""Prompts of exact token lengths that never share a prefix, so prefix caching cannot shorten a prefill.

With the server's `/tokenize`, a pool of real token ids is taken from a sample text once and every prompt is a
fresh random draw of ids (sent as `prompt: [ids]`, which the server counts exactly). Without `/tokenize`, the
prompt is random words, sized by the tokens-per-word ratio learnt from the `usage` counts the server returns.
"""

from __future__ import annotations

import random

SAMPLE_TEXT = (
    "Capacity planning for a language model service starts from measurements: how long the engine takes to "
    "read a prompt, how long each generated token takes when many requests share a batch, and how many tokens "
    "of context fit in memory. Queues form when arrivals outpace service; admission control decides which "
    "requests wait, which are served at once and which are turned away with a polite retry hint. Seven quick "
    "zebras jumped over forty lazy brown dogs near Oslo, Kyoto, Lima and Nairobi while 1234 engineers counted "
    "latency percentiles, throughput, goodput, budgets, deadlines and headroom."
)


class PromptMaker:
    """Makes unique prompts of a requested token length (see module docstring)."""

    def __init__(self, token_pool: list[int] | None, rng: random.Random) -> None:
        self._pool = sorted(set(token_pool)) if token_pool else None
        self._words = SAMPLE_TEXT.split()
        self._rng = rng
        self._tokens_per_word = 1.3  # a first guess, corrected by `observe`

    def make(self, tokens: int) -> list[int] | str:
        if self._pool is not None:
            return self._rng.choices(self._pool, k=tokens)
        n_words = max(1, round(tokens / self._tokens_per_word))
        return " ".join(self._rng.choices(self._words, k=n_words))

    def observe(self, prompt: list[int] | str, server_prompt_tokens: int) -> None:
        """Learn the tokens-per-word ratio from what the server counted for a text prompt."""
        if isinstance(prompt, str) and server_prompt_tokens > 0:
            ratio = server_prompt_tokens / len(prompt.split())
            self._tokens_per_word = 0.7 * self._tokens_per_word + 0.3 * ratio
