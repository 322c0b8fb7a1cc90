"""The request list a replay sends: the scenario's workload, drawn exactly as `simulate` draws it.

`generate` gives the same arrival times, tiers and lengths for the same scenario and seed, so a replay and a
simulation of one scenario see one request list. Each request asks for exactly its target output
(`max_tokens` = the workload's output, with `ignore_eos`), so the real engine does the work the simulated one
does. Prompts are fresh random token ids per run: with prefix caching on, a repeated prompt would be
served from the cache and measure nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simadmit.admission.client import ClientConfig
from simadmit.admission.published import tier_priority
from simadmit.calibrate.prompts import PromptMaker
from simadmit.config.schema import ScenarioSpec
from simadmit.loadgen.sender import encode_body
from simadmit.sim.world import build_world
from simadmit.workload.build import Workload, generate


@dataclass(frozen=True)
class Plan:
    """What to send and how clients behave, with the names the tables carry."""

    workload: Workload
    seed: int
    tier_pool: tuple[str, ...]  # the pool serving each tier, by name
    tier_priority: tuple[int | None, ...]  # the priority each tier's requests carry (None: FCFS pools)
    clients: ClientConfig
    warmup_s: float

    @property
    def scheduled_s(self) -> np.ndarray:
        return self.workload.arrival

    @property
    def target_output(self) -> np.ndarray:
        return self.workload.output


def make_plan(spec: ScenarioSpec, base: Path, seed: int | None = None) -> Plan:
    """The scenario's requests for `seed` (default: the scenario's) and its client behaviour."""
    world = build_world(spec, base)
    seed = spec.workload.seed if seed is None else seed
    pools = tuple(world.pools[p].name for p in world.pool_of_tier)
    priorities = tuple(
        tier_priority(world.pools[p].priorities, tier)
        for tier, p in zip(world.tier_names, world.pool_of_tier, strict=True)
    )
    return Plan(generate(spec.workload, seed), seed, pools, priorities, world.clients, world.warmup_s)


def request_bodies(plan: Plan, model: str, token_pool: list[int] | None, rng: random.Random) -> list[bytes]:
    """Every request's encoded body, made before the run so that sending costs nothing but the write."""
    prompts = PromptMaker(token_pool, rng)
    w = plan.workload
    return [
        encode_body(model, prompts.make(p), o, plan.tier_priority[t])
        for p, o, t in zip(w.prompt.tolist(), plan.target_output.tolist(), w.tier.tolist(), strict=True)
    ]
