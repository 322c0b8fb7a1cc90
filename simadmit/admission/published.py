"""A gateway's view of a pool from what vLLM publishes (/metrics gauges) and the books of its own work.

vLLM publishes per replica the requests running and waiting, the KV-cache use, the prompt tokens prefilled
so far (`vllm:prompt_tokens_total`), and no predicted GPU-seconds nor anything per request. A gateway knows
exactly only the requests it sent itself, at the estimates it charged. So its snapshot's in-flight work is
its own requests at their estimates, plus the requests a replica holds beyond them (other gateways' work)
counted from the gauges and priced at the mean estimate of the requests this gateway has priced. vLLM's running and
waiting gauges can leave out requests that have not produced a first token yet (measured on a CPU server,
whose steps last seconds: `waiting` stayed 0 while up to half of the requests in flight waited for theirs),
so of the gateway's own requests the count is taken to hold those whose answer has begun, and those not yet
answering only as far as vLLM reports requests waiting; an own request vLLM already runs before its first
token is then counted twice, on the cautious side.

The live HTTP gateway (`serve.backends.LivePool`) and the simulator build every gateway's `PoolSnapshot`
with these rules, so a simulated gateway sees what a deployed one can: the gauges at their last poll (a
simulated engine publishes them as vLLM does, at the end of each step) and its own books.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import PoolSnapshot
from simadmit.admission.view import ReplicaLoad, prompt_attention_pairs

# how fast the mean estimate follows the requests priced: about the last 50. Until 50 are priced it is their
# plain mean: a prior (a tier's max_tokens with no prompt) left to fade at this rate would price
# other gateways' requests low for minutes
ESTIMATE_SMOOTHING = 0.02


def prior_price(estimator: CostEstimator, max_tokens: Iterable[int]) -> float:
    """What a gateway prices other gateways' requests at before it has priced one: the mean, over the pool's
    tiers, of a request with no prompt and the tier's `max_tokens` (0 when it serves none)."""
    charges = [estimator.estimate(0, m) for m in max_tokens]
    return sum(charges) / len(charges) if charges else 0.0


class Gauges(NamedTuple):
    """One replica's /metrics as last polled: running and waiting requests, KV-cache use (a fraction), its
    KV capacity in tokens (0: not published), prompt tokens prefilled since it started, and when. (A named
    tuple: a simulation builds one per replica per poll.)"""

    running: float
    waiting: float
    kv_usage: float
    kv_capacity: int = 0
    prompt_tokens_total: int = 0
    polled_at: float = float("-inf")


@dataclass(slots=True, kw_only=True)
class ReplicaBooks:
    """A gateway's books of its own work on one replica, and what the last poll said of everyone else's."""

    own_requests: int = 0  # admitted by this gateway, sent here, not finished
    own_answering: int = 0  # of them, those whose answer has begun: the ones vLLM's gauges count
    own_gpu_s: float = 0.0
    own_prefill_tokens: int = 0  # prompt tokens of own requests sent here that have no first token yet
    own_prefill_pairs: float = 0.0  # their prefill attention pairs
    others_at_poll: float = 0.0  # requests the replica held at the last poll beyond this gateway's own
    others_waiting: float = 0.0  # of them, those vLLM reported waiting
    # under priority scheduling: priority -> (own requests without a first token, their prompt tokens, pairs)
    own_pending_by_priority: dict[int, tuple[int, int, float]] = field(default_factory=dict)

    def count_others(self, running: float, waiting: float, own_running: int = 0) -> None:
        """A poll read `running` and `waiting`: the requests in them beyond this gateway's own are
        others' (own requests in the count: those answering, `own_running` of those not yet answering, which
        the replica is known to run (a textbook server, which publishes its current state), and the rest as
        far as vLLM has them waiting)."""
        pending = self.own_requests - self.own_answering - own_running
        counted_own = self.own_answering + own_running + min(pending, waiting)
        self.others_at_poll = max(0.0, running + waiting - counted_own)
        self.others_waiting = max(0.0, waiting - pending)

    def add(self, gpu_s: float, prompt_tokens: int, priority: int | None = None) -> None:
        """An own request charged `gpu_s` with a prompt of `prompt_tokens` (of `priority`, when the replica
        schedules by priority) is sent here."""
        self.own_requests += 1
        self.own_gpu_s += gpu_s
        self.own_prefill_tokens += prompt_tokens
        self.own_prefill_pairs += prompt_attention_pairs(prompt_tokens)
        self._pending(priority, prompt_tokens, 1)

    def _pending(self, priority: int | None, prompt_tokens: int, sign: int) -> None:
        """Count an own request without a first token in (or out of) its priority's books."""
        if priority is None:
            return
        n, tokens, pairs = self.own_pending_by_priority.get(priority, (0, 0, 0.0))
        n, tokens = n + sign, tokens + sign * prompt_tokens
        if n:
            pairs = max(0.0, pairs + sign * prompt_attention_pairs(prompt_tokens))
            self.own_pending_by_priority[priority] = (n, tokens, pairs)
        else:
            self.own_pending_by_priority.pop(priority, None)

    def prefilled(self, prompt_tokens: int, priority: int | None = None) -> None:
        """An own prompt leaves the prefill books (the pairs reset with the last, against rounding)."""
        self._pending(priority, prompt_tokens, -1)
        self.own_prefill_tokens -= prompt_tokens
        if self.own_requests == self.own_answering:
            self.own_prefill_pairs = 0.0
        else:
            self.own_prefill_pairs = max(0.0, self.own_prefill_pairs - prompt_attention_pairs(prompt_tokens))

    def remove(self, gpu_s: float, answered: bool, prompt_tokens: int, priority: int | None = None) -> None:
        """An own request leaves (`answered`: after its first token)."""
        self.own_requests -= 1
        self.own_answering -= answered
        if not answered:
            self.prefilled(prompt_tokens, priority)
        self.own_gpu_s = max(0.0, self.own_gpu_s - gpu_s) if self.own_requests else 0.0


