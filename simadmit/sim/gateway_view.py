"""What one simulated gateway replica sees of the pools: the engines' published gauges and its own books.

Each gateway keeps, per pool, the books a live gateway keeps (`admission.published`): per replica the
requests it sent there, those answering, their estimates and unanswered prompts, and the moving means that
price other gateways' requests, updated on routing, first token, finish and abort as the live gateway's
charge, answering and release. A poll builds its `PoolSnapshot` from each serving replica's gauges (as the
engine published them at the end of its last step) and these books, with the live gateway's rules: other
gateways' work is seen only as counts at this gateway's mean estimate, and its own requests' progress is
counted as a gateway streaming their tokens would count it. Requests a pool holds in its central dispatch
queue, not yet at any replica, count as queued, with no progress: this gateway's own at their charges, the
others' (the queue's length, which the dispatcher that holds it publishes, less its own) at its mean
estimate. Without central dispatch a gateway also routes as the live one does, by its books (`route`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import PoolSnapshot
from simadmit.admission.published import PoolBooks, ReplicaBooks
from simadmit.fleet.classical import ClassicalServer
from simadmit.fleet.pool import Pool, remaining_steps


class PoolLedger:
    """One gateway's books on one pool: the shared rule's books, per replica, and its central-queue share."""

    def __init__(self, prior_estimate_gpu_s: float, priorities: Mapping[str, int] | None = None) -> None:
        self.books = PoolBooks(prior_estimate_gpu_s, priorities)
        self.replicas: list[ReplicaBooks] = []
        self.held = ReplicaBooks()  # admitted, in the pool's central dispatch queue
        self.answering: set[int] = set()  # own requests in flight past their first token
        self.unanswered: set[int] = set()  # own requests at a replica, before their first token

    def replica(self, r: int) -> ReplicaBooks:
        """The books of replica `r`, opening them for replicas added since."""
        while len(self.replicas) <= r:
            self.replicas.append(ReplicaBooks())
        return self.replicas[r]


class GatewayView:
    """One simulated gateway's books on every pool, and the snapshots it polls."""

    def __init__(
        self,
        priors: list[float],
        estimators: list[CostEstimator],
        priorities: Sequence[Mapping[str, int] | None] | None = None,
    ) -> None:
        """Books per pool: `priors` price others' requests until this gateway has priced one; `priorities`:
        each pool's tier -> priority when its engines schedule by priority (None: FCFS)."""
        self.pools = [
            PoolLedger(prior, levels)
            for prior, levels in zip(priors, priorities or [None] * len(priors), strict=True)
        ]
        self.estimators = estimators  # price own requests' progress, as the live gateway's pool does

    def priced(self, p: int, gpu_s: float, prompt_tokens: int) -> None:
        """This gateway estimated a request for pool `p`, admitted or not."""
        self.pools[p].books.priced(gpu_s, prompt_tokens)

    def admitted(self, p: int, tier: str, gpu_s: float, prompt_tokens: int) -> None:
        """This gateway admitted a request to pool `p`: charged, held until the pool routes it."""
        self.pools[p].books.charge(self.pools[p].held, tier, gpu_s, prompt_tokens)

    def route(self, p: int, pool: Pool, routing: str) -> int:
        """The serving replica of pool `p` this gateway sends an admitted request to, by its books."""
        ledger = self.pools[p]
        ledger.replica(len(pool.replicas) - 1)
        serving = pool.serving
        return serving[ledger.books.pick([ledger.replicas[r] for r in serving], routing)]

    def routed(self, p: int, r: int, rid: int, tier: str, gpu_s: float, prompt_tokens: int) -> None:
        """Pool `p` sent one of this gateway's requests (`rid`, of `tier`) to replica `r`."""
        ledger = self.pools[p]
        ledger.unanswered.add(rid)
        level = ledger.books.priority(tier)
        ledger.held.remove(gpu_s, False, prompt_tokens, level)
        ledger.replica(r).add(gpu_s, prompt_tokens, level)

    def answering(self, p: int, r: int, rid: int, tier: str, prompt_tokens: int) -> None:
        """An own request's first token came out."""
        ledger = self.pools[p]
        ledger.answering.add(rid)
        ledger.unanswered.discard(rid)
        ledger.books.answering(ledger.replica(r), prompt_tokens, tier)

    def released(self, p: int, r: int, rid: int, tier: str, gpu_s: float, prompt_tokens: int) -> None:
        """An own request ended (finished or aborted) on replica `r` (-1: still in the central queue)."""
        ledger = self.pools[p]
        answered = rid in ledger.answering
        ledger.answering.discard(rid)
        ledger.unanswered.discard(rid)
        ledger.books.release(
            ledger.held if r < 0 else ledger.replica(r), tier, gpu_s, answered, prompt_tokens
        )

    @staticmethod
    def _own_in_service(ledger: PoolLedger, pool: Pool, r: int) -> int:
        """1 when replica `r` is a textbook server serving one of this gateway's requests: it publishes its
        current state, that request among its running, though it has no first token until it is done."""
        engine = pool.replicas[r]
        if not isinstance(engine, ClassicalServer) or engine.current is None:
            return 0
        return int(engine.current.rid in ledger.unanswered)

    def snapshot(self, p: int, pool: Pool, known_outputs: bool = False) -> PoolSnapshot:
        """Pool `p` as this gateway sees it now: its serving replicas' published gauges and its books; with
        `known_outputs` each batch's remaining decode steps too (a study's oracle)."""
        ledger = self.pools[p]
        ledger.replica(len(pool.replicas) - 1)  # books for every replica, from here on indexed directly
        replicas = []
        for r in pool.serving:
            books, gauges = ledger.replicas[r], pool.gauges(r)
            books.count_others(gauges.running, gauges.waiting, self._own_in_service(ledger, pool, r))
            replicas.append((books, gauges))
        est, serving, replica_of = self.estimators[p], set(pool.serving), pool.replica_of
        done = 0.0
        for rid in ledger.answering:
            if replica_of[rid] in serving:
                done += est.done(pool.estimate[rid], pool.prompt[rid], pool.generated(rid))
        limits = pool.limits
        held = ledger.held
        snap = ledger.books.pool_snapshot(
            pool.env.now, replicas, pool.replicas[0].max_seqs, pool.gpus_per_replica,
            limits.kv_capacity_tokens if limits is not None else 0, done,
            max(0, len(pool.in_queue) - held.own_requests),
        )  # fmt: skip
        if known_outputs:
            for load, r in zip(snap.replicas, pool.serving, strict=True):
                load.remaining_steps = remaining_steps(pool.replicas[r])
        if held.own_requests:
            snap = replace(
                snap, in_flight_gpu_s=snap.in_flight_gpu_s + held.own_gpu_s, queued=snap.queued + held.own_requests,
                remaining_gpu_s=snap.remaining_gpu_s + held.own_gpu_s,
            )  # fmt: skip
        return snap
