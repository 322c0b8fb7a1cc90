"""An obviously-correct continuous-batching engine: one loop iteration per engine step, no fast-forward.

It follows vLLM V1's scheduler (`vllm/v1/core/sched/scheduler.py`) written out plainly, request by request:
the running list in its order, each taking one token (decoding) or the rest of its prompt within the token
budget (prefilling), KV allocated in blocks; a request whose blocks cannot be allocated preempts the last
running request (possibly itself); waiting requests are admitted FCFS only in a step that preempted nobody.
Requests that arrive by a step's start join it. With `priority` (one number per request, lower first) it
follows vLLM's priority scheduling instead: the waiting list kept sorted by (priority, arrival), and the
request preempted for blocks the running one of the highest (priority, arrival), handing back the tokens
and blocks it took this step if it was already scheduled (the one difference from vLLM, which the fast
engine shares: when the request short of blocks preempts itself, the requests after it still run). The fast engine (`simadmit.fleet.engine.BatchingEngine`:
decoders kept as a group, decode stretches fast-forwarded and cut short by arrivals) is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simadmit.config.profile import StepTimeModel, prefill_attention_pairs
from simadmit.fleet.engine import BatchLimits


@dataclass
class _Seq:
    rid: int
    prompt: int
    target: int
    prefill_target: int
    computed: int = 0
    generated: int = 0
    kv: int = 0  # KV tokens held
    decoding: bool = False
    rank: tuple[int, int] = (0, 0)  # (priority, arrival index)


def reference_run(
    arrival: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    step: StepTimeModel,
    limits: BatchLimits,
    priority: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """First-token and finish time of every request on one replica; also the number of steps."""
    by_priority = priority is not None
    n = len(arrival)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    size = limits.kv_block_size
    waiting: list[_Seq] = []
    running: list[_Seq] = []  # in the order they were (last) admitted
    t, i, steps = 0.0, 0, 0

    def blocks(tokens: int) -> int:
        return -(-tokens // size)

    while i < n or waiting or running:
        if not waiting and not running:
            t = max(t, float(arrival[i]))
        while i < n and arrival[i] <= t:
            rank = (int(priority[i]) if priority is not None else 0, i)
            waiting.append(_Seq(i, int(prompt[i]), int(output[i]), int(prompt[i]), rank=rank))
            i += 1
        if by_priority:
            waiting.sort(key=lambda s: s.rank)
        free = limits.kv_blocks - sum(blocks(s.kv) for s in running)
        budget = limits.max_num_batched_tokens
        chunks: dict[int, int] = {}  # rid -> tokens scheduled this step
        preempted = False
        j = 0
        while j < len(running) and budget > 0:
            s = running[j]
            new = 1 if s.decoding else min(s.prefill_target - s.computed, budget)
            while blocks(s.kv + new) - blocks(s.kv) > free:
                if by_priority:
                    victim = max(running, key=lambda r: r.rank)
                    v = running.index(victim)
                    running.remove(victim)
                    if v < j:  # scheduled already in this step: give its tokens back
                        budget += chunks.pop(victim.rid)  # its blocks of this step are in its kv
                        j -= 1
                else:
                    victim = running.pop()
                free += blocks(victim.kv)
                victim.kv = victim.computed = 0
                victim.decoding = False
                victim.prefill_target = victim.prompt + victim.generated
                if by_priority:
                    waiting.append(victim)
                    waiting.sort(key=lambda r: r.rank)
                else:
                    waiting.insert(0, victim)
                preempted = True
                if victim is s:
                    break
            if s not in running:
                if by_priority:
                    continue  # the next request is now at j
                break
            free -= blocks(s.kv + new) - blocks(s.kv)
            s.kv += new
            budget -= new
            chunks[s.rid] = new
            j += 1
        while not preempted and waiting and budget > 0 and len(running) < limits.max_num_seqs:
            s = waiting[0]
            new = min(s.prefill_target, budget)
            if blocks(new) > free:
                break
            waiting.pop(0)
            running.append(s)
            free -= blocks(new)
            s.kv = new
            budget -= new
            chunks[s.rid] = new
        scheduled = [s for s in running if s.rid in chunks]
        assert len(scheduled) == len(running), "every running request is scheduled in every step"
        decoders = [s for s in scheduled if s.decoding]
        prefills = [s for s in scheduled if not s.decoding]
        prefill_tokens = sum(chunks[s.rid] for s in prefills)
        pairs = sum(prefill_attention_pairs(chunks[s.rid], s.computed) for s in prefills)
        context = sum(s.kv for s in scheduled)
        t += step.step_time(prefill_tokens, len(decoders), context, pairs)
        steps += 1
        for s in decoders:
            s.generated += 1
            if s.generated >= s.target:
                running.remove(s)
                finish[s.rid] = t
        for s in prefills:
            s.computed += chunks[s.rid]
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
