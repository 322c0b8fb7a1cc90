"""The API server's latency (`api_latency_s`): what a request spends outside the engine. Calibration measures
it (the fit's TTFT offset), every TTFT and end-to-end latency a client sees carries it once, and it takes no
engine time: admission, batching and the engine's own times are those of a server without it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from simadmit.admission.view import EngineModel, ReplicaLoad
from simadmit.calibrate.api_latency import measure_api_latency
from simadmit.calibrate.client import Endpoint, discover
from simadmit.calibrate.fit import fit_step_model
from simadmit.calibrate.metrics import CacheConfig
from simadmit.calibrate.run import CalibrationConfig, build_profile
from simadmit.config.errors import InputError
from simadmit.config.loading import scenario_from_dict
from simadmit.config.profile import load_profile, save_profile, solo_service_s
from simadmit.fleet.engine_replay import replay_on_profile
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario
from tests.fake_vllm import FakeVllm
from tests.helpers import PROFILE, ROOT
from tests.test_calibrate_fit import TRUE, synthetic
from tests.test_invariants import _small_doc

LATENCY = 0.05


def _with_latency(tmp_path: Path, latency: float) -> Path:
    doc = yaml.safe_load(Path(PROFILE).read_text())
    doc["api_latency_s"] = latency
    path = tmp_path / f"profile-{latency}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_profile_without_it_has_none_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    assert load_profile(PROFILE).api_latency_s == 0.0  # profiles written before it load unchanged
    with pytest.raises(InputError) as e:
        load_profile(_with_latency(tmp_path, -0.01))
    assert "api_latency_s" in str(e.value)
    saved = tmp_path / "again.yaml"
    save_profile(load_profile(_with_latency(tmp_path, LATENCY)), saved)
    assert load_profile(saved).api_latency_s == LATENCY


def test_every_client_visible_latency_carries_it_once_and_nothing_else_moves(tmp_path: Path) -> None:
    """The same scenario and seed on a profile with and without the latency: the same decisions, the same
    engine schedule, and each completed request's TTFT and E2E longer by exactly the latency."""
    runs = []
    for latency in (0.0, LATENCY):
        doc = _small_doc()
        doc["pools"][0]["profile"] = str(_with_latency(tmp_path, latency))
        spec = scenario_from_dict(doc, ROOT / "tests" / "small.yaml")
        runs.append(run_scenario(spec, build_world(spec, ROOT), keep_tables=True).requests)
    base, late = runs
    for col in ("decision", "reason", "attempt_s", "admit_s", "scheduled_s", "outcome", "replica"):
        assert base[col].equals(late[col]), col
    done = (base["outcome"] == "completed") & (base["decision"] == "admit")
    assert done.sum() > 100
    for col in ("ttft_s", "e2e_s", "first_token_s", "finish_s"):
        shift = (late[col] - base[col])[done].to_numpy()
        assert np.allclose(shift, LATENCY, rtol=0, atol=1e-9), col


def test_a_lone_request_takes_its_solo_service_plus_the_latency(tmp_path: Path) -> None:
    profile = load_profile(_with_latency(tmp_path, LATENCY))
    budget = profile.engine.max_num_batched_tokens
    got = replay_on_profile(profile, np.array([0.0]), np.array([1000]), np.array([20]))
    assert got["ttft_s"][0] == pytest.approx(solo_service_s(profile.step_time, budget, 1000) + LATENCY)
    assert got["e2e_s"][0] == pytest.approx(solo_service_s(profile.step_time, budget, 1000, 20) + LATENCY)


