"""Where a lone request's TTFT goes: the engine (queue wait and prefill step), or the way in and out.

`simadmit calibrate` measures the latency outside the engine (`api_latency_s`) from vLLM's own clocks
(`simadmit.calibrate.api_latency`) on short prompts; this prints the same split at each prompt length, with
the profile's price of the step beside it, so one sees whether the remainder is a constant latency (it
should not grow with the prompt) and how well the step model prices each prefill. Medians per length.

    flock /tmp/vllm.lock python benchmarks/api_latency.py --profile runs/fidelity/profile.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import isolate_engine, start_server  # noqa: E402
from simadmit.calibrate.api_latency import ttft_split  # noqa: E402
from simadmit.calibrate.client import discover, tokenize  # noqa: E402
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker  # noqa: E402
from simadmit.config.profile import load_profile, solo_service_s  # noqa: E402


async def measure(url: str, prompts: list[int], repeats: int, profile_path: Path | None) -> None:
    profile = load_profile(profile_path) if profile_path else None
    async with httpx.AsyncClient(timeout=120) as client:
        endpoint = await discover(client, url, None)
        maker = PromptMaker(await tokenize(client, endpoint, SAMPLE_TEXT), random.Random(5))
        for _ in range(2):  # warm-up
            await ttft_split(client, endpoint, maker.make(64))
        print("prompt  client TTFT  engine (queue + prefill)  profile's step  outside the engine")
        for p in prompts:
            splits = [s for _ in range(repeats) if (s := await ttft_split(client, endpoint, maker.make(p)))]
            if not splits:
                print(f"{p:6d}  no clean measurement (no engine histograms, or other traffic)")
                continue
            ttft = statistics.median(t for t, _ in splits)
            engine = statistics.median(e for _, e in splits)
            outside = statistics.median(t - e for t, e in splits)
            budget = profile.engine.max_num_batched_tokens if profile else 0
            model = solo_service_s(profile.step_time, budget, p) if profile else float("nan")
            print(f"{p:6d}  {1e3 * ttft:9.1f} ms  {1e3 * engine:20.1f} ms  {1e3 * model:11.1f} ms  "
                  f"{1e3 * outside:14.1f} ms   ({len(splits)} requests)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", help="use this running server instead of starting one")
    ap.add_argument("--profile", type=Path, help="price each prompt's step with this profile")
    ap.add_argument("--prompts", default="16,64,128,256,512,1024,2000")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    if args.endpoint:
        asyncio.run(measure(args.endpoint, prompts, args.repeats, args.profile))
        return
    with tempfile.TemporaryDirectory() as work, start_server(Path(work)) as url:
        print(isolate_engine())
        asyncio.run(measure(url, prompts, args.repeats, args.profile))


if __name__ == "__main__":
    main()
