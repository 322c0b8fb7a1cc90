"""Prompt lengths of a user's own traffic, so the prefill sweep also measures where their requests are.

`simadmit calibrate --workload scenario.yaml` draws the scenario's requests (its seed, its tiers, or its trace;
those of every variant when it has variants, as `simulate` runs each) and adds the quantiles of their prompt
lengths to the sweep's geometric lengths: the sweep cycles through all lengths equally, so most of its requests
then sit inside the user's mix, while the geometric ones keep the fit's shape anchored from 16 tokens to the
whole context. The plan stays a function of the options, so `--resume`
with the same `--workload` rebuilds it exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from simadmit.config.loading import load_scenario_with_origin, variant_spec
from simadmit.config.resources import resolve_scenario
from simadmit.config.schema import ScenarioSpec
from simadmit.workload.build import generate
from simadmit.workload.check import check_workload

QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9, 0.99)


def workload_prompt_lengths(path: str | Path, quantiles: tuple[float, ...] = QUANTILES) -> tuple[int, ...]:
    """Distinct quantiles of the prompt lengths of a scenario's requests, its variants' pooled (`InputError` for
    a bad scenario, checked as `simulate` checks it: one too big to draw, or drawing no request, among others)."""
    path = resolve_scenario(Path(path))  # a bundled scenario's name, as the other commands take it
    spec, _, origin = load_scenario_with_origin(path)
    workloads: dict[str, ScenarioSpec] = {}
    for s in [variant_spec(spec, v) for v in spec.variants] or [spec]:
        workloads.setdefault(s.workload.model_dump_json(), s)
    prompts = []
    for s in workloads.values():
        check_workload(s, origin)
        prompts.append(generate(s.workload).prompt)
    return tuple(sorted({max(1, int(round(q))) for q in np.quantile(np.concatenate(prompts), quantiles)}))
