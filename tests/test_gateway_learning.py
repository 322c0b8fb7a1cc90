"""Each gateway replica learns only from the answers it streams back, in the simulator as in the live gateway:
separate gateway processes share no state, so a simulation whose replicas pooled what they learned would
warm up twice as fast as the deployment it stands for. The live gateway learns under every
`estimate_output` the simulator does, and refuses the one it cannot know (`oracle`). A rate limiter, one
shared counter in the simulation, is shared out among the deployed processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from simadmit.admission.estimator import CostCorrection, OutputLearner, OutputQuantile
from simadmit.admission.policies import PoolView, Request
from simadmit.admission.predictive import PredictedTtft
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.sim.ledger import COMPLETED
from simadmit.sim.simulation import Simulation
from simadmit.sim.world import build_policies, build_world
from simadmit.workload.build import generate
from tests.serve_fake import FakeVllm
from tests.serve_helpers import completion, make_server, stack, until


def test_each_simulated_gateway_learns_from_the_requests_it_admitted() -> None:
    spec, base = load_scenario(default_scenario(), {
        "workload.duration_s": 60, "gateway.replicas": 3, "gateway.estimate_output": "learned",
    })  # fmt: skip
    workload = generate(spec.workload)
    policy = build_policies(spec)["predicted_ttft"]
    sim = Simulation(build_world(spec, base), workload, policy, spec.workload.seed)
    led = sim.run("predicted_ttft").ledger
    completed = np.asarray(led.outcome) == COMPLETED
    sender = np.asarray(sim.sender)
    policies = [g.policy for g in sim.gateways]
    assert len({id(p) for p in policies}) == 3 and all(isinstance(p, PredictedTtft) for p in policies)
    for g, gateway in enumerate(sim.gateways):
        mine = int((completed & (sender == g)).sum())
        assert mine > 100  # round-robin: each admitted about a third
        assert isinstance(gateway.learner, OutputLearner)
        assert sum(gateway.learner.count.values()) == mine  # its own completions, not the others'
        policy = gateway.policy
        assert isinstance(policy, PredictedTtft)
        assert sum(policy.decode_ratio.count.values()) <= mine  # its own streams' decode steps
        assert policy.pending == {} and policy.decoding == {}  # every request it admitted has ended


def test_a_central_limiter_is_one_counter_for_every_simulated_gateway() -> None:
    """A rate limiter's counters stand for a central store (Redis) the replicas share: with three gateways the
    interactive tier (~130k prompt tokens/s offered) still gets through only its bucket's 40k/s, where three
    buckets of its own would let in nearly all of it."""
    rate, burst = 40_000, 80_000
    spec, base = load_scenario(default_scenario(), {
        "workload.duration_s": 60, "gateway.replicas": 3,
        "policies": [{"kind": "token_bucket", "tiers": {"interactive": {"rate": rate, "burst": burst}}}],
    })  # fmt: skip
    workload = generate(spec.workload)
    policy = build_policies(spec)["token_bucket"]
    sim = Simulation(build_world(spec, base), workload, policy, spec.workload.seed)
    led = sim.run("token_bucket").ledger
    assert len({id(g.policy) for g in sim.gateways}) == 1
    interactive = workload.tier == workload.tier_names.index("interactive")
    admitted = np.isfinite(np.asarray(led.admit))
    span = float(np.nanmax(np.asarray(led.admit)))
    assert workload.prompt[interactive].sum() > 2.5 * (burst + rate * span)  # the bucket binds
    assert workload.prompt[interactive & admitted].sum() <= burst + rate * span


@pytest.mark.parametrize(
    ("mode", "kind"), [("learned", OutputLearner), ("quantile", OutputQuantile), ("ewma", CostCorrection)]
)
def test_the_live_gateway_learns_under_every_estimate_the_simulator_has(
    tmp_path: Path, mode: str, kind: type
) -> None:
    async def main() -> None:
        async with stack(tmp_path, [FakeVllm(output_tokens=5)], gateway__estimate_output=mode) as (
            server,
            client,
        ):
            gateway = server.gateway
            learned = gateway.correction if mode == "ewma" else gateway.learner
            assert isinstance(learned, kind) and server.learn
            for _ in range(25):  # past every learner's warm-up of 20
                response = await client.post("/v1/completions", json=completion(max_tokens=100, stream=True))
                assert response.status_code == 200
                await until(lambda: gateway.views[0].in_flight_gpu_s == 0)  # a poll saw it end: no backlog
            await until(lambda: server.pools[0].own_requests == 0)
            charged = gateway.estimate(Request(10_000, "interactive", 10, 100, 0.0, None), 0)
            # 5-token answers lower the charge of a request that may write 100
            assert charged < 0.9 * gateway.estimators[0].estimate(10, 100)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("estimate_output", "oracle", "oracle charges each request its true output, which a live gateway"),
        ("dispatch", "central", "central (holding admitted requests in the gateway until a batch slot"),
        ("view", "exact", "exact (every engine's current state) is a study's bound"),
    ],
)
def test_the_live_gateway_refuses_what_only_a_simulation_can_do(
    tmp_path: Path, field: str, value: str, why: str
) -> None:
    """Settings a deployed gateway cannot honour stop it at start, named, rather than run as something else."""
    with pytest.raises(InputError) as e:
        make_server(tmp_path, ["http://127.0.0.1:9"], **{f"gateway__{field}": value})
    assert len(e.value.problems) == 1 and f"gateway.{field}: {why}" in e.value.problems[0]


@pytest.mark.parametrize(
    ("limiter", "burst"),
    [
        ({"kind": "token_bucket", "tiers": {"interactive": {"rate": 100, "burst": 200}}}, 20),
        ({"kind": "rate_limit", "tiers": {"interactive": {"rpm": 600, "tpm": 60_000}}}, 0),
    ],
    ids=["token_bucket", "rate_limit"],
)
def test_live_gateway_processes_together_let_through_the_simulated_limit(
    tmp_path: Path, limiter: dict, burst: int
) -> None:
    """Three processes for `gateway.replicas: 3`, a balancer sending them a third of the requests each: over
    a minute they let through what the simulated central limiter does (its rate: 10 requests/s of 10 prompt
    tokens, 600 a minute), not three times it; each bucket keeps the whole burst (`burst` requests)."""
    processes = [
        make_server(tmp_path, ["http://127.0.0.1:9"], gateway__replicas=3, policies=[limiter])
        for _ in range(3)
    ]
    central = make_server(tmp_path, ["http://127.0.0.1:9"], policies=[limiter])
    assert processes[0].settings.limit_share == 3 and central.settings.limit_share == 1
    requests = [Request(i, "interactive", 10, 90, i * 0.01, None) for i in range(5_999)]  # 100 a second
    shared = sum(central.settings.policy.decide(r, 0.1, PoolView(), r.arrival_s).admit for r in requests)
    split = sum(
        processes[r.id % 3].settings.policy.decide(r, 0.1, PoolView(), r.arrival_s).admit for r in requests
    )
    assert 590 <= shared <= 600 + burst
    assert 590 <= split <= 600 + 3 * burst
