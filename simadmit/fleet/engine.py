"""BatchingEngine: a vLLM-like continuous-batching replica, simulated one engine iteration per event.

Each step follows vLLM V1's scheduler. Running sequences are served in their running order (the order they
were last admitted in) within the token budget (`max_num_batched_tokens`): a decoding sequence takes one
token, a sequence still prefilling takes the rest of its prompt or what the budget leaves (a chunk). KV
memory comes in blocks of `kv_block_size` tokens; a sequence that needs a block when none is free makes the
newest running sequence give up its blocks (preemption: it returns to the head of the queue, to be
recomputed). Only in a step that preempted nobody are waiting sequences admitted, in FCFS order, while the
batch has a slot (`max_num_seqs`), the budget has a token and the KV cache has the blocks for the first
chunk. A step lasts the profile's step time.

With priority scheduling (vLLM's `--scheduling-policy priority`) the waiting queue is ordered by (priority,
arrival): a lower number first, then the earlier arrival, a preempted sequence keeping its place. When a
sequence cannot get its blocks, the running sequence of the lowest priority (the latest arrival among
equals) is preempted instead of the newest; one already scheduled in this step gives its token budget and
blocks back. vLLM V1 preempts nobody just to admit a waiting request of higher priority (V0 did); nor does
this engine. One difference: when the sequence short of blocks is itself the one preempted, vLLM schedules
none of the running sequences after it in that step; here they run (a step's delay, in a preempting step).

Under these rules only the newest running sequence can be mid-prefill (a later one was admitted only if
the budget outlasted its prompt), so the running order is: every decoder, oldest first, then that one. The
engine keeps decoders as a group (KV tokens derived from a step clock, block needs from a count of
decoders per position within their last block) and walks them one by one only in the rare step that must
preempt; `tests/reference_engine.py` walks every step literally and the two are compared request by request.

Stretches where the batch only decodes and nothing can join are fast-forwarded: k identical steps become
one event, ending at the first finish or before the step whose blocks cannot be allocated. Context grows by
one token per sequence per step, so the stretch's duration is an arithmetic series. An arrival (or an
abort) during a stretch cuts it at the end of the step in progress, as a real engine would only notice it
there. Step boundaries are processed after every other event of their instant, so requests that arrive
together start together.

The engine publishes gauges as vLLM's /metrics does (`gauges`): the running and waiting requests and the KV
blocks held as they stood at the end of the last finished step. vLLM takes new requests in between steps
and publishes its scheduler's counts once a step is over, so a request submitted during a step shows in the
gauges only at the end of the next one. Within a fast-forwarded stretch the gauges of its finished steps are
derived from the stretch (the batch and queue only change at its end, save the submissions it records).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import simpy
from simpy.events import NORMAL, Event, EventPriority

from simadmit.config.profile import StepTimeModel, prefill_attention_pairs, sequence_kv_blocks

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
LATE = EventPriority(NORMAL + 1)  # after SimPy's URGENT and NORMAL: a step waits for the rest of its instant


class Seq:
    """One admitted request inside an engine. Plain slots object: this is the inner loop."""

    __slots__ = (
        "rid", "prompt", "target", "prefill_target", "computed", "generated", "kv", "phase",
        "state", "order", "join_clock", "gen_join", "kv_join", "finish_clock", "aborted", "started", "rank",
    )  # fmt: skip

    def __init__(self, rid: int, prompt: int, target: int, rank: tuple[int, int] = (0, 0)) -> None:
        self.rid = rid
        self.rank = rank  # (priority, arrival number): the waiting order under priority scheduling
        self.prompt = prompt
        self.target = target  # output tokens it will produce
        self.prefill_target = prompt  # tokens to (re)compute before the next token
        self.computed = 0
        self.generated = 0
        self.kv = 0  # KV tokens held (while prefilling; decoders derive it from the clock)
        self.phase = 0  # decoders: (KV tokens - clock) mod block size, fixed while it decodes
        self.state = WAITING
        self.order = 0  # running order: set each time it is admitted; preemption takes the highest
        self.join_clock = 0
        self.gen_join = 0
        self.kv_join = 0
        self.finish_clock = 0
        self.aborted = False
        self.started = False


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What bounds one engine step: batch slots, token budget, KV-cache tokens (in blocks of this size)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    kv_block_size: int = 1

    @property
    def kv_blocks(self) -> int:
        """The blocks sequences can hold (`sequence_kv_blocks`: vLLM keeps one back)."""
        return sequence_kv_blocks(self.kv_capacity_tokens, self.kv_block_size)


class EngineListener:
    """What a replica reports to its pool; the pool keeps the books."""

    def on_scheduled(self, rid: int, now: float) -> None: ...
    def on_first_token(self, rid: int, now: float) -> None: ...
    def on_finish(self, rid: int, now: float) -> None: ...
    def on_slot_free(self, replica: int) -> None: ...
    def on_preempt(self, rid: int) -> None: ...


StepObserver = Callable[[int, int, int, int], None]  # (replica, running, batched tokens, kv used)


class _StepTimer(Event):
    """A timeout at LATE priority: it fires after every other event scheduled for its instant."""

    def __init__(self, env: simpy.Environment, delay: float, value: int) -> None:
        # as simpy.Timeout does, minus its NORMAL priority
        self.env = env
        self.callbacks = []
        self._value = value
        self._ok = True
        env.schedule(self, LATE, delay)


class PriorityQueue:
    """The waiting queue under priority scheduling: a heap on (priority, arrival number), with the deque
    operations the engine uses (so FCFS keeps its plain deque). A preempted sequence goes back by its rank."""

    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[tuple[tuple[int, int], Seq]] = []

    def __bool__(self) -> bool:
        return bool(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def __getitem__(self, index: int) -> Seq:
        assert index == 0, "only the head is ever looked at"
        return self.heap[0][1]

    def append(self, seq: Seq) -> None:
        heapq.heappush(self.heap, (seq.rank, seq))  # ranks are unique: sequences are never compared

    appendleft = append

    def popleft(self) -> Seq:
        return heapq.heappop(self.heap)[1]

    def __iter__(self) -> Iterator[Seq]:
        return (seq for _, seq in self.heap)


def _blocks(tokens: int, block: int) -> int:
    """Blocks holding this many KV tokens."""
    return -(-tokens // block)


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
        by_priority: bool = False,
    ) -> None:
        self.env = env
        self.index = index
        self.by_priority = by_priority  # vLLM's priority scheduling (see module docstring); else FCFS
        self.a = step.overhead_s
        self.c_prefill = step.per_prefill_token_s
        self.c_dec = step.per_decode_seq_s
        self.c_ctx = step.per_context_token_s
        self.c_attn = step.per_prefill_attention_s
        self.weights = step.weights_read_s
        self.max_seqs = limits.max_num_seqs
        self.budget = limits.max_num_batched_tokens
        self.kv_cap = limits.kv_capacity_tokens
        self.block = limits.kv_block_size
        self.n_blocks = limits.kv_blocks
        self.listener = listener
        self.observer = observer
        self.waiting: deque[Seq] | PriorityQueue = PriorityQueue() if by_priority else deque()
        self.arrivals = 0  # sequences submitted: their arrival numbers
        self.n_waiting = 0  # live (not aborted) waiting sequences
        self.prefilling: list[Seq] = []  # running and still prefilling, in running order
        self.decoders: set[Seq] = set()
        self.phase_count = [0] * self.block  # decoders per phase (see Seq.phase)
        self.heap: list[tuple[int, int, Seq]] = []
        self.clock = 0  # decode steps executed
        self.kv_used = 0  # KV tokens held by running sequences
        self.blocks_used = 0
        self.order = 0
        self.busy = False
        self.busy_since = 0.0
        self.busy_periods: list[tuple[float, float]] = []
        self.busy_total = 0.0
        self.pending_aborts: list[Seq] = []
        # the gauges at the end of the last step (see `gauges`), and when this segment's submissions came
        self.pub_running = 0
        self.pub_waiting = 0
        self.pub_kv = 0
        self.submitted_at: list[float] = []
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

    def submit(self, rid: int, prompt: int, target: int, priority: int = 0) -> Seq:
        seq = Seq(rid, prompt, target, (priority, self.arrivals))
        self.arrivals += 1
        self.waiting.append(seq)
        self.n_waiting += 1
        self.submitted_at.append(self.env.now)
        if not self.busy:  # the first step starts once every arrival of this instant is in
            self.busy = True
            self.busy_since = self.env.now
            self.seg_k = 0
            self.gen += 1
            _StepTimer(self.env, 0.0, self.gen).callbacks.append(self._on_wake)
        elif (self.n_waiting == 1 or self.by_priority) and len(self.prefilling) + len(
            self.decoders
        ) < self.max_seqs:
            self._cut()  # by priority, a newcomer may overtake a head that could not get its blocks
        return seq

    def abort(self, seq: Seq) -> None:
        """As `Engine.abort`; a stretch that the aborted request kept from admitting is cut short."""
        waiting = seq.state == WAITING
        super().abort(seq)
        if waiting and self.n_running < self.max_seqs:
            self._cut()  # the queue's head may have been what kept a stretch from admitting

    def _abort_running(self, seq: Seq) -> None:
        """Out of the batch at the next step boundary, as vLLM aborts a request whose client disconnected."""
        self.pending_aborts.append(seq)
        self._cut()

    def gauges(self, now: float) -> tuple[int, int, int]:
        """(running, waiting, KV tokens held) as vLLM's gauges read at `now`: at the end of the last step
        finished, without the requests submitted during that step (see module docstring). KV is held in
        whole blocks, as vLLM's `kv_cache_usage_perc` counts it (a sequence's part-filled last block too)."""
        k = self.seg_k
        elapsed = now - self.seg_start
        if k > 1 and elapsed >= self.seg_A:  # a stretch: its finished steps only decoded, nobody left
            m = min(k - 1, self._steps_done(elapsed))
            if m >= 1:
                start = self.seg_start + (m - 1) * self.seg_A + self.seg_B * (m - 1) * (m - 2) / 2
                late = len(self.submitted_at) - bisect_left(self.submitted_at, start)
                blocks = self.blocks_used + self._extra_blocks(m - 1)
                return self.seg_n_dec, max(0, self.n_waiting - late), blocks * self.block
        return self.pub_running, self.pub_waiting, self.pub_kv

    # --- the step loop -------------------------------------------------------------------------------

    def _on_wake(self, ev: Event) -> None:
        if ev.value == self.gen:
            self._start_step()

    def _start_step(self) -> None:
        self.submitted_at.clear()  # they are in the queue this step schedules from
        clock, block = self.clock, self.block
        n_dec = len(self.decoders)
        # running order: decoders (each needs a block when its last one is full), then the newest's chunk
        need = self.phase_count[-clock % block] if n_dec else 0
        budget = self.budget - n_dec
        prefills: list[tuple[Seq, int]] = []
        if self.prefilling:
            prefills, need = self._plan_prefills(budget, need)
        preempted = need > self.n_blocks - self.blocks_used
        if preempted:  # rare: walk the running order as vLLM does
            chunks = None
            if self.by_priority:
                chunks = self._make_room_by_priority()
            else:
                self._make_room()
            n_dec = len(self.decoders)
            budget = self.budget - n_dec
            need = self.phase_count[-clock % block] if n_dec else 0
            if chunks is None:
                prefills, need = self._plan_prefills(budget, need)
            else:
                prefills = chunks
                for seq, chunk in chunks:
                    need += _blocks(seq.kv + chunk, block) - _blocks(seq.kv, block)
            if n_dec == 0 and not prefills:
                raise RuntimeError("a request needs more KV blocks than the replica has")
        self.blocks_used += need
        self.kv_used += n_dec
        attention = self.c_attn != 0.0  # count (token, context) pairs only when they cost something
        prefill_tokens = 0
        pairs = 0.0
        for seq, chunk in prefills:
            if attention:
                pairs += prefill_attention_pairs(chunk, seq.computed)
            seq.kv += chunk
            prefill_tokens += chunk
        self.kv_used += prefill_tokens
        budget -= prefill_tokens
        waiting = self.waiting
        running = len(self.prefilling) + n_dec
        # then the FCFS queue, but never in a step that preempted (vLLM: `if not preempted_reqs`)
        while not preempted and waiting and budget > 0 and running < self.max_seqs:
            seq = waiting[0]
            if seq.aborted:
                waiting.popleft()
                continue
            chunk = min(seq.prefill_target, budget)
            nb = -(-chunk // block)
            if nb > self.n_blocks - self.blocks_used:
                break
            waiting.popleft()
            self.n_waiting -= 1
            seq.state = PREFILL
            seq.order = self.order
            self.order += 1
            self.prefilling.append(seq)
            running += 1
            if not seq.started:
                seq.started = True
                self.listener.on_scheduled(seq.rid, self.env.now)
            seq.kv = chunk
            self.kv_used += chunk
            self.blocks_used += nb
            budget -= chunk
            prefill_tokens += chunk
            if attention:
                pairs += prefill_attention_pairs(chunk, 0)
            prefills.append((seq, chunk))
        if n_dec == 0 and not prefills:
            self._go_idle()
            return
        if self.observer is not None:
            self.observer(self.index, running, n_dec + prefill_tokens, self.kv_used)
        # the step time (profile.StepTimeModel.step_time, inlined: this runs once per event)
        linear = self.c_prefill * prefill_tokens + self.c_dec * n_dec
        if linear < self.weights:  # a small batch's matrix products wait on reading the weights
            linear = self.weights
        A = self.a + linear + self.c_ctx * self.kv_used + self.c_attn * pairs
        k = 1
        if not prefills and not preempted:
            # decode only, and nobody can join: fast-forward to the first finish or to the last step
            # whose blocks can be allocated
            heap = self.heap
            top = heap[0]
            while top[2].state != DECODE or top[2].finish_clock != top[0]:
                heapq.heappop(heap)  # a preempted sequence's entry would cut the stretch short
                top = heap[0]
            k = max(1, top[0] - clock)
            free = self.n_blocks - self.blocks_used
            if k > 1 and n_dec * -(-(k - 1) // block) > free:  # the exact count only when it may bind
                k = min(k, 1 + self._steps_on_free_blocks(free, n_dec))
        B = self.c_ctx * n_dec
        self.seg_start = self.env.now
        self.seg_k = k
        self.seg_A = A
        self.seg_B = B
        self.seg_n_dec = n_dec
        self.seg_prefills = prefills
        self.gen += 1
        self._schedule(k * A + B * k * (k - 1) / 2)

    def _plan_prefills(self, budget: int, need: int) -> tuple[list[tuple[Seq, int]], int]:
        """Chunks of the running prefills within the budget, and the blocks needed counting them."""
        block = self.block
        prefills = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunk = min(seq.prefill_target - seq.computed, budget)
            need += -(-(seq.kv + chunk) // block) - -(-seq.kv // block)
            budget -= chunk
            prefills.append((seq, chunk))
        return prefills, need

    def _make_room(self) -> None:
        """Preempt from the end of the running order until every earlier sequence gets its blocks.

        vLLM walks the running order and, when a sequence cannot get its blocks, preempts the last one
        until it can (or it is the last one itself). The survivors are the longest prefix whose needs fit
        the free blocks plus those the preempted ones held.
        """
        block, clock = self.block, self.clock
        running: list[tuple[Seq, int, int]] = []  # (seq, blocks held, blocks needed this step)
        for seq in sorted(self.decoders, key=lambda s: s.order):
            tokens = seq.kv_join + clock - seq.join_clock
            running.append((seq, _blocks(tokens, block), 1 if tokens % block == 0 else 0))
        budget = self.budget - len(self.decoders)
        for seq in self.prefilling:
            chunk = min(seq.prefill_target - seq.computed, max(budget, 0))
            budget -= chunk
            held = _blocks(seq.kv, block)
            running.append((seq, held, _blocks(seq.kv + chunk, block) - held))
        room = self.n_blocks - self.blocks_used - sum(need for _, _, need in running)
        while room < 0:
            seq, held, need = running.pop()
            room += held + need
            self._preempt(seq)

    def _make_room_by_priority(self) -> list[tuple[Seq, int]]:
        """vLLM's priority mode: walk the running order; while a sequence cannot get its blocks, preempt
        the running sequence of the highest rank (lowest priority, latest arrival), handing back what one
        already walked took in this step, until it can or it was that one. Returns the prefill chunks."""
        block, clock = self.block, self.clock
        running: list[tuple[Seq, int, bool]] = [  # (seq, KV tokens held, decoding)
            (seq, seq.kv_join + clock - seq.join_clock, True) for seq in sorted(self.decoders, key=lambda s: s.order)
        ]  # fmt: skip
        running += [(seq, seq.kv, False) for seq in self.prefilling]
        free = self.n_blocks - self.blocks_used
        budget = self.budget
        taken: list[int] = []  # tokens of this step, per walked sequence
        victims = []
        j = 0
        while j < len(running) and budget > 0:
            seq, held, decoding = running[j]
            new = 1 if decoding else min(seq.prefill_target - seq.computed, budget)
            grow = _blocks(held + new, block) - _blocks(held, block)
            while grow > free:
                v = max(range(len(running)), key=lambda i: running[i][0].rank)
                victim, v_held, _ = running.pop(v)
                victims.append(victim)
                free += _blocks(v_held, block)
                if v < j:  # walked already: its tokens and new blocks come back
                    given = taken.pop(v)
                    budget += given
                    free += _blocks(v_held + given, block) - _blocks(v_held, block)
                    j -= 1
                if victim is seq:
                    break
            if j < len(running) and running[j][0] is seq:
                free -= grow
                budget -= new
                taken.append(new)
                j += 1
        for victim in victims:
            self._preempt(victim)
        return [(seq, new) for (seq, _, decoding), new in zip(running, taken, strict=False) if not decoding]

    def _steps_on_free_blocks(self, free: int, n_dec: int) -> int:
        """How many more decode steps after this one can get their blocks from `free`.

        After this step a decoder has s free slots in its last block (s = its slack); m more steps need
        ceil((m - s) / block) blocks from it if m > s. With m = q*block + r that totals
        n_dec*q + #{slack < r}: the largest m within `free` follows from a count of decoders per slack.
        """
        block, clock, count = self.block, self.clock, self.phase_count
        q, left = divmod(free, n_dec)
        r = below = 0
        while r < block - 1:
            below += count[(-(r + clock + 1)) % block]  # decoders with slack r
            if below > left:
                break
            r += 1
        return q * block + r

    def _extra_blocks(self, m: int) -> int:
        """Blocks the decoders take in the m steps after the first of a stretch (see above)."""
        block, count = self.block, self.phase_count
        q, r = divmod(m, block)
        if r == 0:
            return len(self.decoders) * q
        # slacks 0..r-1 are the phases top, top-1, ..., top-r+1 (cyclically): one or two slices
        top = (-self.clock - 1) % block
        low = top - r + 1
        below = sum(count[low : top + 1]) if low >= 0 else sum(count[: top + 1]) + sum(count[low:])
        return len(self.decoders) * q + below

    def _schedule(self, delay: float) -> None:
        # the timer carries the segment's generation: a stretch cut short leaves a stale timer behind
        _StepTimer(self.env, delay, self.gen).callbacks.append(self._on_timer)

    def _on_timer(self, ev: Event) -> None:
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
        # an arrival within rounding of a boundary ends the step now, never in the past
        self._schedule(max(0.0, self.seg_start + m * A + B * m * (m - 1) / 2 - self.env.now))

    def _steps_done(self, elapsed: float) -> int:
        """Whole steps of the stretch in progress finished `elapsed` seconds after it started."""
        A, B = self.seg_A, self.seg_B
        if B > 0:
            m = math.floor((-(A - B / 2) + math.sqrt((A - B / 2) ** 2 + 2 * B * elapsed)) / B + 1e-9)
        else:
            m = math.floor(elapsed / A + 1e-9)
        while m > 0 and m * A + B * m * (m - 1) / 2 > elapsed + 1e-12:
            m -= 1
        return max(0, m)

    def _end_step(self) -> None:
        now = self.env.now
        k = self.seg_k
        n_dec = self.seg_n_dec
        listener = self.listener
        freed = False
        if n_dec:
            if k > 1:
                self.blocks_used += self._extra_blocks(k - 1)
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
                self._drop_prefill(seq)
                seq.state = DONE
                if not seq.aborted:
                    listener.on_finish(seq.rid, now)
                    freed = True
                continue
            seq.state = DECODE
            seq.join_clock = self.clock
            seq.gen_join = seq.generated
            seq.kv_join = seq.kv
            seq.phase = (seq.kv - self.clock) % self.block
            self.phase_count[seq.phase] += 1
            seq.finish_clock = self.clock + seq.target - seq.generated
            self.decoders.add(seq)
            heapq.heappush(self.heap, (seq.finish_clock, seq.order, seq))
        if self.pending_aborts:
            for seq in self.pending_aborts:
                if seq.state == DECODE:
                    self._drop_decoder(seq)
                elif seq.state == PREFILL:
                    self.prefilling.remove(seq)
                    self._drop_prefill(seq)
                seq.state = DONE
            self.pending_aborts.clear()
            freed = True
        # the gauges of this step's end: without the submissions during its last step
        submitted = self.submitted_at
        if submitted:
            start = self.seg_start + (k - 1) * self.seg_A + self.seg_B * (k - 1) * (k - 2) / 2
            late = len(submitted) - bisect_left(submitted, start)
        else:
            late = 0
        self.pub_running = len(self.prefilling) + len(self.decoders)
        self.pub_waiting = max(0, self.n_waiting - late)
        self.pub_kv = self.blocks_used * self.block
        if freed:
            listener.on_slot_free(self.index)
        self._start_step()

    def _drop_decoder(self, seq: Seq) -> None:
        kv = seq.kv_join + self.clock - seq.join_clock
        self.decoders.discard(seq)
        self.phase_count[seq.phase] -= 1
        self.kv_used -= kv
        self.blocks_used -= -(-kv // self.block)
        seq.generated = seq.gen_join + self.clock - seq.join_clock

    def _drop_prefill(self, seq: Seq) -> None:
        self.kv_used -= seq.kv
        self.blocks_used -= -(-seq.kv // self.block)

    def _preempt(self, seq: Seq) -> None:
        """Free a running sequence's KV and put it back at the head of the queue, to be recomputed."""
        if seq.state == DECODE:
            self._drop_decoder(seq)
        else:
            self.prefilling.remove(seq)
            self._drop_prefill(seq)
        seq.kv = 0
        seq.computed = 0
        if seq.aborted:  # its client is gone: no point recomputing it
            seq.state = DONE
            return
        seq.state = WAITING
        seq.prefill_target = seq.prompt + seq.generated
        self.waiting.appendleft(seq)
        self.n_waiting += 1
        self.listener.on_preempt(seq.rid)

    def _go_idle(self) -> None:
        self.busy = False
        self.seg_k = 0
        self.busy_periods.append((self.busy_since, self.env.now))
        self.busy_total += self.env.now - self.busy_since
