"""Builders of small scenarios for the tests."""

from __future__ import annotations

from pathlib import Path

from simadmit.config.loading import scenario_from_dict
from simadmit.config.schema import ScenarioSpec
from simadmit.sim.world import build_world
from simadmit.study.runner import ScenarioResult, run_scenario

ROOT = Path(__file__).resolve().parent.parent
PROFILE = str(ROOT / "calibration" / "llama-3.1-8b-h100.yaml")


def classical_scenario(
    rate: float,
    service: dict,
    servers: int,
    requests: int,
    policy: dict | None = None,
    dispatch: str = "central",
    warmup_s: float = 0.0,
    seed: int = 0,
    arrival: dict | None = None,
    deadline_s: float | None = None,
    abandon_after_s: float | None = None,
    gateways: int = 1,
    clients: dict | None = None,
    routing: str = "least_loaded",
) -> ScenarioSpec:
    """A textbook queue: Poisson arrivals (or `arrival`), `servers` batch-of-1 servers, live view, no
    retries; clients wait for their answer `abandon_after_s` at most (default: for ever). `clients` sets
    other client settings (retries, backoff); `routing` how immediate dispatch picks a server."""
    return scenario_from_dict(
        {
            "name": "queue",
            "workload": {
                "seed": seed,
                "rate_rps": rate,
                "requests": requests,
                "warmup_s": warmup_s,
                "arrival": arrival or {"kind": "poisson"},
                "tiers": [
                    {
                        "name": "only",
                        "share": 1,
                        "prompt_tokens": {"kind": "fixed", "value": 10},
                        "output_tokens": {"kind": "fixed", "value": 1},
                        "max_tokens": 1,
                        "deadline_s": deadline_s,
                    }
                ],
            },
            "pools": [
                {
                    "profile": PROFILE,
                    "replicas": servers,
                    "engine": {"kind": "classical", "service_time": service},
                }
            ],
            "gateway": {
                "replicas": gateways,
                "poll_interval_s": 0,
                "dispatch": dispatch,
                "routing": routing,
            },
            "clients": {"max_retries": 0, "abandon_after_s": abandon_after_s, **(clients or {})},
            "policies": [policy or {"kind": "unconditional"}],
        },
        ROOT / "tests" / "scenario.yaml",
    )


def run(
    spec: ScenarioSpec, seed: int | None = None, replications: int = 1, tables: bool = False
) -> ScenarioResult:
    return run_scenario(spec, build_world(spec, ROOT), seed, replications, keep_tables=tables)
