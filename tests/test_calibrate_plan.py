"""The calibration plan and its prompts: what gets measured, in what order, and with which lengths."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simadmit.calibrate.client import Endpoint
from simadmit.calibrate.metrics import CacheConfig
from simadmit.calibrate.phases import ROUNDS, concurrency_levels, in_rounds, plan_cells, prefill_lengths
from simadmit.calibrate.prompts import PromptMaker
from simadmit.calibrate.run import CalibrationConfig, plan
from simadmit.calibrate.workload_mix import workload_prompt_lengths
from simadmit.cli import app
from simadmit.config.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def test_concurrency_levels_double_up_to_the_maximum() -> None:
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(64) == [1, 2, 4, 8, 16, 32, 64]
    assert concurrency_levels(12) == [1, 2, 4, 8, 12]


def test_prefill_lengths_span_short_to_the_whole_context() -> None:
    lengths = prefill_lengths(2048, token_budget=2048)
    assert lengths[0] == 16 and lengths[-1] == 2047 and len(lengths) == 8  # 2,047 prompt + 1 output token
    assert list(lengths) == sorted(set(lengths))


def test_prompts_longer_than_the_token_budget_are_swept_in_chunks() -> None:
    """A 128k context with an 8,192-token step budget: up to the whole context, and at least two lengths that
    take several steps; with a budget as large as the context, none can be chunked."""
    lengths = prefill_lengths(131072, token_budget=8192)
    assert lengths[-1] == 131071
    assert sum(p > 8192 for p in lengths) >= 2
    assert 12288 in lengths


def test_plan_fits_the_budget_the_context_and_the_kv_cache() -> None:
    cells = plan_cells(
        max_model_len=2048, kv_capacity_tokens=93184, max_concurrency=16, budget_s=600, token_budget=2048
    )
    phases = ["warmup", "prefill"] + ["decode"] * 5 + ["context"] * 2 + ["mixed", "saturation"]
    assert [c.phase for c in cells] == phases
    assert sum(c.budget_s for c in cells) <= 600
    for c in cells:
        assert max(c.prompt_tokens) + c.output_tokens <= 2048
    sat = cells[-1]
    assert sat.concurrency == 16 and sat.concurrency * (sat.prompt_tokens[0] + sat.output_tokens) <= 93184
    small_kv = plan_cells(max_model_len=8192, kv_capacity_tokens=20000, max_concurrency=16, budget_s=600)
    for c in small_kv[-2:]:
        assert c.concurrency * (max(c.prompt_tokens) + c.output_tokens) <= 20000


def test_decode_requests_stay_short_at_large_batches() -> None:
    """The decode sweep up to 64 sequences sends the same 64-token requests as one up to 16, so its largest
    batch costs one short round rather than a round four times as long: every decode-type cell's minimum
    round (concurrency x output tokens) grows only with its concurrency."""
    small = plan_cells(2048, 93184, 16, 180, token_budget=2048)
    large = plan_cells(2048, 93184, 64, 180, token_budget=2048)
    assert [c.concurrency for c in large if c.phase == "decode"] == [1, 2, 4, 8, 16, 32, 64]
    outputs = {c.output_tokens for c in small + large if c.phase in ("decode", "context", "saturation")}
    assert outputs == {64}
    tiny_context = plan_cells(128, 93184, 64, 180, token_budget=2048)
    assert tiny_context[2].output_tokens == 32  # a quarter of the context


def test_context_cells_hold_long_prompts_at_two_batch_sizes() -> None:
    """Decode batches of the same size as the decode sweep's but holding long prompts (three quarters of the
    context, one step's token budget at most, within each sequence's share of the KV cache): alone and at the
    sweep's middle concurrency, so the cost of the context held is told apart from the cost per sequence."""
    cells = plan_cells(2048, 93184, 16, 600, token_budget=2048)
    decode = [c for c in cells if c.phase == "decode"]
    context = [c for c in cells if c.phase == "context"]
    assert [c.concurrency for c in context] == [1, 4]
    for c in context:
        assert c.prompt_tokens == (1536,) and c.output_tokens == decode[0].output_tokens
        assert c.prompt_tokens[0] > 8 * decode[0].prompt_tokens[0]
    big = plan_cells(131072, 400000, 64, 480, token_budget=8192)
    assert [(c.concurrency, c.prompt_tokens) for c in big if c.phase == "context"] == [
        (1, (8192,)),
        (8, (8192,)),
    ]
    tight = plan_cells(8192, 20000, 16, 600, token_budget=8192)
    for c in (c for c in tight if c.phase == "context"):
        assert c.concurrency * (c.prompt_tokens[0] + c.output_tokens) <= 20000


