"""Property: whatever a user does to a valid scenario, `simadmit simulate` runs or says what is wrong.

Hypothesis mutates a small valid scenario (synthetic traffic, or a trace replay) the way people break
files: it drops or renames keys, and puts wrong types, NaN, infinities, negatives, zeros, huge numbers and
empty strings where values were. Every run
must end with exit code 0, or exit code 2 and one `error: ...` line per problem; never a traceback, and
within a time limit (a value that makes the run explode in size must be refused up front, not attempted).
The runs go through the CLI's own entry point in-process, which is what the console command calls.
"""

from __future__ import annotations

import copy
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from simadmit.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
PROFILE = str(ROOT / "calibration" / "llama-3.1-8b-h100.yaml")
TIME_LIMIT_S = 60  # one run of a 5-second scenario takes well under a second; generous for a busy machine

VALID: dict = {
    "name": "fuzz",
    "workload": {
        "seed": 1,
        "rate_rps": 6,
        "rate_multiplier": 1.0,
        "duration_s": 5,
        "warmup_s": 1,
        "arrival": {"kind": "gamma", "cv": 2},
        "tiers": [
            {
                "name": "interactive",
                "share": 0.8,
                "prompt_tokens": {"kind": "lognormal", "median": 500, "sigma": 0.8, "min": 8, "max": 4000},
                "output_tokens": {"kind": "lognormal", "median": 60, "sigma": 0.5, "max": 256},
                "max_tokens": 256,
                "deadline_s": 30,
                "slo": {"ttft_s": 2.0, "e2e_s": 20.0},
            },
            {
                "name": "batch",
                "share": 0.2,
                "prompt_tokens": {"kind": "fixed", "value": 2000},
                "output_tokens": {"kind": "empirical", "values": [100, 200, 300]},
                "max_tokens": 512,
                "start_s": 1,
                "end_s": 4,
            },
        ],
    },
    "pools": [
        {
            "name": "llama",
            "profile": PROFILE,
            "replicas": 2,
            "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 4096},
            "autoscaler": {
                "metric": "queue_wait",
                "target": 1.5,
                "min_replicas": 1,
                "max_replicas": 3,
                "sync_period_s": 2,
                "cold_start_s": {"kind": "fixed", "value": 1},
            },
        }
    ],  # fmt: skip
    "gateway": {"replicas": 2, "poll_interval_s": 0.2, "routing": "least_work", "dispatch": "immediate"},
    "clients": {
        "max_retries": 2,
        "backoff": {"base_s": 0.5, "cap_s": 4, "jitter": "full"},
        "retry_budget": {"ratio": 0.2, "burst": 5},
        "abandon_after_s": 20,
    },
    "policies": [
        {"kind": "unconditional"},
        {"kind": "queue_depth", "max_queued": 8},
        {
            "kind": "gpu_seconds",
            "budgets_s": {"interactive": 2, "batch": 30},
            "headroom": 0.9,
            "max_pool_gpu_seconds": 6,
            "tier_max_gpu_seconds": {"batch": 3},
        },
    ],  # fmt: skip
}

TRACE_VALID: dict = {
    "name": "fuzz-trace",
    "workload": {
        "seed": 1,
        "rate_multiplier": 2.0,
        "duration_s": 20,
        "warmup_s": 2,
        "trace": {
            "path": "azure_llm_2023/AzureLLMInferenceTrace_conv_first2000.csv",
            "format": "azure",
            "start_s": 0,
            "end_s": 60,
            "sample": 0.5,
            "on_error": "skip",
            "tiers": {"by": "length", "rules": [{"tier": "long", "above": 2000}], "default": "chat"},
            "max_tokens": {"kind": "scaled", "factor": 1.5, "cap": 2048},
        },
        "tiers": [{"name": "chat", "slo": {"ttft_s": 2}}, {"name": "long", "deadline_s": 60}],
    },
    "pools": [{"name": "llama", "profile": "llama-3.1-8b-h100", "replicas": 1}],
    "policies": [{"kind": "gpu_seconds", "budgets_s": {"chat": 2, "long": 30}}],
}

BAD_VALUES = st.sampled_from(
    [
        None,
        "",
        "abc",
        float("nan"),
        float("inf"),
        float("-inf"),
        -1,
        -0.5,
        0,
        1e18,
        10**30,
        2**63,
        [],
        {},
        True,
    ]
)


def _paths(node: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path of the document (mappings by key, lists by index)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


BASES = {"synthetic": VALID, "trace replay": TRACE_VALID}
PATHS = {name: sorted(_paths(doc), key=str) for name, doc in BASES.items()}


def _parent(doc: dict, path: tuple) -> object:
    node: object = doc
    for key in path[:-1]:
        node = node[key]  # type: ignore[index]
    return node


def _mutate(doc: dict, path: tuple, op: str, value: object) -> None:
    parent, key = _parent(doc, path), path[-1]
    if op == "replace":
        parent[key] = value  # type: ignore[index]
    elif isinstance(parent, dict):
        child = parent.pop(key)
        if op == "rename":
            parent[f"{key}x"] = child
    elif op == "drop":
        parent.pop(key)  # type: ignore[attr-defined]


def _mutations(base: str) -> st.SearchStrategy:
    """One to three (path, operation, bad value) mutations of the base scenario called `base`."""
    ops = st.sampled_from(["replace", "replace", "drop", "rename"])
    one = st.tuples(st.sampled_from(PATHS[base]), ops, BAD_VALUES)
    return st.tuples(st.just(base), st.lists(one, min_size=1, max_size=3))


CASES = st.sampled_from(sorted(BASES)).flatmap(_mutations)


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"the run took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES)
def test_a_mutated_scenario_runs_or_gives_one_line_per_problem(case: tuple[str, list]) -> None:
    base, mutations = case
    doc = copy.deepcopy(BASES[base])
    for path, op, value in mutations:
        try:
            _mutate(doc, path, op, value)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # an earlier mutation removed or replaced this path
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "scenario.yaml"
        scenario.write_text(yaml.safe_dump(doc, sort_keys=False))
        with time_limit(TIME_LIMIT_S):
            result = CliRunner().invoke(app, ["simulate", str(scenario), "--out", str(Path(tmp) / "out")])
    shown = f"{base}: {mutations}\n{result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), shown + "".join(
        __import__("traceback").format_exception(result.exception)
    )
    assert result.exit_code in (0, 2), shown
    assert "Traceback" not in result.output, shown
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines and all(line.startswith("error: ") for line in lines), shown
