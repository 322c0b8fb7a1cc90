"""Pool: a model's replicas behind the gateway, and the true state the gateway polls.

It routes each admitted request to a serving replica (least predicted work, round-robin or fewest
requests) or, with central dispatch, holds it in one FIFO queue until a replica has a free batch slot: the
textbook single queue feeding c servers. It keeps the books the gateway polls: in-flight predicted
GPU-seconds, queued and running requests, available GPUs. An autoscaler may add replicas (serving only
after their cold start) and drain them (no new work; retired once empty).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import simpy

from simadmit.fleet.classical import ClassicalServer
from simadmit.fleet.engine import BatchLimits, EngineListener, Replica, Seq, StepObserver
from simadmit.sim.ledger import ABORTED, COMPLETED, Ledger
from simadmit.config.profile import StepTimeModel


class Pool(EngineListener):
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        replicas: int,
        gpus_per_replica: int,
        estimate: np.ndarray,
        workload_prompt: np.ndarray,
        workload_output: np.ndarray,
        ledger: Ledger,
        on_done: Callable[[int], None],
        routing: str,
        central: bool,
        step: StepTimeModel | None = None,
        limits: BatchLimits | None = None,
        service_s: np.ndarray | None = None,
        observer: StepObserver | None = None,
    ) -> None:
        self.env = env
        self.index = index
        self.estimate = estimate
        self.prompt = workload_prompt
        self.output = workload_output
        self.ledger = ledger
        self.on_done = on_done
        self.routing = routing
        self.central = central
        self.gpus_per_replica = gpus_per_replica
        self.step = step
        self.limits = limits
        self.service_s = service_s
        self.observer = observer
        self.replicas: list[Replica | ClassicalServer] = []
        self.work: list[float] = []  # predicted GPU-seconds routed to each replica and not finished
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
        self.tier_of: dict[int, str] = {}  # admitted requests in flight -> their tier
        self.queue: deque[int] = deque()  # central dispatch queue
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
            engine: Replica | ClassicalServer = ClassicalServer(self.env, i, self.service_s, self, self.observer)
        else:
            assert self.step is not None and self.limits is not None
            engine = Replica(self.env, i, self.step, self.limits, self, self.observer)
        self.replicas.append(engine)
        self.work.append(0.0)
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

    def admit(self, rid: int, tier: str) -> None:
        self.in_flight_by_tier[tier] = self.in_flight_by_tier.get(tier, 0.0) + self.estimate[rid]
        self.tier_of[rid] = tier
        self.in_flight_gpu_s += self.estimate[rid]
        if self.in_flight_gpu_s > self.peak_in_flight_gpu_s:
            self.peak_in_flight_gpu_s = self.in_flight_gpu_s
        self.queued += 1
        self.ledger.admit[rid] = self.env.now
        self.ledger.pool[rid] = self.index
        if self.central:
            self.queue.append(rid)
            self.in_queue.add(rid)
            self._dispatch()
        else:
            self._send(rid, self._route())

    def abort(self, rid: int) -> None:
        """The client went away: take the request out of the queue or the engine."""
        led = self.ledger
        if rid in self.in_queue:
            self.in_queue.discard(rid)  # removed lazily from the deque
        else:
            seq = self.seqs.pop(rid)
            r = led.replica[rid]
            self.replicas[r].abort(seq)
            self.work[r] -= self.estimate[rid]
            if r in self.draining:
                self._retire_if_empty(r)
        if led.scheduled[rid] != led.scheduled[rid]:  # NaN: never scheduled
            self.queued -= 1
        else:
            self.running -= 1
        self._leave(rid, self.estimate[rid])
        led.outcome[rid] = ABORTED
        self.on_done(rid)

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
        self.ledger.replica[rid] = r
        self.work[r] += self.estimate[rid]
        self.seqs[rid] = self.replicas[r].submit(rid, int(self.prompt[rid]), int(self.output[rid]))

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
        self.queued -= 1
        self.running += 1
        self.ledger.scheduled[rid] = now

    def on_first_token(self, rid: int, now: float) -> None:
        self.ledger.first_token[rid] = now

    def on_finish(self, rid: int, now: float) -> None:
        led = self.ledger
        led.finish[rid] = now
        led.outcome[rid] = COMPLETED
        self.running -= 1
        est = self.estimate[rid]
        self._leave(rid, est)
        self.work[led.replica[rid]] -= est
        del self.seqs[rid]
        self.on_done(rid)

    def _leave(self, rid: int, est: float) -> None:
        self.in_flight_gpu_s -= est
        tier = self.tier_of.pop(rid)
        self.in_flight_by_tier[tier] -= est

    def on_slot_free(self, replica: int) -> None:
        if replica in self.draining:
            self._retire_if_empty(replica)
        if self.central and self.queue:
            self._dispatch()

    def on_preempt(self, rid: int) -> None:
        self.ledger.preemptions[rid] += 1
