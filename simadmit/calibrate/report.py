"""What `simadmit calibrate` prints at the end: coefficients, fit quality per phase, the simple figures, faults."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from simadmit.calibrate.run import Calibration


def print_calibration(result: Calibration, console: Console) -> None:
    p, fit = result.profile, result.fit
    coefficients = Table(title="step-time model (least squares, relative error)")
    coefficients.add_column("coefficient")
    coefficients.add_column("value", justify="right")
    for name, value, unit in (
        ("overhead_s", p.step_time.overhead_s * 1e3, "ms / step"),
        ("per_prefill_token_s", p.step_time.per_prefill_token_s * 1e6, "us / prompt token"),
        ("per_decode_seq_s", p.step_time.per_decode_seq_s * 1e3, "ms / decoding sequence"),
        ("per_context_token_s", p.step_time.per_context_token_s * 1e6, "us / context token"),
        (
            "per_prefill_attention_s",
            p.step_time.per_prefill_attention_s * 1e9,
            "ns / (prompt token, context token)",
        ),
        ("weights_read_s (least linear-layer time)", p.step_time.weights_read_s * 1e3, "ms / step"),
        ("api_latency_s (outside the engine: the fit's TTFT offset)", p.api_latency_s * 1e3, "ms / request"),
    ):
        coefficients.add_row(name, f"{value:.4g} {unit}")
    console.print(coefficients)

    discarded = p.fit.get("discarded_as_burst_delivery", 0)
    quality = Table(
        title=f"fit: {fit.n} points ({discarded} set aside), R^2 {fit.r2:.4f}; residual = predicted/measured - 1"
    )
    for col in ("phase", "points", "R^2", "median", "median |.|", "max |.|"):
        quality.add_column(col, justify="right")
    for name, ph in fit.phases.items():
        r2 = "-" if ph.r2 is None else f"{ph.r2:.3f}"
        quality.add_row(
            name,
            str(ph.n),
            r2,
            f"{ph.median_residual:+.1%}",
            f"{ph.median_abs_residual:.1%}",
            f"{ph.max_abs_residual:.1%}",
        )
    console.print(quality)
    if fit.held_out:
        errors = Table(title="held out of the fit (every fifth request of each cell): predicted/measured - 1")
        for col in ("phase", "prompt tokens", "points", "median", "median |.|", "max |.|"):
            errors.add_column(col, justify="right")
        for (phase, band), q in fit.held_out.items():
            errors.add_row(
                phase,
                band,
                str(q.n),
                f"{q.median_residual:+.1%}",
                f"{q.median_abs_residual:.1%}",
                f"{q.max_abs_residual:.1%}",
            )
        console.print(errors)

    measured = p.fit.get("measured", {})
    assert isinstance(measured, dict)
    console.print(
        f"measured per GPU: prefill {measured.get('prefill_tokens_per_gpu_s')} tok/s; decode "
        f"{measured.get('saturation_decode_tokens_per_gpu_s')} tok/s at concurrency {measured.get('saturation_concurrency')}; "
        f"decode by concurrency {measured.get('decode_tokens_per_gpu_s_by_concurrency')}"
    )
    console.print(
        f"profile per GPU (step model): prefill {p.prefill_tokens_per_gpu_s:g} tok/s (a budget-filling prompt "
        f"alone, attention included), decode {p.decode_tokens_per_gpu_s:g} tok/s at full batch; "
        f"KV capacity {p.kv_capacity_tokens} tokens"
    )
    drift = p.fit.get("drift_between_rounds", {})
    assert isinstance(drift, dict)
    if drift:
        moved = ", ".join(
            f"{phase} {d['median']:+.1%} (max |.| {d['max_abs']:.1%})" for phase, d in drift.items()
        )
        console.print(
            f"the machine between rounds (each cell's last round / first - 1, median over cells): {moved}"
        )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(result.faults.items())) or "none"
    console.print(f"faults retried: {faults}; requests given up: {result.gave_up}")
    o = result.client_overhead
    console.print(
        f"client overhead: {o['cpu_share_of_one_core']:.1%} of one core, {o['handling_ms_per_request']:.2f} ms "
        f"per request, event-loop lag p50 {o['loop_lag_p50_ms']:.2f} ms / p99 {o['loop_lag_p99_ms']:.2f} ms"
    )
    held = p.fit.get("concurrency_held", {})
    assert isinstance(held, dict)
    console.print("requests in flight, time-weighted: " + ", ".join(f"{k}: {v:g}" for k, v in held.items()))
    for w in p.warnings:
        console.print(f"[bold yellow]WARNING: {w}[/]")
    console.print(f"wrote {result.measurements} and the profile")