def tier_priority(priorities: Mapping[str, int] | None, tier: str | None) -> int | None:
    """The priority a request of `tier` carries on engines scheduling by `priorities` (vLLM's `priority`
    request field; 0 for a tier not listed); None under FCFS (no `priorities`, where vLLM refuses one) or for
    a tier unknown."""
    return None if priorities is None or tier is None else priorities.get(tier, 0)


class PoolBooks:
    """One gateway's books of the work it admitted to one pool: the moving means of what it priced (the
    price of others' requests), its own work by tier, and the snapshot rule. When the pool's engines schedule
    by priority (`priorities`: tier -> priority), its own requests without a first token are also booked by
    priority, so an engine-aware policy lets a request overtake this gateway's waiting work of lower priority
    (other gateways' waiting requests, of unknown priority, stay ahead of it)."""

    def __init__(self, prior_estimate_gpu_s: float, priorities: Mapping[str, int] | None = None) -> None:
        self.priorities = priorities
        self.mean_estimate = prior_estimate_gpu_s  # moving mean of the GPU-seconds each request is priced at
        self.mean_prompt = 0.0  # moving mean of the prompt tokens priced (and of their attention pairs)
        self.mean_pairs = 0.0
        self.charges = 0
        self.own_by_tier: dict[str, float] = {}
        self.admits_by_tier: dict[str, int] = {}
        self.rr = 0  # round-robin routing's last pick

    def pick(self, replicas: Sequence[ReplicaBooks], routing: str) -> int:
        """Index of the replica (of a non-empty list) an admitted request goes to. least_work: least
        predicted work (own at its estimates, others' at the mean estimate); least_loaded: fewest requests;
        round_robin: in turn."""
        if routing == "round_robin":
            self.rr = (self.rr + 1) % len(replicas)
            return self.rr
        if routing == "least_loaded":
            return min(
                range(len(replicas)), key=lambda i: replicas[i].own_requests + replicas[i].others_at_poll
            )
        mean = self.mean_estimate
        return min(
            range(len(replicas)), key=lambda i: replicas[i].own_gpu_s + replicas[i].others_at_poll * mean
        )

    def priced(self, gpu_s: float, prompt_tokens: int) -> None:
        """This gateway estimated a request of `prompt_tokens` at `gpu_s`, admitted or not: the means follow
        every request priced. Following only those admitted would let a gateway that rejects everything
        (its early charges made at max_tokens, say) keep pricing others' work high, and so reject for good."""
        self.charges += 1  # a plain mean of the first prices (the prior counts until the first), then moving
        weight = max(ESTIMATE_SMOOTHING, 1 / self.charges)
        self.mean_estimate += weight * (gpu_s - self.mean_estimate)
        self.mean_prompt += weight * (prompt_tokens - self.mean_prompt)
        self.mean_pairs += weight * (prompt_attention_pairs(prompt_tokens) - self.mean_pairs)

    def priority(self, tier: str | None) -> int | None:
        """The priority a request of `tier` carries on this pool's engines (`tier_priority`)."""
        return tier_priority(self.priorities, tier)

    def charge(self, replica: ReplicaBooks, tier: str, gpu_s: float, prompt_tokens: int = 0) -> None:
        """An admitted request of `prompt_tokens` charged `gpu_s` is sent to `replica`."""
        replica.add(gpu_s, prompt_tokens, self.priority(tier))
        self.own_by_tier[tier] = self.own_by_tier.get(tier, 0.0) + gpu_s
        self.admits_by_tier[tier] = self.admits_by_tier.get(tier, 0) + 1

    def answering(self, replica: ReplicaBooks, prompt_tokens: int = 0, tier: str | None = None) -> None:
        """An own request (of `tier`) has begun its answer: vLLM counts it from now on, its prompt is
        prefilled."""
        replica.own_answering += 1
        replica.prefilled(prompt_tokens, self.priority(tier))

    def release(
        self, replica: ReplicaBooks, tier: str, gpu_s: float, answered: bool = False, prompt_tokens: int = 0
    ) -> None:
        """An own request ended (`answered`: after its first token)."""
        replica.remove(gpu_s, answered, prompt_tokens, self.priority(tier))
        left = self.own_by_tier.get(tier, 0.0) - gpu_s
        self.own_by_tier[tier] = left if left > 1e-12 else 0.0

    def replica_load(
        self, books: ReplicaBooks, gauges: Gauges, kv_capacity: int, max_seqs: int
    ) -> ReplicaLoad:
        """One replica as an engine-aware policy sees it. Every own request without a first token counts as
        waiting with its whole prompt (one vLLM already runs is counted twice, on the cautious side); other
        gateways' are only vLLM's waiting count beyond this gateway's own at the last poll, each with the
        mean prompt this gateway has sent (their prompts are not published), and their prompts being
        prefilled count only as running sequences. KV capacity: the replica's published one, else
        `kv_capacity` (the profile's)."""
        pending = books.own_requests - books.own_answering
        capacity = gauges.kv_capacity or kv_capacity
        return ReplicaLoad(
            int(gauges.running), pending + round(books.others_waiting),
            books.own_prefill_tokens + round(books.others_waiting * self.mean_prompt),
            books.own_prefill_pairs + books.others_waiting * self.mean_pairs,
            round(gauges.kv_usage * capacity), capacity, max_seqs,
            books.own_gpu_s + books.others_at_poll * self.mean_estimate, gauges.prompt_tokens_total,
            polled_at=gauges.polled_at,  # -inf before the first poll: no prefill rate from it
            waiting_by_priority=dict(books.own_pending_by_priority),
        )  # fmt: skip

    def pool_snapshot(
        self,
        now: float,
        replicas: Sequence[tuple[ReplicaBooks, Gauges]],
        max_seqs: int,
        gpus_per_replica: int,
        kv_capacity: int = 0,
        own_done_gpu_s: float = 0.0,
        others_queued: int = 0,
    ) -> PoolSnapshot:
        """The pool as this gateway sees it from its serving `replicas` (books and last gauges each) and
        `others_queued`, other gateways' requests waiting outside every replica (a central dispatch queue):
        in-flight work is own at the estimates charged plus others' at the mean estimate, spread over tiers
        in the mix this gateway admits; what remains is own less `own_done_gpu_s` (the progress its own
        answers show) plus others' in full (vLLM publishes no per-request progress)."""
        others = waiting = float(others_queued)
        own = running = free = kv = 0.0  # one pass: a simulation polls often
        loads = []
        for b, g in replicas:
            others += b.others_at_poll
            own += b.own_gpu_s
            running += g.running
            waiting += g.waiting
            free += max(0.0, max_seqs - g.running - g.waiting)
            kv += g.kv_usage
            loads.append(self.replica_load(b, g, kv_capacity, max_seqs))
        others_gpu_s = others * self.mean_estimate
        by_tier = dict(self.own_by_tier)
        admitted = sum(self.admits_by_tier.values())
        if admitted and others_gpu_s:  # other gateways' work, in the mix of tiers this one admits
            for tier, n in self.admits_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0.0) + others_gpu_s * n / admitted
        return PoolSnapshot(
            now, own + others_gpu_s, by_tier, int(waiting), int(running), int(free),
            kv / len(replicas) if replicas else 0.0, len(replicas) * gpus_per_replica,
            max(0.0, own - own_done_gpu_s) + others_gpu_s, tuple(loads),
        )  # fmt: skip
