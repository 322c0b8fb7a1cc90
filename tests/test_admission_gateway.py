"""The admission layer on its own: Gateway and Client driven by hand-built timelines, no simulator.

A live gateway process runs these very objects, so they must import nothing of the simulator and behave
exactly as the simulator's wiring assumes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from simadmit.admission.client import Client, ClientConfig
from simadmit.admission.estimator import CostEstimator, OutputLearner
from simadmit.admission.gateway import TOO_LONG, Gateway, PoolSnapshot
from simadmit.admission.policies import GpuSeconds, Request, Unconditional
from simadmit.admission.predictive import PredictedTtft
from simadmit.admission.view import EngineModel, ReplicaLoad
from simadmit.config.profile import StepTimeModel

EST = CostEstimator(prefill_tokens_per_gpu_s=1000.0, decode_tokens_per_gpu_s=100.0)


def test_admission_imports_no_simulator_pandas_or_simpy() -> None:
    """In a fresh interpreter, importing every admission module loads no simpy, pandas, matplotlib or any
    module of the simulator's layers."""
    code = (
        "import json, sys\n"
        "import simadmit.admission.policies, simadmit.admission.estimator\n"
        "import simadmit.admission.gateway, simadmit.admission.client\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    heavy = {"simpy", "pandas", "matplotlib"}
    forbidden = (
        "simadmit.sim",
        "simadmit.fleet",
        "simadmit.results",
        "simadmit.study",
        "simadmit.workload",
        "simadmit.cli",
    )
    assert not heavy & {m.split(".")[0] for m in loaded}
    assert not [m for m in loaded if m.startswith(forbidden)]


def snapshot(t: float, in_flight: float, gpus: int = 1, queued: int = 0) -> PoolSnapshot:
    return PoolSnapshot(t, in_flight, {"interactive": in_flight}, queued, 0, 8, 0.1, gpus)


def request(rid: int, prompt: int = 1000, max_tokens: int = 100, tier: str = "interactive") -> Request:
    return Request(rid, tier, prompt, max_tokens, 0.0)


def test_stale_view_plus_own_admits_between_snapshots() -> None:
    """Between polls a gateway sees the last snapshot plus what it admitted itself; another gateway's admits
    stay invisible until the next snapshot, which replaces the view (own admits included in it by then)."""
    policy = GpuSeconds(
        budgets_s={"interactive": 100.0}, headroom=1.0, max_pool_gpu_s=10.0
    )  # only the pool max binds
    a, b = Gateway(policy, [EST], [4096]), Gateway(policy, [EST], [4096])
    a.refresh(0, snapshot(0.0, 4.0))
    b.refresh(0, snapshot(0.0, 4.0))
    cost = EST.estimate(1000, 100)  # 1 + 1 = 2 GPU-seconds
    assert cost == pytest.approx(2.0)
    for rid in range(3):  # 4 -> 6 -> 8 -> 10: the third fits exactly
        decision, charged = a.decide(request(rid), 0, 0.1)
        assert decision.admit and charged == pytest.approx(cost)
    assert a.views[0].in_flight_gpu_s == pytest.approx(10.0) and a.views[0].queued == 3
    assert not a.decide(request(3), 0, 0.1)[0].admit  # a's own admits fill its view
    assert b.decide(request(4), 0, 0.1)[0].admit  # b does not see them: the race the headroom is for
    assert b.views[0].in_flight_gpu_s == pytest.approx(6.0)
    a.refresh(0, snapshot(0.2, 12.0))  # the pool now reports everyone's admits
    assert a.views[0].in_flight_gpu_s == 12.0 and a.views[0].queued == 0 and a.views[0].polled_at == 0.2
    assert a.views[0].free_batch_slots == 8 and a.views[0].kv_used_fraction == 0.1


def test_learned_output_charging() -> None:
    """With a learner, a tier is charged max_tokens until it has enough completions, then their mean."""
    gateway = Gateway(Unconditional(), [EST], [8192], OutputLearner(warmup=3))
    gateway.refresh(0, snapshot(0.0, 0.0))
    req = request(0, prompt=1000, max_tokens=500)
    assert gateway.decide(req, 0, 0.0)[1] == pytest.approx(1.0 + 5.0)
    for out in (10, 20, 30):
        gateway.observe_completion(req, out)
    assert gateway.decide(req, 0, 0.0)[1] == pytest.approx(1.0 + 0.2)
    gateway.observe_completion(request(9, tier="batch"), 10_000)
    assert gateway.decide(request(1, tier="batch", max_tokens=500), 0, 0.0)[1] == pytest.approx(6.0)


def test_too_long_requests_get_a_400_and_charge_nothing() -> None:
    gateway = Gateway(Unconditional(), [EST, EST], [2048, 8192])
    long = request(0, prompt=2000, max_tokens=49)
    decision, charged = gateway.decide(long, 0, 0.0)
    assert decision is TOO_LONG and not decision.admit and charged == 0.0
    assert gateway.views[0].in_flight_gpu_s == 0.0 and gateway.views[0].queued == 0
    assert gateway.decide(long, 1, 0.0)[0].admit  # the other pool serves a longer context
    assert gateway.decide(request(1, prompt=2000, max_tokens=48), 0, 0.0)[0].admit  # exactly the limit


def config(**kw: object) -> ClientConfig:
    base: dict[str, object] = dict(
        max_retries=3, honor_retry_after=True, backoff_base_s=1.0, backoff_cap_s=8.0, jitter="none",
        abandon_after_s=None,
    )  # fmt: skip
    base.update(kw)
    return ClientConfig(**base)  # type: ignore[arg-type]


def test_retries_never_exceed_the_limit_and_honour_retry_after() -> None:
    """Rejected every time: exactly max_retries retries, each waiting Retry-After + the exponential span."""
    client = Client(config(max_retries=3), lambda: 0.5)
    now, delays, tries = 0.0, [], 0
    while True:
        tries += 1
        client.attempt(tries)
        delay = client.after_rejection(7, tries, 2.0, now, float("inf"))
        if delay is None:
            break
        delays.append(delay)
        now += delay
    assert tries == 4 and delays == [2.0 + 1.0, 2.0 + 2.0, 2.0 + 4.0]
    ignoring = Client(config(honor_retry_after=False), lambda: 0.5)
    assert ignoring.after_rejection(1, 1, 30.0, 0.0, float("inf")) == 1.0


def test_client_gives_up_at_the_deadline_and_when_abandoning() -> None:
    client = Client(config(abandon_after_s=10.0), lambda: 0.0)
    assert client.after_rejection(1, 1, 4.0, 0.0, deadline_s=5.0) == 5.0  # arrives exactly at the deadline
    assert client.after_rejection(2, 1, 4.0, 0.0, deadline_s=4.9) is None  # would come too late
    assert client.abandons_at(3.0) == 13.0
    assert Client(config(), lambda: 0.0).abandons_at(3.0) is None


def test_retry_budget_caps_retries_at_a_fraction_of_first_attempts() -> None:
    """burst 1, ratio 0.5: one retry saved up, then one more per two first attempts."""
    client = Client(config(retry_budget_ratio=0.5, retry_budget_burst=1.0), lambda: 0.0)
    granted = []
    for rid in range(6):
        client.attempt(1)
        granted.append(client.after_rejection(rid, 1, 0.0, 0.0, float("inf")) is not None)
    assert granted == [True, False, True, False, True, False]


def test_replica_loads_own_sends_and_the_prefill_rate() -> None:
    """A snapshot's replica loads are copied into the view; an admitted request is counted on the replica
    least-work routing picks (its prompt queued, its charge added) until the next poll; the prefill rate is
    the counter's rate between polls, smoothed over 5 s: 2,000 tokens in 1 s moves it 1 - e^-0.2 of the way."""
    gateway = Gateway(Unconditional(), [EST], [8192])
    loads = (ReplicaLoad(work_gpu_s=2.0, prompt_tokens_total=1000), ReplicaLoad(work_gpu_s=1.0))
    gateway.refresh(0, PoolSnapshot(0.0, 3.0, {}, 0, 0, 8, 0.0, 2, replicas=loads))
    decision, est = gateway.decide(Request(1, "interactive", 500, 100, 0.0), 0, 0.0)
    view = gateway.views[0]
    assert decision.admit and view.replicas[1].prefill_tokens == 500 and view.replicas[1].waiting == 1
    assert view.replicas[1].work_gpu_s == pytest.approx(1.0 + est) and view.replicas[0].prefill_tokens == 0
    assert view.remaining_gpu_s == pytest.approx(est)
    later = (ReplicaLoad(prompt_tokens_total=3000, polled_at=1.0), ReplicaLoad(polled_at=1.0))
    gateway.refresh(0, PoolSnapshot(1.0, 0.0, {}, 0, 0, 8, 0.0, 2, replicas=later))
    assert view.replicas[0].prefill_rate_tps == pytest.approx(2000 * (1 - 2.718281828459045**-0.2))
    assert view.replicas[1].prefill_tokens == 0  # the poll replaced what this gateway had added


def test_the_gateway_passes_first_tokens_and_completions_to_a_learning_policy() -> None:
    """Predicted TTFT learns the actual/predicted ratio from the first tokens of what it admitted: after 20
    requests whose first token took twice the prediction, its factor is 2."""
    policy = PredictedTtft(budgets_s={"interactive": 3.0})
    gateway = Gateway(policy, [EST], [8192], engines=[EngineModel(StepTimeModel(0.01, 0.0, 0.0, 0.0), 8192)])
    idle = (ReplicaLoad(max_seqs=8, kv_capacity=10**6),)
    for rid in range(20):
        gateway.refresh(0, PoolSnapshot(0.0, 0.0, {}, 0, 0, 8, 0.0, 1, replicas=idle))
        request = Request(rid, "interactive", 100, 10, 0.0)
        decision, _ = gateway.decide(request, 0, 0.0)
        assert decision.predicted_wait_s == pytest.approx(0.01)
        gateway.observe_first_token(request, 0.0, 0.02)
        gateway.observe_completion(request, 10, 0.1)
    assert policy.ratio.factor("interactive") == pytest.approx(2.0)
    assert policy.outputs.expected("interactive") == 256  # cautious until 100 completions
