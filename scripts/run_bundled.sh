#!/usr/bin/env bash
# Every bundled scenario, shortened so each takes seconds, at seed 1, into OUT/<scenario>/.
set -euo pipefail
OUT=${1:?usage: run_bundled.sh OUT}
mkdir -p "$OUT"
for s in default gateways_headroom mix_shift retry_storm shared_vs_separate support_copilot autoscaling_ramp; do
  simadmit simulate "$s" --seed 1 --out "$OUT/$s" --set workload.duration_s=40 --set workload.warmup_s=5 > "$OUT/$s.log"
done
for s in azure_replay mooncake_long_context; do  # trace replays: their own length
  simadmit simulate "$s" --seed 1 --out "$OUT/$s" --set workload.warmup_s=5 > "$OUT/$s.log"
done
