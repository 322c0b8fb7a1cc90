"""An obviously-correct continuous-batching engine: one loop iteration per engine step, no fast-forward.

It follows the same scheduling rules as `simadmit.fleet.engine.BatchingEngine` written out plainly, so the fast engine
(fast-forwarded decode stretches, cut short by arrivals) can be checked against it request by request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simadmit.config.profile import StepTimeModel
from simadmit.fleet.engine import BatchLimits


@dataclass
class _Seq:
    rid: int
    prompt: int
    target: int
    prefill_target: int
    computed: int = 0
    generated: int = 0
    kv: int = 0
    decoding: bool = False
    chunk: int = 0
    log: list = field(default_factory=list)


def reference_run(
    arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, step: StepTimeModel, limits: BatchLimits
) -> tuple[np.ndarray, np.ndarray, int]:
    """First-token and finish time of every request on one replica; also the number of steps."""
    n = len(arrival)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    waiting: list[_Seq] = []
    running: list[_Seq] = []  # in admission order
    order: dict[int, int] = {}
    t, i, steps = 0.0, 0, 0
    while i < n or waiting or running:
        if not waiting and not running:
            t = max(t, float(arrival[i]))
        while i < n and arrival[i] <= t:
            waiting.append(_Seq(i, int(prompt[i]), int(output[i]), int(prompt[i])))
            order[i] = i
            i += 1

        def kv_used() -> int:
            return sum(s.kv for s in running)

        def preempt(pool: list[_Seq]) -> None:
            victim = max(pool, key=lambda q: order[q.rid])
            running.remove(victim)
            victim.kv = victim.computed = 0
            victim.decoding = False
            victim.prefill_target = victim.prompt + victim.generated
            waiting.insert(0, victim)

        while sum(s.decoding for s in running) > limits.kv_capacity_tokens - kv_used():
            preempt(running)
        decoders = [s for s in running if s.decoding]
        for s in decoders:
            s.kv += 1
        budget = limits.max_num_batched_tokens - len(decoders)
        scheduled: list[_Seq] = []
        prefilling = [s for s in running if not s.decoding]
        j = 0
        while j < len(prefilling) and budget > 0:
            s = prefilling[j]
            chunk = min(s.prefill_target - s.computed, budget, limits.kv_capacity_tokens - kv_used())
            if chunk <= 0:
                preempt(prefilling)
                prefilling = [p for p in running if not p.decoding]
                continue
            s.chunk = chunk
            s.kv += chunk
            budget -= chunk
            scheduled.append(s)
            j += 1
        while waiting and budget > 0 and len(running) < limits.max_num_seqs:
            s = waiting[0]
            chunk = min(s.prefill_target - s.computed, budget)
            if chunk > limits.kv_capacity_tokens - kv_used():
                break
            waiting.pop(0)
            running.append(s)
            s.chunk = chunk
            s.kv += chunk
            budget -= chunk
            scheduled.append(s)
        prefill_tokens = sum(s.chunk for s in scheduled)
        t += step.step_time(prefill_tokens, len(decoders), kv_used())
        steps += 1
        for s in decoders:
            s.generated += 1
            if s.generated >= s.target:
                running.remove(s)
                finish[s.rid] = t
        for s in scheduled:
            s.computed += s.chunk
            s.chunk = 0
            if s.computed < s.prefill_target:
                continue
            s.generated += 1
            if s.generated == 1:
                first[s.rid] = t
            if s.generated >= s.target:
                running.remove(s)
                finish[s.rid] = t
            else:
                s.decoding = True
    return first, finish, steps
