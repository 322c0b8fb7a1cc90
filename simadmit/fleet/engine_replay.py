"""Replay: given requests through a profile's engine model alone, to compare with what a live endpoint did.

No gateway and no admission: each request goes straight to the replica with the fewest requests, as a plain
load balancer in front of vLLM would send it. `simadmit calibrate check` replays the load it sent to the
endpoint and sets the predicted TTFT and inter-token latency beside the measured ones.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import simpy

from simadmit.config.profile import Profile
from simadmit.fleet.engine import BatchingEngine, BatchLimits, EngineListener


class _Times(EngineListener):
    def __init__(self, n: int) -> None:
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)

    def on_first_token(self, rid: int, now: float) -> None:
        self.first[rid] = now

    def on_finish(self, rid: int, now: float) -> None:
        self.finish[rid] = now


def replay_on_profile(
    profile: Profile,
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    replicas: int = 1,
) -> pd.DataFrame:
    """Per request: TTFT, end-to-end latency and mean inter-token latency predicted by the profile."""
    n = len(arrival_s)
    env = simpy.Environment()
    times = _Times(n)
    limits = BatchLimits(
        profile.engine.max_num_seqs,
        profile.engine.max_num_batched_tokens,
        profile.kv_capacity_tokens,
        profile.kv_block_size,
    )
    engines = [BatchingEngine(env, i, profile.step_time, limits, times) for i in range(replicas)]

    def arrive(rid: int) -> None:
        target = min(engines, key=lambda e: e.n_running + e.n_waiting)
        target.submit(rid, int(prompt_tokens[rid]), int(output_tokens[rid]))

    for rid, at in enumerate(np.asarray(arrival_s, dtype=float)):
        env.timeout(at).callbacks.append(lambda _e, rid=rid: arrive(rid))  # type: ignore[misc]
    env.run()
    arrival = np.asarray(arrival_s, dtype=float)
    out = np.asarray(output_tokens)
    decode_tokens = np.where(out > 1, out - 1, np.nan)
    seen = profile.api_latency_s  # the API server's way in and out, beyond the engine's times
    return pd.DataFrame(
        {
            "ttft_s": times.first + seen - arrival,
            "e2e_s": times.finish + seen - arrival,
            "itl_s": (times.finish - times.first) / decode_tokens,
        }
    )
