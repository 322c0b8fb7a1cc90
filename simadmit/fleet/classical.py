"""ClassicalServer: the engine reduced to a textbook queue (batch of 1, service time from a distribution).

It has the same interface as `engine.BatchingEngine`, so the whole gateway/pool/client path runs unchanged, and
queueing theory (M/M/1, M/M/c, M/M/c/K, M/D/1) can check the simulator end to end.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import simpy

from simadmit.fleet.engine import DONE, PREFILL, Engine, EngineListener, Seq, StepObserver


class ClassicalServer(Engine):
    """One server, FCFS, serving request `rid` for `service_s[rid]` seconds."""

    max_seqs = 1
    kv_used = 0  # a textbook server holds no KV cache
    kv_cap = 0

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        service_s: np.ndarray,
        listener: EngineListener,
        observer: StepObserver | None = None,
    ) -> None:
        self.env = env
        self.index = index
        self.service_s = service_s
        self.listener = listener
        self.observer = observer
        self.waiting: deque[Seq] = deque()
        self.n_waiting = 0
        self.current: Seq | None = None
        self.busy = False
        self.busy_since = 0.0
        self.busy_periods: list[tuple[float, float]] = []
        self.busy_total = 0.0

    @property
    def n_running(self) -> int:
        return 0 if self.current is None else 1

    def has_room(self) -> bool:
        return self.current is None and self.n_waiting == 0

    def gauges(self, now: float) -> tuple[int, int, int]:
        """(running, waiting, KV tokens held) as a metrics endpoint would read: a server without steps
        publishes its current state."""
        return self.n_running, self.n_waiting, 0

    def submit(self, rid: int, prompt: int, target: int) -> Seq:
        seq = Seq(rid, prompt, target)
        self.waiting.append(seq)
        self.n_waiting += 1
        if not self.busy:
            self.busy = True
            self.busy_since = self.env.now
            self._next()
        return seq

    def _next(self) -> None:
        while self.waiting and self.waiting[0].aborted:
            self.waiting.popleft()
        if not self.waiting:
            self.busy = False
            self.busy_periods.append((self.busy_since, self.env.now))
            self.busy_total += self.env.now - self.busy_since
            return
        seq = self.waiting.popleft()
        self.n_waiting -= 1
        seq.state = PREFILL
        self.current = seq
        self.listener.on_scheduled(seq.rid, self.env.now)
        if self.observer is not None:
            self.observer(self.index, 1, 1, 0)
        ev = self.env.timeout(float(self.service_s[seq.rid]))
        ev.callbacks.append(self._done)

    def _done(self, _ev: simpy.Event) -> None:
        seq = self.current
        assert seq is not None
        self.current = None
        seq.state = DONE
        if not seq.aborted:  # an aborted request still held the server: the work was already under way
            now = self.env.now
            self.listener.on_first_token(seq.rid, now)
            self.listener.on_finish(seq.rid, now)
        self.listener.on_slot_free(self.index)
        self._next()
