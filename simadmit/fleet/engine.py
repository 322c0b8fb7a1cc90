"""BatchingEngine: a vLLM-like continuous-batching replica, simulated one engine iteration per event.

Each step follows vLLM's V1 scheduler: running sequences first (decodes, then unfinished chunked prefills)
within the token budget (`max_num_batched_tokens`), then waiting sequences in FCFS order while the batch
has a free slot (`max_num_seqs`) and the KV cache has room; when the KV cache cannot hold the running
decodes, the newest running sequence is preempted (its KV freed, recomputed later from the waiting queue's
head). A step lasts the profile's step time.

Stretches where the batch only decodes and nothing can join are fast-forwarded: k identical steps become
one event, ending at the first finish or when the KV cache would run out. Context grows by one token per
sequence per step, so the stretch's duration is an arithmetic series. An arrival (or an abort) during a
stretch cuts it at the end of the step in progress, as a real engine would only notice it there.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from simadmit.config.profile import StepTimeModel

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


class Seq:
    """One admitted request inside an engine. Plain slots object: this is the inner loop."""

    __slots__ = (
        "rid", "prompt", "target", "prefill_target", "computed", "generated", "kv",
        "state", "order", "join_clock", "gen_join", "kv_join", "finish_clock", "aborted", "started",
    )  # fmt: skip

    def __init__(self, rid: int, prompt: int, target: int, order: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.target = target  # output tokens it will produce
        self.prefill_target = prompt  # tokens to (re)compute before the next token
        self.computed = 0
        self.generated = 0
        self.kv = 0  # KV tokens held (while prefilling; decoders derive it from the clock)
        self.state = WAITING
        self.order = order  # admission order: preemption takes the newest
        self.join_clock = 0
        self.gen_join = 0
        self.kv_join = 0
        self.finish_clock = 0
        self.aborted = False
        self.started = False


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What bounds one engine step: batch slots, token budget, KV-cache tokens."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int


class EngineListener:
    """What a replica reports to its pool; the pool keeps the books."""

    def on_scheduled(self, rid: int, now: float) -> None: ...
    def on_first_token(self, rid: int, now: float) -> None: ...
    def on_finish(self, rid: int, now: float) -> None: ...
    def on_slot_free(self, replica: int) -> None: ...
    def on_preempt(self, rid: int) -> None: ...


StepObserver = Callable[[int, int, int, int], None]  # (replica, running, batched tokens, kv used)


class Engine:
    """What every engine shares with the pool: the waiting count, busy-time books, and client aborts."""

    env: simpy.Environment
    n_waiting: int
    busy: bool
    busy_since: float
    busy_total: float

    def abort(self, seq: Seq) -> None:
        """Client went away: drop it from the queue now; a running one is the engine's to stop."""
        if seq.aborted or seq.state == DONE:
            return
        seq.aborted = True
        if seq.state == WAITING:
            self.n_waiting -= 1  # removed lazily from the deque
        else:
            self._abort_running(seq)

    def _abort_running(self, seq: Seq) -> None:
        """A running sequence's client is gone (default: it runs to the end of its service)."""

    def busy_time(self, now: float) -> float:
        """Seconds spent running since the engine started."""
        return self.busy_total + (now - self.busy_since if self.busy else 0.0)


