"""Pool: a model's replicas behind the gateway, and the true state the gateway polls.

It routes each admitted request to a replica (least predicted work, round-robin or fewest requests) or,
with central dispatch, holds it in one FIFO queue until a replica has a free batch slot: the textbook
single queue feeding c servers. It keeps the books the gateway polls: in-flight predicted GPU-seconds,
queued and running requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import simpy

from simadmit.classical import ClassicalServer
from simadmit.engine import BatchLimits, EngineListener, Replica, Seq, StepObserver
from simadmit.ledger import ABORTED, COMPLETED, Ledger
from simadmit.profile import StepTimeModel


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
        if service_s is not None:
            self.replicas: list[Replica | ClassicalServer] = [
                ClassicalServer(env, i, service_s, self, observer) for i in range(replicas)
            ]
        else:
            assert step is not None and limits is not None
            self.replicas = [Replica(env, i, step, limits, self, observer) for i in range(replicas)]
        self.work = [0.0] * replicas  # predicted GPU-seconds routed to each replica and not finished
        self.seqs: dict[int, Seq] = {}
        self.queue: deque[int] = deque()  # central dispatch queue
        self.in_queue: set[int] = set()
        self.rr = 0
        # what the gateway polls
        self.in_flight_gpu_s = 0.0
        self.queued = 0
        self.running = 0

    @property
    def available_gpus(self) -> int:
        return len(self.replicas) * self.gpus_per_replica

    # --- gateway side ------------------------------------------------------------------------------

    def admit(self, rid: int) -> None:
        self.in_flight_gpu_s += self.estimate[rid]
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
        if led.scheduled[rid] != led.scheduled[rid]:  # NaN: never scheduled
            self.queued -= 1
        else:
            self.running -= 1
        self.in_flight_gpu_s -= self.estimate[rid]
        led.outcome[rid] = ABORTED
        self.on_done(rid)

    def _route(self) -> int:
        if self.routing == "round_robin":
            self.rr = (self.rr + 1) % len(self.replicas)
            return self.rr
        if self.routing == "least_loaded":
            loads = [r.n_running + r.n_waiting for r in self.replicas]
            return loads.index(min(loads))
        return self.work.index(min(self.work))

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
            free = [r for r in self.replicas if r.has_room()]
            if not free:
                return
            queue.popleft()
            self.in_queue.discard(rid)
            target = min(free, key=lambda r: self.work[r.index]).index
            self._send(rid, target)

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
        self.in_flight_gpu_s -= est
        self.work[led.replica[rid]] -= est
        del self.seqs[rid]
        self.on_done(rid)

    def on_slot_free(self, replica: int) -> None:
        if self.central and self.queue:
            self._dispatch()

    def on_preempt(self, rid: int) -> None:
        self.ledger.preemptions[rid] += 1
