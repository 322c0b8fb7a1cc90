"""The calibration plan and its prompts: what gets measured, in what order, and with which lengths."""

from __future__ import annotations

import random

from simadmit.calibrate.phases import concurrency_levels, plan_cells, prefill_lengths
from simadmit.calibrate.prompts import PromptMaker


def test_concurrency_levels_double_up_to_the_maximum() -> None:
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(64) == [1, 2, 4, 8, 16, 32, 64]
    assert concurrency_levels(12) == [1, 2, 4, 8, 12]


def test_prefill_lengths_span_short_to_three_quarters_of_the_context() -> None:
    lengths = prefill_lengths(2048)
    assert lengths[0] == 16 and lengths[-1] == 1536 and len(lengths) == 8
    assert list(lengths) == sorted(set(lengths))
    assert (
        prefill_lengths(131072)[-1] == 32768
    )  # capped: a linear model of 100k-token prefills is not the goal


def test_plan_fits_the_budget_the_context_and_the_kv_cache() -> None:
    cells = plan_cells(max_model_len=2048, kv_capacity_tokens=93184, max_concurrency=16, budget_s=600)
    assert [c.phase for c in cells] == ["warmup", "prefill"] + ["decode"] * 5 + ["saturation"]
    assert sum(c.budget_s for c in cells) <= 600
    for c in cells:
        assert max(c.prompt_tokens) + c.output_tokens <= 2048
    sat = cells[-1]
    assert sat.concurrency == 16 and sat.concurrency * (sat.prompt_tokens[0] + sat.output_tokens) <= 93184
    small_kv = plan_cells(max_model_len=8192, kv_capacity_tokens=20000, max_concurrency=16, budget_s=600)[-1]
    assert small_kv.concurrency * (small_kv.prompt_tokens[0] + small_kv.output_tokens) <= 20000


def test_token_prompts_are_exact_and_unique() -> None:
    maker = PromptMaker(list(range(1000, 1100)), random.Random(1))
    a, b = maker.make(64), maker.make(64)
    assert isinstance(a, list) and len(a) == 64 and a != b


def test_text_prompts_learn_the_tokens_per_word_ratio_from_the_server() -> None:
    """Without /tokenize, prompts are words; the server's usage counts teach how many words make N tokens."""
    maker = PromptMaker(None, random.Random(2))
    first = maker.make(200)
    assert isinstance(first, str)
    for _ in range(30):  # this server counts 2 tokens per word
        prompt = maker.make(200)
        assert isinstance(prompt, str)
        maker.observe(prompt, 2 * len(prompt.split()))
    assert abs(len(str(maker.make(200)).split()) - 100) <= 2