class BatchingEngine(Engine):
    """One continuous-batching engine (see module docstring)."""

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        step: StepTimeModel,
        limits: BatchLimits,
        listener: EngineListener,
        observer: StepObserver | None = None,
    ) -> None:
        self.env = env
        self.index = index
        self.a = step.overhead_s
        self.c_prefill = step.per_prefill_token_s
        self.c_dec = step.per_decode_seq_s
        self.c_ctx = step.per_context_token_s
        self.max_seqs = limits.max_num_seqs
        self.budget = limits.max_num_batched_tokens
        self.kv_cap = limits.kv_capacity_tokens
        self.listener = listener
        self.observer = observer
        self.waiting: deque[Seq] = deque()
        self.n_waiting = 0  # live (not aborted) waiting sequences
        self.prefilling: list[Seq] = []
        self.decoders: set[Seq] = set()
        self.heap: list[tuple[int, int, Seq]] = []
        self.clock = 0  # decode steps executed
        self.kv_used = 0
        self.order = 0
        self.busy = False
        self.busy_since = 0.0
        self.busy_periods: list[tuple[float, float]] = []
        self.busy_total = 0.0
        self.pending_aborts: list[Seq] = []
        # the segment in progress
        self.gen = 0
        self.seg_start = 0.0
        self.seg_k = 0
        self.seg_A = 0.0
        self.seg_B = 0.0
        self.seg_n_dec = 0
        self.seg_prefills: list[tuple[Seq, int]] = []

    # --- interface for the pool ----------------------------------------------------------------------

    @property
    def n_running(self) -> int:
        return len(self.prefilling) + len(self.decoders)

    def has_room(self) -> bool:
        """A free batch slot that no waiting sequence has claimed (for central dispatch)."""
        return self.n_running + self.n_waiting < self.max_seqs

    def submit(self, rid: int, prompt: int, target: int) -> Seq:
        seq = Seq(rid, prompt, target, self.order)
        self.order += 1
        self.waiting.append(seq)
        self.n_waiting += 1
        if not self.busy:
            self._wake()
        elif self.n_waiting == 1 and len(self.prefilling) + len(self.decoders) < self.max_seqs:
            self._cut()
        return seq

    def _abort_running(self, seq: Seq) -> None:
        """Out of the batch at the next step boundary, as vLLM aborts a request whose client disconnected."""
        self.pending_aborts.append(seq)
        self._cut()

    # --- the step loop -------------------------------------------------------------------------------

    def _wake(self) -> None:
        self.busy = True
        self.busy_since = self.env.now
        self._start_step()

    def _start_step(self) -> None:
        n_dec = len(self.decoders)
        while n_dec > self.kv_cap - self.kv_used:  # each decode needs one more KV token
            self._preempt_newest([*self.prefilling, *self.decoders])
            n_dec = len(self.decoders)
        self.kv_used += n_dec
        budget = self.budget - n_dec
        prefills: list[tuple[Seq, int]] = []
        prefill_tokens = 0
        i = 0
        while i < len(self.prefilling) and budget > 0:  # running chunked prefills continue first
            seq = self.prefilling[i]
            chunk = min(seq.prefill_target - seq.computed, budget, self.kv_cap - self.kv_used)
            if chunk <= 0:  # no KV left: the newest prefill makes room (possibly this one)
                self._preempt_newest(self.prefilling)
                continue
            seq.kv += chunk
            self.kv_used += chunk
            budget -= chunk
            prefill_tokens += chunk
            prefills.append((seq, chunk))
            i += 1
        waiting = self.waiting
        while waiting and budget > 0 and self.n_running < self.max_seqs:  # then the FCFS queue
            seq = waiting[0]
            if seq.aborted:
                waiting.popleft()
                continue
            chunk = min(seq.prefill_target - seq.computed, budget)
            if chunk > self.kv_cap - self.kv_used:
                break
            waiting.popleft()
            self.n_waiting -= 1
            seq.state = PREFILL
            self.prefilling.append(seq)
            if not seq.started:
                seq.started = True
                self.listener.on_scheduled(seq.rid, self.env.now)
            seq.kv += chunk
            self.kv_used += chunk
            budget -= chunk
            prefill_tokens += chunk
            prefills.append((seq, chunk))
        if n_dec == 0 and not prefills:
            self._go_idle()
            return
        if self.observer is not None:
            self.observer(self.index, self.n_running, n_dec + prefill_tokens, self.kv_used)
        A = self.a + self.c_prefill * prefill_tokens + self.c_dec * n_dec + self.c_ctx * self.kv_used
        k = 1
        if not self.prefilling:  # decode only: fast-forward to the first finish or the end of free KV
            k = max(1, min(self.heap[0][0] - self.clock, 1 + (self.kv_cap - self.kv_used) // n_dec))
        B = self.c_ctx * n_dec
        self.seg_start = self.env.now
        self.seg_k = k
        self.seg_A = A
        self.seg_B = B
        self.seg_n_dec = n_dec
        self.seg_prefills = prefills
        self.gen += 1
        self._schedule(k * A + B * k * (k - 1) / 2)

    def _schedule(self, delay: float) -> None:
        # the timeout carries the segment's generation: a stretch cut short leaves a stale timer behind
        self.env.timeout(delay, self.gen).callbacks.append(self._on_timer)

    def _on_timer(self, ev: simpy.Event) -> None:
        if ev.value == self.gen:
            self._end_step()

    def _cut(self) -> None:
        """Shorten a fast-forward stretch to the end of the step in progress."""
        if not self.busy or self.seg_k <= 1:
            return
        elapsed = self.env.now - self.seg_start
        A, B = self.seg_A, self.seg_B
        if B > 0:
            m = math.ceil((-(A - B / 2) + math.sqrt((A - B / 2) ** 2 + 2 * B * elapsed)) / B - 1e-9)
        else:
            m = math.ceil(elapsed / A - 1e-9)
        m = max(1, m)
        while m * A + B * m * (m - 1) / 2 < elapsed - 1e-12:
            m += 1
        if m >= self.seg_k:
            return
        self.seg_k = m
        self.gen += 1
        self._schedule(self.seg_start + m * A + B * m * (m - 1) / 2 - self.env.now)

    def _end_step(self) -> None:
        now = self.env.now
        k = self.seg_k
        n_dec = self.seg_n_dec
        listener = self.listener
        freed = False
        if n_dec:
            self.clock += k
            self.kv_used += n_dec * (k - 1)
            heap = self.heap
            clock = self.clock
            while heap and heap[0][0] <= clock:
                fc, _, seq = heapq.heappop(heap)
                if seq.state != DECODE or seq.finish_clock != fc:
                    continue  # stale entry of a preempted or aborted sequence
                self._drop_decoder(seq)
                seq.state = DONE
                if seq.aborted:
                    continue
                listener.on_finish(seq.rid, now)
                freed = True
        for seq, chunk in self.seg_prefills:
            if seq.state != PREFILL:
                continue
            seq.computed += chunk
            if seq.computed < seq.prefill_target:
                continue
            self.prefilling.remove(seq)
            seq.generated += 1
            if seq.generated == 1 and not seq.aborted:
                listener.on_first_token(seq.rid, now)
            if seq.generated >= seq.target:
                self.kv_used -= seq.kv
                seq.state = DONE
                if not seq.aborted:
                    listener.on_finish(seq.rid, now)
                    freed = True
                continue
            seq.state = DECODE
            seq.join_clock = self.clock
            seq.gen_join = seq.generated
            seq.kv_join = seq.kv
            seq.finish_clock = self.clock + seq.target - seq.generated
            self.decoders.add(seq)
            heapq.heappush(self.heap, (seq.finish_clock, seq.order, seq))
        if self.pending_aborts:
            for seq in self.pending_aborts:
                if seq.state == DECODE:
                    self._drop_decoder(seq)
                elif seq.state == PREFILL:
                    self.prefilling.remove(seq)
                    self.kv_used -= seq.kv
                seq.state = DONE
            self.pending_aborts.clear()
            freed = True
        if freed:
            listener.on_slot_free(self.index)
        self._start_step()

    def _drop_decoder(self, seq: Seq) -> None:
        kv = seq.kv_join + self.clock - seq.join_clock
        self.decoders.discard(seq)
        self.kv_used -= kv
        seq.generated = seq.gen_join + self.clock - seq.join_clock

    def _preempt_newest(self, candidates: list[Seq] | set[Seq]) -> None:
        """Free the newest candidate's KV and put it back at the head of the queue, to be recomputed."""
        newest = max(candidates, key=lambda s: s.order)
        if newest.state == DECODE:
            self._drop_decoder(newest)
        else:
            self.prefilling.remove(newest)
            self.kv_used -= newest.kv
        newest.kv = 0
        newest.computed = 0
        if newest.aborted:  # its client is gone: no point recomputing it
            newest.state = DONE
            return
        newest.state = WAITING
        newest.prefill_target = newest.prompt + newest.generated
        self.waiting.appendleft(newest)
        self.n_waiting += 1
        self.listener.on_preempt(newest.rid)

    def _go_idle(self) -> None:
        self.busy = False
        self.seg_k = 0
        self.busy_periods.append((self.busy_since, self.env.now))
        self.busy_total += self.env.now - self.busy_since
