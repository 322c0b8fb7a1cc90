"""Fit the step-time model to SplitwiseSim's measured A100/H100 timings and print the tables of
`calibration/README.md` (GPU evidence): coefficients per setup, and the error on the held-out largest prompt
and batch, of the fitted model and of the linear one without attention (the form profiles first had).

    python scripts/gpu_evidence.py [calibration/gpu_evidence/splitwise_perf_model.csv]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from simadmit.calibrate.gpu_evidence import Evidence, Setup, evidence, read_table

DEFAULT = Path(__file__).resolve().parent.parent / "calibration" / "gpu_evidence" / "splitwise_perf_model.csv"


def per_token_shape(table: pd.DataFrame) -> pd.DataFrame:
    """Prefill time per prompt token (us) of a lone prompt, by prompt length: the knee and the attention rise."""
    lone = table[(table.batch_size == 1) & (table.token_size == table.token_size.min())]
    ms = lone.groupby(["model", "hardware", "tensor_parallel", "prompt_size"]).prompt_time.median().unstack()
    return (ms / ms.columns.to_numpy() * 1e3).round(0).astype(int)


def both(e: Evidence, phase: str, prompt: int | None = None, batch: int | None = None) -> str:
    """Held-out median error of the fitted model / of the linear one without attention."""
    w = e.held_out_error(e.fit, phase, prompt, batch)
    lin = e.held_out_error(e.linear, phase, prompt, batch)
    return "excluded" if pd.isna(w) else f"{w:+.1%} / {lin:+.1%}"


def main(path: Path) -> None:
    table = read_table(path)
    print("| setup | overhead | weights' read | per prompt token | per decode seq | per context token |"
          " per attention pair | fit error prefill / decode (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    results = evidence(table)
    for e in results:
        s = e.fit.step
        print(
            f"| {e.setup.label} | {s.overhead_s * 1e3:.1f} ms | {s.weights_read_s * 1e3:.1f} ms "
            f"| {s.per_prefill_token_s * 1e6:.1f} us "
            f"| {s.per_decode_seq_s * 1e3:.3f} ms | {s.per_context_token_s * 1e9:.0f} ns "
            f"| {s.per_prefill_attention_s * 1e9:.1f} ns "
            f"| {e.fit.phases['prefill'].median_abs_residual:.1%} / {e.fit.phases['decode'].median_abs_residual:.1%} |"
        )
    print()
    print("| setup | prefill 8,192 tokens: with attention / linear | decode batch 64: with / linear"
          " | decode with 8,192-token prompts |")  # fmt: skip
    print("|---|---|---|---|")
    for e in results:
        print(
            f"| {e.setup.label} | {both(e, 'prefill', prompt=8192)} | {both(e, 'decode', batch=64)} "
            f"| {e.held_out_error(e.fit, 'decode', prompt=8192):+.1%} |"
        )
    print()
    print("Prefill time per prompt token (us) of a lone prompt:")
    shape = per_token_shape(table)
    print("| setup | " + " | ".join(str(c) for c in shape.columns) + " |")
    print("|---" * (len(shape.columns) + 1) + "|")
    for key, row in shape.iterrows():
        model, hardware, tp = (str(k) for k in key)  # type: ignore[union-attr]
        print(f"| {Setup(model, hardware, int(tp)).label} | " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
