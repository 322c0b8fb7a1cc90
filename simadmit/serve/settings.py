"""What one live gateway runs: the scenario's world, one of its policies, and each pool's backends.

Built from the same validated scenario `simulate` reads (`build_world`, `build_policy`), so the settings
`optimize` finds are deployed as they are. The policy is the one named, else the scenario's only policy,
else its first `gpu_seconds` policy. Backends are given as URLs, or `POOL=URL` when the scenario has
several pools; every pool needs one. `dns+http://NAME:PORT` stands for every address NAME resolves to (a
headless Service), re-resolved as pods come and go. A rate limiter (a `central` policy, one counter for
every gateway replica in the simulation) cannot share its counter between processes: each of the
scenario's `gateway.replicas` processes gets that share of its limits, so together they let through what
the simulated one does when the balancer spreads requests evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simadmit.admission.policies import AdmissionPolicy
from simadmit.admission.predictive import StatefulPolicy
from simadmit.calibrate.client import normalize_base_url
from simadmit.config.errors import InputError, problem
from simadmit.config.loading import Origin
from simadmit.config.schema import (
    GatewayHttpSpec,
    GpuSecondsSpec,
    ScenarioSpec,
    policy_name,
)
from simadmit.serve.counting import LocalTokenizer
from simadmit.serve.discovery import DNS_PREFIX
from simadmit.sim.world import World, build_policies, build_world

DEFAULT_MAX_TOKENS = 512  # a request without max_tokens, of a tier that names none in the scenario


@dataclass(frozen=True)
class ServeSettings:
    world: World
    policy_name: str
    policy: AdmissionPolicy
    backends: tuple[tuple[str, ...], ...]  # per pool
    http: GatewayHttpSpec
    tier_max_tokens: dict[str, int]  # what a request that names no max_tokens is charged and capped at
    default_tier: str
    tokenizer: LocalTokenizer | None = None  # None: count with a backend's /tokenize
    limit_share: int = 1  # the rate limits are this many processes' (1/limit_share of them applies here)


def pick_policy(spec: ScenarioSpec, name: str | None) -> str:
    names = [policy_name(p) for p in spec.policies]
    if name is not None:
        if name not in names:
            raise InputError(
                [f"--policy: no policy named {name!r} in the scenario (it has {', '.join(names)})"]
            )
        return name
    if len(names) == 1:
        return names[0]
    for p in spec.policies:
        if isinstance(p, GpuSecondsSpec):
            return policy_name(p)
    raise InputError([f"--policy: the scenario has several policies, name one of {', '.join(names)}"])


def assign_backends(spec: ScenarioSpec, backends: list[str]) -> tuple[tuple[str, ...], ...]:
    """Each pool's backend URLs from `URL` (a single pool) or `POOL=URL` arguments, each as its server's
    root: `http://host:8000/v1/`, the base URL OpenAI clients are given, is `http://host:8000` (taken as
    given, the gateway would poll `/v1/metrics`, forward to `/v1/v1/completions` and refuse every request)."""
    pools = [p.name for p in spec.pools]
    found: dict[str, list[str]] = {name: [] for name in pools}
    named = set()  # pools some argument names, even a bad one: that argument's problem is the one to tell
    problems = []
    for arg in backends:
        name, sep, url = arg.partition("=")
        if not sep:
            name, url = pools[0], arg
            if len(pools) > 1:
                problems.append(f"--backend {arg}: the scenario has several pools, write POOL=URL")
                continue
        named.add(name)
        if name not in found:
            problems.append(f"--backend {arg}: no pool named {name!r} (pools: {', '.join(pools)})")
        elif not url.startswith(("http://", "https://", "dns+http://", "dns+https://")):
            problems.append(f"--backend {arg}: the URL must start with http://, https:// or dns+http://")
        else:
            dns = DNS_PREFIX if url.startswith(DNS_PREFIX) else ""
            try:  # a host, a port in range; kept as the server's root (the gateway adds /v1/..., /metrics)
                url = dns + normalize_base_url(url.removeprefix(dns), "--backend")
            except InputError as e:
                problems += e.problems
                continue
            if any(url in urls for urls in found.values()):  # one server counted as two replicas
                problems.append(f"--backend {arg}: that backend is already given")
                continue
            found[name].append(url)
    problems += [f"--backend: pool {n!r} has no backend" for n in pools if n not in named]
    if problems:
        raise InputError(problems)
    return tuple(tuple(found[n]) for n in pools)


def serve_settings(
    spec: ScenarioSpec, base: Path, backends: list[str], policy: str | None, origin: Origin | None = None
) -> ServeSettings:
    """What the gateway runs, from the scenario and the command line; a problem names where its field was
    written, `origin(field)`: the scenario file, or `--set`."""
    where = origin or (lambda field: None)
    g = spec.gateway
    simulated_only = [
        (g.estimate_output == "oracle", "gateway.estimate_output",
         "oracle charges each request its true output, which a live gateway cannot know beforehand"),
        (g.dispatch == "central", "gateway.dispatch",
         "central (holding admitted requests in the gateway until a batch slot frees) is simulated only: "
         "the live gateway sends each admitted request to a backend at once (immediate)"),
        (g.view == "exact", "gateway.view",
         "exact (every engine's current state) is a study's bound: a live gateway sees the backends' "
         "published metrics and its own books (metrics)"),
    ]  # fmt: skip
    problems = [problem(where(field), field, why) for wrong, field, why in simulated_only if wrong]
    if problems:
        raise InputError(problems)
    world = build_world(spec, base)
    chosen = pick_policy(spec, policy)
    http = spec.gateway.http
    rule = build_policies(spec)[chosen]  # budgets default to the tiers' SLOs, as in simulate
    share = spec.gateway.replicas if isinstance(rule, StatefulPolicy) and rule.central else 1
    return ServeSettings(
        world=world,
        policy_name=chosen,
        policy=rule.split(share) if isinstance(rule, StatefulPolicy) else rule,
        backends=assign_backends(spec, backends),
        http=http,
        tier_max_tokens={t.name: t.max_tokens or DEFAULT_MAX_TOKENS for t in spec.workload.tiers},
        default_tier=http.default_tier or spec.workload.tiers[0].name,
        tokenizer=LocalTokenizer(base / http.tokenizer, where("gateway.http.tokenizer"))
        if http.tokenizer
        else None,
        limit_share=share,
    )