def test_mixed_cell_joins_long_prompts_to_a_decoding_batch() -> None:
    """Long prompts (half a step's budget, and one and a half steps' when the context allows) at concurrency 2
    with enough output tokens that each request decodes while the other prefills."""
    mixed = plan_cells(131072, 400000, 64, 480, token_budget=8192)[-2]
    assert (mixed.phase, mixed.concurrency, mixed.prompt_tokens) == ("mixed", 2, (4096, 12288))
    assert mixed.output_tokens >= 16
    short_context = plan_cells(2048, 93184, 8, 90, token_budget=2048)[-2]
    assert short_context.prompt_tokens == (1024,)


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


def test_workload_prompt_lengths_join_the_prefill_sweep() -> None:
    """A scenario's prompt-length quantiles join the sweep's geometric lengths (those the context takes)."""
    mix = workload_prompt_lengths(ROOT / "scenarios" / "default.yaml")
    assert len(mix) >= 4 and list(mix) == sorted(mix)
    sweep = plan_cells(8192, 400000, 8, 120, token_budget=4096, workload_prompts=mix)[1]
    assert set(p for p in mix if p < 8192) <= set(sweep.prompt_tokens)
    assert set(prefill_lengths(8192, 4096)) <= set(sweep.prompt_tokens)
    assert max(sweep.prompt_tokens) < 8192
    assert sweep.min_requests == len(sweep.prompt_tokens)
    assert (
        workload_prompt_lengths("default") == mix
    )  # a bundled scenario by name, as the other commands take it


def test_a_scenario_with_variants_brings_every_variant_s_prompts(tmp_path: Path) -> None:
    """A variant that sends prompts ten times longer is simulated too, so the sweep covers its lengths as well:
    the pooled quantiles reach past the scenario's own, and a variant that leaves the workload alone changes
    nothing."""
    doc = yaml.safe_load((ROOT / "scenarios" / "default.yaml").read_text())
    own = workload_prompt_lengths(ROOT / "scenarios" / "default.yaml")
    for variants, longer in (
        ([{"name": "same", "set": {"gateway.replicas": 1}}], False),
        ([{"name": "long", "set": {"workload.tiers.0.prompt_tokens.median": 10000,
                                   "workload.tiers.0.prompt_tokens.max": 80000}}], True),
    ):  # fmt: skip
        path = tmp_path / "variants.yaml"
        path.write_text(yaml.safe_dump({**doc, "variants": variants}))
        pooled = workload_prompt_lengths(path)
        assert (pooled == own) != longer
        assert (max(pooled) > 2 * max(own)) == longer


def test_a_bad_workload_scenario_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload: {rate: -1}\n")
    with pytest.raises(InputError):
        workload_prompt_lengths(bad)
    result = CliRunner().invoke(
        app, ["calibrate", "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "p.yaml"),
              "--workload", str(bad)],
    )  # fmt: skip
    assert result.exit_code == 2
    assert str(bad) in result.output and "Traceback" not in result.output


def test_no_batch_larger_than_the_servers_max_num_seqs() -> None:
    """A server running at most 16 sequences queues the rest of a larger batch, and the queue would be timed
    as decode steps: the plan stops at the server's limit, whatever `--max-concurrency` asks."""
    endpoint = Endpoint("http://server", "m", 2048, "0.1")
    cache = CacheConfig(block_size=16, num_blocks=4096, engines=1)
    config = CalibrationConfig(
        endpoint="http://server", out=Path("p.yaml"), max_concurrency=64, max_num_seqs=16
    )
    assert max(c.concurrency for c in plan(config, endpoint, cache)) == 16
    assert max(c.concurrency for c in plan(replace(config, max_num_seqs=256), endpoint, cache)) == 64


def test_the_plan_runs_in_rounds() -> None:
    """After the warm-up every cell runs ROUNDS times in the plan's order, round k owing k/ROUNDS of the
    cell's time and requests and at least k full batches, the last round all of it: a drift of the machine
    during the calibration falls on every phase, the largest batch's included."""
    cells = plan_cells(2048, 93184, 16, 600, token_budget=2048)
    run = in_rounds(cells)
    rest = cells[1:]
    assert run[0] == cells[0] and len(run) == 1 + ROUNDS * len(rest)
    for k in range(1, ROUNDS + 1):
        block = run[1 + (k - 1) * len(rest) : 1 + k * len(rest)]
        assert [(c.phase, c.concurrency, c.prompt_tokens) for c in block] == [
            (c.phase, c.concurrency, c.prompt_tokens) for c in rest
        ]
        for c, whole in zip(block, rest, strict=True):
            assert c.budget_s == pytest.approx(whole.budget_s * k / ROUNDS)
            assert c.min_requests >= max(whole.min_requests * k / ROUNDS, k * c.concurrency)
    assert run[-len(rest) :] == [
        replace(c, min_requests=max(c.min_requests, ROUNDS * c.concurrency), round=ROUNDS) for c in rest
    ]
    assert any(c.min_requests < ROUNDS * c.concurrency for c in rest)  # a batch per round adds to those
