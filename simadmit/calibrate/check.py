"""`simadmit calibrate check`: does a profile predict its endpoint? Replay one mixed load on both and compare.

A short open-loop load (Poisson arrivals, log-normal prompt lengths, a few output lengths) is sent to the live
endpoint and simulated on the profile with the same arrival times and lengths; TTFT and inter-token latency
are compared by mean, p50, p90 and p99. The default rate keeps about two requests in flight, a regime where
batching matters but queues stay short, so errors point at the cost model rather than at overload.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np
import pandas as pd

from simadmit.calibrate.client import Attempt, discover, normalize_base_url, stream_completion, tokenize
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker
from simadmit.config.errors import InputError, problem
from simadmit.config.profile import Profile, solo_service_s
from simadmit.config.workload_schema import MAX_SECONDS
from simadmit.fleet.engine_replay import replay_on_profile

STATS = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """What to replay: how many requests, at what rate (None: about two in flight), from which seed."""

    requests: int = 40
    rate_per_s: float | None = None
    seed: int = 0
    request_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Load:
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


def mixed_load(profile: Profile, cfg: CheckConfig) -> Load:
    """Poisson arrivals; prompts log-normal around 256 tokens (within half the context); outputs 16-128.
    The default rate is two over the mean time a request of the load takes alone (`solo_service_s`)."""
    rng = np.random.default_rng(cfg.seed)
    limit = profile.engine.max_model_len // 2
    prompts = np.clip(np.round(rng.lognormal(math.log(256), 0.8, cfg.requests)), 16, limit).astype(int)
    outputs = rng.choice([16, 32, 64, 128], cfg.requests)
    outputs = np.minimum(outputs, profile.engine.max_model_len - prompts - 1)
    budget = profile.engine.max_num_batched_tokens
    alone = np.mean(
        [solo_service_s(profile.step_time, budget, p, o) for p, o in zip(prompts, outputs, strict=True)]
    )
    rate = cfg.rate_per_s or 2.0 / float(alone)  # Little: two in flight = rate x mean time alone
    arrivals = np.cumsum(rng.exponential(1.0 / rate, cfg.requests))
    span = float(arrivals[-1] - arrivals[0])
    if not span <= MAX_SECONDS:  # each request waits for its time: a tiny --rate would wait for ever
        raise InputError(
            [
                problem(
                    None,
                    "--rate",
                    f"{rate:g} arrivals per second: the {cfg.requests} requests would take {span:.3g} s to send; "
                    f"at most {MAX_SECONDS:g} s",
                )
            ]
        )
    return Load(arrivals - arrivals[0], prompts, outputs)


async def replay_on_endpoint(endpoint_url: str, model: str, load: Load, timeout_s: float) -> list[Attempt]:
    """Send the load open-loop (each request at its arrival time, whatever is in flight)."""
    n = len(load.arrival_s)
    limits = httpx.Limits(max_connections=n + 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        endpoint = await discover(client, normalize_base_url(endpoint_url), model)
        prompts = PromptMaker(await tokenize(client, endpoint, SAMPLE_TEXT), random.Random())
        start = time.perf_counter()

        async def one(i: int) -> Attempt:
            await asyncio.sleep(max(0.0, start + float(load.arrival_s[i]) - time.perf_counter()))
            prompt = prompts.make(int(load.prompt_tokens[i]))
            return await stream_completion(client, endpoint, prompt, int(load.output_tokens[i]), timeout_s)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _stats(values: np.ndarray) -> dict[str, float]:
    v = values[np.isfinite(values)]
    if not len(v):
        return dict.fromkeys(STATS, math.nan)
    return {"mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}}


def compare(measured: list[Attempt], simulated: pd.DataFrame) -> pd.DataFrame:
    """One row per (metric, statistic): predicted, measured, relative error; failed requests left out."""
    ok = np.array([a.status == "ok" for a in measured])
    real = {
        "ttft_s": np.array([a.ttft_s for a in measured])[ok],
        "itl_s": np.array([a.itl_mean_s for a in measured])[ok],
    }
    rows = []
    for metric, values in real.items():
        sim = _stats(simulated[metric].to_numpy(dtype=float)[ok])
        got = _stats(values)
        for stat in STATS:
            rows.append(
                {
                    "metric": metric,
                    "stat": stat,
                    "predicted_s": sim[stat],
                    "measured_s": got[stat],
                    "error": sim[stat] / got[stat] - 1 if got[stat] > 0 else math.nan,
                }
            )
    return pd.DataFrame(rows)


def check_load(
    profile: Profile, endpoint_url: str, model: str | None, cfg: CheckConfig
) -> tuple[pd.DataFrame, Counter[str]]:
    """Replay the load on the endpoint and on the profile; the comparison, and failed requests by status."""
    load = mixed_load(profile, cfg)
    measured = asyncio.run(
        replay_on_endpoint(endpoint_url, model or profile.model, load, cfg.request_timeout_s)
    )
    simulated = replay_on_profile(profile, load.arrival_s, load.prompt_tokens, load.output_tokens)
    return compare(measured, simulated), Counter(a.status for a in measured if a.status != "ok")


def run_check(
    profile: Profile, endpoint_url: str, model: str | None, cfg: CheckConfig
) -> tuple[pd.DataFrame, int]:
    """`check_load` with the failed requests counted."""
    table, failures = check_load(profile, endpoint_url, model, cfg)
    return table, sum(failures.values())