def test_a_client_that_gives_up_before_the_first_token_reaches_it_has_abandoned(tmp_path: Path) -> None:
    """A lone request whose client gives up after the engine produced its first token but before the API
    server delivered it (half the latency later) ends without an answer or a TTFT; a client a little more
    patient (the latency and a half later) gets both."""
    profile = load_profile(_with_latency(tmp_path, LATENCY))
    engine_ttft = solo_service_s(profile.step_time, profile.engine.max_num_batched_tokens, 1000)
    outcomes = []
    for patience in (engine_ttft + LATENCY / 2, engine_ttft + 1.5 * LATENCY):
        doc = _small_doc()
        doc["pools"][0]["profile"] = str(_with_latency(tmp_path, LATENCY))
        doc["workload"] |= {"duration_s": None, "requests": 1}
        doc["workload"]["tiers"] = [{"name": "interactive", "share": 1, "max_tokens": 20,
                                     "prompt_tokens": {"kind": "fixed", "value": 1000},
                                     "output_tokens": {"kind": "fixed", "value": 20}}]  # fmt: skip
        doc["clients"]["abandon_after_s"] = patience
        doc["policies"] = [{"kind": "unconditional"}]
        spec = scenario_from_dict(doc, ROOT / "tests" / "small.yaml")
        req = run_scenario(spec, build_world(spec, ROOT), keep_tables=True).requests
        outcomes.append((req["outcome"].iloc[0], float(req["ttft_s"].iloc[0])))
    (gave_up, no_ttft), (served, ttft) = outcomes
    assert gave_up != "completed" and np.isnan(no_ttft)
    assert served == "completed" and ttft == pytest.approx(engine_ttft + LATENCY)


@pytest.mark.parametrize("offset", [TRUE[6], -0.004])
def test_calibration_writes_the_fitted_offset_never_below_zero(tmp_path: Path, offset: float) -> None:
    """The fit's TTFT offset (free in sign, so it does not leak into the step costs) becomes the profile's
    latency; a negative one, which no server has, becomes zero."""
    true = TRUE.copy()
    true[6] = offset
    fit = fit_step_model(synthetic(np.random.default_rng(1), noise=0.0, true=true))
    assert fit.ttft_offset_s == pytest.approx(offset, abs=1e-6)
    cfg = CalibrationConfig(endpoint="http://x:8000", out=tmp_path / "p.yaml", max_num_batched_tokens=2048)
    profile = build_profile(
        cfg, Endpoint("http://x:8000", "m", 2048, "0.32.0"), CacheConfig(128, 728, 1), fit, [], {}
    )
    assert profile.api_latency_s == pytest.approx(max(0.0, offset), abs=1e-6)


@pytest.mark.parametrize("running", [0, 6])
def test_a_gateway_predicts_the_ttft_its_clients_will_see(tmp_path: Path, running: int) -> None:
    """The engine model of a predictive gateway adds the latency once to its predicted TTFT, idle or busy,
    so its learned correction does not have to stand in for it."""
    load = ReplicaLoad(running=running, prefill_tokens=300, max_seqs=8, kv_used=4000, kv_capacity=10**6)
    without, with_it = (
        EngineModel.of(load_profile(_with_latency(tmp_path, x)), 2048, None).ttft(load, 500, 100.0)
        for x in (0.0, LATENCY)
    )
    assert with_it - without == pytest.approx(LATENCY, abs=1e-12)


def _measured(**fake: float | None) -> float | None:
    async def run(url: str) -> float | None:
        async with httpx.AsyncClient(timeout=30) as client:
            return await measure_api_latency(client, await discover(client, url, None), requests=6)

    with FakeVllm(**fake) as server:  # type: ignore[arg-type]
        return asyncio.run(run(server.url))


def test_calibration_reads_the_latency_outside_the_engine_off_the_servers_clocks() -> None:
    """Against a server whose engine clocks say 30 ms of a lone request's TTFT and whose first token comes
    20 ms later still, the latency measured is those 20 ms and what loopback HTTP adds (never less); a
    server without the engine's histograms gets no measurement (the fit's offset stands in)."""
    measured = _measured(prefill_s=0.03, outside_s=0.02)
    assert measured is not None and 0.02 <= measured <= 0.02 + 0.03, measured
    assert _measured(prefill_s=None, outside_s=0.02) is None


def test_a_measured_offset_is_taken_as_it_is_and_the_steps_fitted_around_it() -> None:
    """Given the true TTFT offset, the fit keeps it and recovers the step coefficients exactly from
    noiseless data; given another, it keeps that one (the steps then absorb the difference)."""
    obs = synthetic(np.random.default_rng(2), noise=0.0)
    exact = fit_step_model(obs, ttft_offset_s=float(TRUE[6]))
    assert exact.ttft_offset_s == TRUE[6]
    assert np.allclose(exact.coefficients()[:5], TRUE[:5], rtol=1e-6, atol=1e-12)
    assert fit_step_model(obs, ttft_offset_s=0.05).ttft_offset_s == 0.05
