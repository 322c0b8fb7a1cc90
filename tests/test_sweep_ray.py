"""The Ray backend gives the same rows as the process backend for the same seeds (on a local Ray)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from simadmit.study.backends import run_sweep
from simadmit.study.grid import parse_param, plan_sweep
from tests.test_sweep import short_scenario

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'simadmit[ray]'")


def test_ray_rows_equal_process_rows(tmp_path: Path) -> None:
    from simadmit.study.ray_backend import ray_backend

    scenario = short_scenario(tmp_path, duration_s=12)
    params = [
        parse_param("workload.rate_multiplier=0.2,1.0"),
        parse_param("policies.queue_depth.max_queued=8,64"),
    ]
    plan = plan_sweep(scenario, params, replications=2, seed=3)
    processes = run_sweep(plan, tmp_path / "processes", jobs=2)
    try:
        on_ray = run_sweep(plan, tmp_path / "ray", jobs=2, backend=ray_backend())
    finally:
        ray.shutdown()
    assert len(on_ray) == len(processes) > 0
    pd.testing.assert_frame_equal(on_ray, processes)
