"""The machine's speed in the fidelity runs. The slowed simulation `benchmarks/fidelity_speed.py` runs
(`benchmarks.fidelity.simulate_replayed`) to ask whether a fidelity miss is the machine's speed: its engines
must take exactly the profile's step costs times the factor, while the simulated gateways keep predicting
with the profile the live ones believed. Calibrations before and after a run, fitted together, must split
a drift between them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from benchmarks.fidelity import (
    DECODE_PROBE,
    PROBE,
    Probe,
    Slowdown,
    fit_together,
    phase_slowdown,
    read_slowdown,
    scaled_step,
    simulate_replayed,
    slowed,
    speed_probe,
    write_probe,
)
from benchmarks.gateway_fidelity import scenario
from simadmit.calibrate.measurements import MeasurementLog, read_measurements
from simadmit.config.profile import Profile, load_profile, save_profile, solo_service_s
from tests.fake_vllm import FakeVllm
from tests.helpers import ROOT

PROFILE = ROOT / "calibration" / "smollm2-135m-cpu.yaml"


def test_slowed_engines_take_the_factor_and_the_gateways_keep_their_beliefs(tmp_path: Path) -> None:
    """A request every 20 s on average under predicted_ttft, nothing refused: at twice the step costs the
    engine time (latency less the API server's) of every request that had the replica to itself doubles, to
    rounding, and no request's grows by less (sharing a batch only slows it); the first token the gateway
    predicted for a request arriving at the idle replica is the same as at the profile's speed."""
    point = tmp_path / "point"
    replayed = point / "real" / "repeat-1" / "replayed.yaml"
    replayed.parent.mkdir(parents=True)
    replayed.write_text(yaml.safe_dump(scenario(PROFILE, 0.05, 200.0, "predicted_ttft", 1)))
    runs = {}
    for scale in (1.0, 2.0):
        simulate_replayed(point, tmp_path / f"x{scale:g}", slower=scale)
        runs[scale] = pd.read_parquet(tmp_path / f"x{scale:g}" / "requests.parquet").set_index("request_id")
    base, slow = runs[1.0], runs[2.0]
    assert len(base) >= 5 and (base["decision"] == "admit").all() and (slow["decision"] == "admit").all()
    api = load_profile(PROFILE).api_latency_s
    engine_time = ((slow["e2e_s"] - api) / (base["e2e_s"] - api)).to_numpy()
    start = slow["arrival_s"].to_numpy()
    end = start + slow["e2e_s"].to_numpy()
    overlapping = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
    alone = overlapping.sum(axis=1) == 1  # overlaps only itself
    assert alone.sum() >= 5
    assert np.allclose(engine_time[alone], 2.0, rtol=1e-6), engine_time
    assert (engine_time >= 2.0 - 1e-6).all(), engine_time
    predicted = base["predicted_wait_s"].to_numpy(), slow["predicted_wait_s"].to_numpy()
    assert np.allclose(predicted[0][alone], predicted[1][alone], rtol=1e-9), predicted


def test_engines_run_on_another_profile_while_the_gateways_keep_the_first(tmp_path: Path) -> None:
    """`engines` (what the gateway benchmark simulates its engines on with `--calibrate-after`: calibrations
    before and after the replays, fitted together) changes the engines only: a profile file with every step
    cost doubled gives the very run that `slower=2` gives, the gateways' predictions included, and not the
    run at the first."""
    point = tmp_path / "point"
    replayed = point / "real" / "repeat-1" / "replayed.yaml"
    replayed.parent.mkdir(parents=True)
    replayed.write_text(yaml.safe_dump(scenario(PROFILE, 0.05, 200.0, "predicted_ttft", 1)))
    doubled = tmp_path / "doubled.yaml"
    save_profile(slowed(load_profile(PROFILE), 2.0), doubled)
    runs = {}
    for name, kwargs in (("first", {}), ("engines", {"engines": doubled}), ("slower", {"slower": 2.0})):
        simulate_replayed(point, tmp_path / name, **kwargs)  # type: ignore[arg-type]
        runs[name] = pd.read_parquet(tmp_path / name / "requests.parquet")
    assert len(runs["first"]) >= 5
    pd.testing.assert_frame_equal(runs["engines"], runs["slower"])
    assert (runs["engines"]["e2e_s"] > runs["first"]["e2e_s"]).all()


def test_calibrations_fitted_together_fall_between_each_alone(tmp_path: Path) -> None:
    """`fit_together`, which the fidelity runs simulate on (a calibration before the replays and one after):
    fitted with a copy of itself measured an hour later on a machine 20% slower throughout, a calibration
    predicts a lone request and a full decode step between what each predicts alone, well inside (the
    drift splits between them rather than one side taking the fit)."""
    measured = ROOT / "calibration" / "smollm2-135m-cpu.measurements.csv"
    slower = tmp_path / "slower.csv"
    scaled = ("ttft_s", "itl_mean_s", "itl_p50_s", "itl_p90_s", "itl_max_s", "e2e_s")
    rows = read_measurements(measured)
    t0 = rows[0].start_unix_s
    with MeasurementLog(slower) as log:  # the whole timeline stretched: each request starts later too
        for r in rows:
            later = replace(r, start_unix_s=t0 + 3600 + 1.2 * (r.start_unix_s - t0))
            log.append(replace(later, **{f: 1.2 * getattr(r, f) for f in scaled}))
    fits = {
        name: load_profile(fit_together(PROFILE, files, tmp_path / f"{name}.yaml", ""))
        for name, files in (("alone", [measured]), ("slower", [slower]), ("together", [measured, slower]))
    }

    def predictions(p: Profile) -> np.ndarray:
        budget = p.engine.max_num_batched_tokens
        return np.array(
            [solo_service_s(p.step_time, budget, 512, 16), p.step_time.step_time(0, 16, 16 * 160)]
        )

    alone, slow, together = (predictions(fits[k]) for k in ("alone", "slower", "together"))
    assert (slow > 1.1 * alone).all(), (alone, slow)
    share = (together - alone) / (slow - alone)
    assert ((share > 0.2) & (share < 0.8)).all(), (alone, slow, together)


def test_rescaling_draws_the_clients_jitter_as_often_as_the_benchmark_did(tmp_path: Path) -> None:
    """A gateway point simulated over several draws of the clients' jitter is re-simulated over as many
    (its `sim` folder's seeds); an engine point, or one never simulated, over one."""
    from benchmarks.fidelity_speed import draws

    point = tmp_path / "point"
    assert draws(point) == 1
    (point / "sim").mkdir(parents=True)
    pd.DataFrame({"seed": [11, 11, 12, 13, 13], "request_id": range(5)}).to_parquet(
        point / "sim" / "requests.parquet"
    )
    assert draws(point) == 3


def _measured_under(profile: Profile, by: Slowdown) -> tuple[float, float]:
    """What the speed probe would read from a server taking `profile`'s costs times `by`: a lone PROBE
    prompt's prefill and a DECODE_PROBE batch's step."""
    n, prompt, output = DECODE_PROBE
    step = scaled_step(profile.step_time, by)
    prefill = solo_service_s(step, profile.engine.max_num_batched_tokens, PROBE[0])
    return prefill, step.step_time(0, n, n * (prompt + output / 2))


def test_the_probe_splits_a_known_slowdown_into_its_phases_exactly() -> None:
    """A server that prefills and decodes at other speeds than calibrated (they drift apart on this CPU): from
    a lone prompt's prefill and a decode batch's step, `phase_slowdown` recovers each factor to rounding, and
    the profile slowed by them takes exactly the measured times, a uniform slowdown reading as itself."""
    profile = load_profile(PROFILE)
    for truth in (Slowdown(0.95, 1.07), Slowdown(1.3, 0.8), Slowdown(1.12, 1.12)):
        prefill, decode = _measured_under(profile, truth)
        found = phase_slowdown(profile, prefill, decode)
        assert found.prefill == pytest.approx(truth.prefill, rel=1e-9)
        assert found.decode == pytest.approx(truth.decode, rel=1e-9)
        assert _measured_under(slowed(profile, found), Slowdown()) == pytest.approx(
            (prefill, decode), rel=1e-9
        )
    assert slowed(profile, 1.12) == slowed(profile, Slowdown(1.12, 1.12))


def test_the_probe_reads_the_phases_of_a_live_server(tmp_path: Path) -> None:
    """`speed_probe` against a fake server whose first token comes after the prefill the profile predicts
    at 1.25 x its prompt costs (on decode costs 1.6 x) and whose tokens stream at 1.6 x the profile's
    batch step: it reads both factors within 5% (what loopback HTTP and the fake's sleeps add: a few ms
    on steps of tens of ms), and a lone request's speed above 1; `read_slowdown` gives them back from the
    repeat's file, and an older file's single speed times the reference for both phases."""
    profile = load_profile(PROFILE)
    truth = Slowdown(1.25, 1.6)
    prefill, decode = _measured_under(profile, truth)
    with FakeVllm(token_s=decode, prefill_s=prefill + profile.api_latency_s) as server:
        probe = speed_probe(server.url, PROFILE, tmp_path, times=1)
    assert probe.slowdown.prefill == pytest.approx(truth.prefill, rel=0.05), probe
    assert probe.slowdown.decode == pytest.approx(truth.decode, rel=0.05), probe
    assert probe.speed > 1.1, probe
    write_probe(tmp_path / "repeat-1", probe, Probe(2 * probe.speed, Slowdown()))
    assert read_slowdown(tmp_path / "repeat-1") == probe.slowdown
    (tmp_path / "repeat-2").mkdir()
    (tmp_path / "repeat-2" / "speed_probe.json").write_text('{"speed": 1.1}\n')
    assert read_slowdown(tmp_path / "repeat-2", reference=1.2) == pytest.approx(Slowdown(1.32, 1.32))
