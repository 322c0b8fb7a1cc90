"""Pool: a model's replicas behind the gateway, what their metrics endpoints publish, and their true state.

It routes each admitted request to a serving replica (least predicted work, round-robin or fewest
requests) or, with central dispatch, holds it in one FIFO queue until a replica has a free batch slot: the
textbook single queue feeding c servers. It keeps the books the gateway polls (in-flight predicted
GPU-seconds of the estimates the gateway charged, queued and running requests, free batch slots, KV use,
available GPUs, and per replica the load an engine-aware policy predicts from: running and waiting
requests, prompt tokens not yet prefilled, KV use) and publishes them as a `PoolSnapshot`. In-flight work is
also published as what remains: each request's charge less the prefill and the decode tokens already done. What happens to each request is reported to a
`RequestListener` (the simulation's ledger); the pool writes nothing of anyone else's. An autoscaler may
add replicas (serving only after their cold start) and drain them (no new work; retired once empty).
With `priorities` (tier -> priority, lower first) its engines schedule by priority, as vLLM's
`--scheduling-policy priority` with each request's priority set from its tier, and so is the central
dispatch queue.

A deployed gateway reads only each replica's published gauges (`gauges`: what vLLM's /metrics says, as of
the end of its engine's last step) and keeps books of its own requests (`sim.gateway_view`); the exact
`snapshot` is the view of `gateway.view: exact`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

import numpy as np
import simpy

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import PoolSnapshot
from simadmit.admission.published import Gauges
from simadmit.admission.view import ReplicaLoad, prompt_attention_pairs
from simadmit.config.profile import StepTimeModel
from simadmit.fleet.classical import ClassicalServer
from simadmit.fleet.engine import DECODE, BatchingEngine, BatchLimits, EngineListener, Seq, StepObserver


class RequestListener:
    """What a pool reports of each request it was given."""

    def on_routed(self, rid: int, replica: int) -> None: ...
    def on_scheduled(self, rid: int, now: float) -> None: ...
    def on_first_token(self, rid: int, now: float) -> None: ...
    def on_finish(self, rid: int, now: float) -> None: ...
    def on_aborted(self, rid: int, now: float) -> None: ...
    def on_abort_progress(self, rid: int, prompt_tokens: int, output_tokens: int) -> None: ...
    def on_preempt(self, rid: int) -> None: ...


class _ByPriority:
    """The central dispatch queue under priority scheduling: request ids by (their tier's priority, order of
    admission), with the deque operations the pool uses."""

    def __init__(self, priorities: Mapping[str, int], tier_of: dict[int, str]) -> None:
        self.priorities = priorities
        self.tier_of = tier_of
        self.heap: list[tuple[int, int, int]] = []
        self.count = 0

    def __bool__(self) -> bool:
        return bool(self.heap)

    def __getitem__(self, index: int) -> int:
        assert index == 0, "only the head is ever looked at"
        return self.heap[0][2]

    def append(self, rid: int) -> None:
        heapq.heappush(self.heap, (self.priorities.get(self.tier_of[rid], 0), self.count, rid))
        self.count += 1

    def popleft(self) -> int:
        return heapq.heappop(self.heap)[2]


class Pool(EngineListener):
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        replicas: int,
        gpus_per_replica: int,
        workload_prompt: list[int],
        workload_output: list[int],
        listener: RequestListener,
        routing: str,
        central: bool,
        step: StepTimeModel | None = None,
        limits: BatchLimits | None = None,
        service_s: np.ndarray | None = None,
        observer: StepObserver | None = None,
        estimator: CostEstimator | None = None,
        priorities: Mapping[str, int] | None = None,
    ) -> None:
        self.env = env
        self.priorities = priorities  # None: FCFS engines
        self.estimator = estimator  # prices progress, for the remaining work
        self.index = index
        self.prompt = workload_prompt
        self.output = workload_output
        self.listener = listener
        self.routing = routing
        self.central = central
        self.gpus_per_replica = gpus_per_replica
        self.step = step
        self.limits = limits
        self.service_s = service_s
        self.observer = observer
        self.replicas: list[BatchingEngine | ClassicalServer] = []
        self.work: list[float] = []  # predicted GPU-seconds routed to each replica and not finished
        self.prefill_tokens: list[
            int
        ] = []  # per replica: prompt tokens routed there, first token not yet out
        self.prefill_pairs: list[float] = []  # their attention pairs
        # per replica, under priority scheduling: priority -> (waiting requests, prompt tokens, pairs)
        self.waiting_by_priority: list[dict[int, tuple[int, int, float]]] = []
        self.prompt_tokens_total: list[int] = []  # per replica: prompt tokens prefilled (a metrics counter)
        self.serving: list[int] = []  # ready and not draining
        self.starting = 0
        self.starts: list[list[bool]] = []  # replicas still in their cold start, oldest first
        self.draining: set[int] = set()
        self.lifetimes: list[list[float]] = []  # per replica: [serving since, retired at (inf: never)]
        self.replica_log: list[tuple[float, int, int, int]] = []  # (time, serving, starting, draining)
        self.peak_in_flight_gpu_s = 0.0
        for _ in range(replicas):
            self._new_replica()
        self.seqs: dict[int, Seq] = {}
        # admitted requests in flight -> their tier, the GPU-seconds the gateway charged, their replica
        self.tier_of: dict[int, str] = {}
        self.estimate: dict[int, float] = {}
        self.replica_of: dict[int, int] = {}
        self.started: set[int] = set()  # in flight and scheduled at least once
        self.prefilled: set[int] = set()  # in flight and past their first token
        self.queue: deque[int] | _ByPriority = deque()  # central dispatch queue
        if priorities is not None:
            self.queue = _ByPriority(priorities, self.tier_of)
        self.in_queue: set[int] = set()
        self.rr = 0
        # what the gateway polls
        self.in_flight_gpu_s = 0.0
        self.in_flight_by_tier: dict[str, float] = {}
        self.queued = 0
        self.running = 0

    @property
    def available_gpus(self) -> int:
        return len(self.serving) * self.gpus_per_replica

    # --- fleet -----------------------------------------------------------------------------------------

    def _new_replica(self) -> int:
        i = len(self.replicas)
        if self.service_s is not None:
            engine: BatchingEngine | ClassicalServer = ClassicalServer(
                self.env, i, self.service_s, self, self.observer
            )
        else:
            assert self.step is not None and self.limits is not None
            engine = BatchingEngine(
                self.env, i, self.step, self.limits, self, self.observer, self.priorities is not None
            )
        self.replicas.append(engine)
        self.work.append(0.0)
        self.prefill_tokens.append(0)
        self.prefill_pairs.append(0.0)
        self.waiting_by_priority.append({})
        self.prompt_tokens_total.append(0)
        self.lifetimes.append([self.env.now, float("inf")])
        self.serving.append(i)
        self._log()
        return i

    def scale_up(self, cold_start_s: float) -> None:
        """Start a replica; it serves once its cold start (model load, warm-up) is over."""
        start = [True]  # cleared if the start is cancelled before it is ready
        self.starts.append(start)
        self.starting += 1
        self._log()
        self.env.timeout(cold_start_s).callbacks.append(lambda _e: self._ready(start))

    def _ready(self, start: list[bool]) -> None:
        if not start[0]:
            return
        self.starts.remove(start)
        self.starting -= 1
        self._new_replica()
        if self.central:
            self._dispatch()

    def scale_down(self) -> None:
        """Cancel the newest replica still starting, if any (as Kubernetes deletes unready pods first);
        otherwise drain the serving replica with the least work: no new requests; retired once empty."""
        if self.starts:
            self.starts.pop()[0] = False
            self.starting -= 1
            self._log()
            return
        if len(self.serving) <= 1:
            return
        r = min(self.serving, key=self.work.__getitem__)
        self.serving.remove(r)
        self.draining.add(r)
        self._retire_if_empty(r)
        self._log()

    def _retire_if_empty(self, r: int) -> None:
        engine = self.replicas[r]
        if engine.n_running + engine.n_waiting == 0:
            self.draining.discard(r)
            self.lifetimes[r][1] = self.env.now
            self._log()

    def _log(self) -> None:
        self.replica_log.append((self.env.now, len(self.serving), self.starting, len(self.draining)))

    # --- gateway side ------------------------------------------------------------------------------

    def snapshot(self, known_outputs: bool = False) -> PoolSnapshot:
        """The pool's books as its replicas' metrics endpoints would publish them now; with `known_outputs`
        also each batch's remaining decode steps per sequence, as a gateway that knew every request's true
        output length (a study's oracle) would count them from the tokens it streamed."""
        free = 0
        kv_used = kv_cap = 0
        now = self.env.now
        loads = []
        for i in self.serving:
            engine = self.replicas[i]
            free += max(0, engine.max_seqs - engine.n_running - engine.n_waiting)
            kv_used += engine.kv_used
            kv_cap += engine.kv_cap
            # chunked prefills under way have computed part of their prompt (a few sequences at most)
            computed = sum(seq.computed for seq in getattr(engine, "prefilling", ()))
            loads.append(
                ReplicaLoad(
                    engine.n_running, engine.n_waiting, self.prefill_tokens[i] - computed, self.prefill_pairs[i],
                    engine.kv_used, engine.kv_cap, engine.max_seqs, self.work[i], self.prompt_tokens_total[i],
                    polled_at=now, waiting_by_priority=dict(self.waiting_by_priority[i]),
                    remaining_steps=remaining_steps(engine) if known_outputs else (),
                )
            )  # fmt: skip
        return PoolSnapshot(
            now, self.in_flight_gpu_s, dict(self.in_flight_by_tier), self.queued, self.running, free,
            kv_used / kv_cap if kv_cap else 0.0, self.available_gpus, self.remaining_gpu_s(), tuple(loads),
        )  # fmt: skip

    def gauges(self, r: int) -> Gauges:
        """Replica `r`'s /metrics as a poll now reads them (the engine's gauges of its last step's end)."""
        engine = self.replicas[r]
        running, waiting, kv = engine.gauges(self.env.now)
        cap = engine.kv_cap
        return Gauges(
            running, waiting, kv / cap if cap else 0.0, cap, self.prompt_tokens_total[r], self.env.now
        )

    def generated(self, rid: int) -> int:
        """Output tokens request `rid` (in flight, past its first token) has produced so far."""
        return self._generated(self.seqs[rid], self.replicas[self.replica_of[rid]])

    def remaining_gpu_s(self) -> float:
        """In-flight work still to do: each request's charge less its prefill (once its first token is out)
        and the tokens it has decoded, priced at the estimator's rates, never below zero per request. Only
        the requests in a batch have progress, so this costs at most the batch slots of the pool."""
        est = self.estimator
        if est is None:
            return self.in_flight_gpu_s
        done = 0.0
        for rid in self.started:
            seq = self.seqs.get(rid)
            if seq is None or rid not in self.prefilled:
                continue
            generated = self._generated(seq, self.replicas[self.replica_of[rid]])
            done += est.done(self.estimate[rid], self.prompt[rid], generated)
        return max(0.0, self.in_flight_gpu_s - done)

    @staticmethod
    def _generated(seq: Seq, engine: BatchingEngine | ClassicalServer) -> int:
        """Output tokens a sequence has produced so far (decoders keep a lazy clock)."""
        if seq.state == DECODE and isinstance(engine, BatchingEngine):
            return seq.gen_join + engine.clock - seq.join_clock
        return seq.generated

    def admit(self, rid: int, tier: str, estimate_gpu_s: float, replica: int | None = None) -> None:
        """Take an admitted request, charged `estimate_gpu_s` by the gateway that admitted it and sent to
        `replica` (None: routed by the pool's books, or held for central dispatch)."""
        self.in_flight_by_tier[tier] = self.in_flight_by_tier.get(tier, 0.0) + estimate_gpu_s
        self.tier_of[rid] = tier
        self.estimate[rid] = estimate_gpu_s
        self.in_flight_gpu_s += estimate_gpu_s
        if self.in_flight_gpu_s > self.peak_in_flight_gpu_s:
            self.peak_in_flight_gpu_s = self.in_flight_gpu_s
        self.queued += 1
        if self.central:
            self.queue.append(rid)
            self.in_queue.add(rid)
            self._dispatch()
        else:
            self._send(rid, self._route() if replica is None else replica)

    def abort(self, rid: int) -> None:
        """The client went away: take the request out of the queue or the engine."""
        if rid in self.in_queue:
            self.in_queue.discard(rid)  # removed lazily from the deque
        else:
            seq = self.seqs.pop(rid)
            r = self.replica_of[rid]
            if rid in self.started:  # the work done on it is lost with it
                prompt = self.prompt[rid] if rid in self.prefilled else seq.computed
                self.listener.on_abort_progress(rid, prompt, self._generated(seq, self.replicas[r]))
            self.replicas[r].abort(seq)
            self.work[r] -= self.estimate[rid]
            if rid not in self.started:
                self._count_waiting(rid, r, -1)
            if rid not in self.prefilled:
                self._prefill_done(rid, r)
            if r in self.draining:
                self._retire_if_empty(r)
        if rid in self.started:
            self.running -= 1
        else:
            self.queued -= 1
        self._leave(rid)
        self.listener.on_aborted(rid, self.env.now)

    def _route(self) -> int:
        serving = self.serving
        if self.routing == "round_robin":
            self.rr = (self.rr + 1) % len(serving)
            return serving[self.rr]
        if self.routing == "least_loaded":
            replicas = self.replicas
            return min(serving, key=lambda i: replicas[i].n_running + replicas[i].n_waiting)
        return min(serving, key=self.work.__getitem__)

    def _send(self, rid: int, r: int) -> None:
        self.replica_of[rid] = r
        self.listener.on_routed(rid, r)
        self.work[r] += self.estimate[rid]
        prompt = self.prompt[rid]
        self.prefill_tokens[r] += prompt
        self.prefill_pairs[r] += prompt_attention_pairs(prompt)
        engine = self.replicas[r]
        if self.priorities is None:
            self.seqs[rid] = engine.submit(rid, prompt, self.output[rid])
        else:
            assert isinstance(engine, BatchingEngine), "only a batching engine schedules by priority"
            level = self.priorities.get(self.tier_of[rid], 0)
            self.seqs[rid] = engine.submit(rid, prompt, self.output[rid], level)
            self._count_waiting(rid, r, 1)

    def _count_waiting(self, rid: int, r: int, sign: int) -> None:
        """Under priority scheduling: count a request in (or out of) its replica's waiting work by priority."""
        if self.priorities is None:
            return
        level = self.priorities.get(self.tier_of[rid], 0)
        books = self.waiting_by_priority[r]
        n, tokens, pairs = books.get(level, (0, 0, 0.0))
        prompt = self.prompt[rid]
        books[level] = (n + sign, tokens + sign * prompt, pairs + sign * prompt_attention_pairs(prompt))

    def _prefill_done(self, rid: int, r: int) -> None:
        prompt = self.prompt[rid]
        self.prefill_tokens[r] -= prompt
        self.prefill_pairs[r] -= prompt_attention_pairs(prompt)

    def _dispatch(self) -> None:
        queue = self.queue
        while queue:
            rid = queue[0]
            if rid not in self.in_queue:
                queue.popleft()
                continue
            free = [i for i in self.serving if self.replicas[i].has_room()]
            if not free:
                return
            queue.popleft()
            self.in_queue.discard(rid)
            self._send(rid, min(free, key=self.work.__getitem__))

    # --- engine side (EngineListener) ----------------------------------------------------------------

    def on_scheduled(self, rid: int, now: float) -> None:
        self._count_waiting(rid, self.replica_of[rid], -1)
        self.queued -= 1
        self.running += 1
        self.started.add(rid)
        self.listener.on_scheduled(rid, now)

    def on_first_token(self, rid: int, now: float) -> None:
        self.prefilled.add(rid)
        r = self.replica_of[rid]
        self._prefill_done(rid, r)
        self.prompt_tokens_total[r] += self.prompt[rid]
        self.listener.on_first_token(rid, now)

    def on_finish(self, rid: int, now: float) -> None:
        self.running -= 1
        self.work[self.replica_of[rid]] -= self.estimate[rid]
        self._leave(rid)
        del self.seqs[rid]
        self.listener.on_finish(rid, now)

    def _leave(self, rid: int) -> None:
        est = self.estimate.pop(rid)
        self.in_flight_gpu_s -= est
        tier = self.tier_of.pop(rid)
        self.in_flight_by_tier[tier] -= est
        self.replica_of.pop(rid, None)
        self.started.discard(rid)
        self.prefilled.discard(rid)

    def on_slot_free(self, replica: int) -> None:
        if replica in self.draining:
            self._retire_if_empty(replica)
        if self.central and self.queue:
            self._dispatch()

    def on_preempt(self, rid: int) -> None:
        self.listener.on_preempt(rid)


def remaining_steps(engine: BatchingEngine | ClassicalServer) -> tuple[int, ...]:
    """Decode steps each sequence in a batching engine's batch has still to run, shortest first."""
    if not isinstance(engine, BatchingEngine):
        return ()
    clock = engine.clock
    left = [seq.finish_clock - clock for seq in engine.decoders]
    left += [seq.target - seq.generated for seq in engine.prefilling]
    return tuple(sorted(left))
