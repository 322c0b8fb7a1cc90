"""Where a lone request's TTFT goes: the engine's step, or the way in and out through vLLM's API server.

The fit's TTFT offset (a lone request's TTFT beyond the steps the step model charges for its prompt) becomes
the profile's `api_latency_s`, a latency that takes no engine time. That reading holds only if the offset is
spent outside the engine. vLLM's own histograms split a TTFT: the API server stamps the arrival and the
first token's processing (`vllm:time_to_first_token_seconds`), the engine core the request's entry, its
scheduling and the end of the step that made the first token (`vllm:request_queue_time_seconds`,
`vllm:request_prefill_time_seconds`). One request at a time, with the histograms read before and after each,
gives per request: the client's TTFT, the API server's, the engine queue and the prefill step; the profile
prices the step. Prints medians per prompt length.

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
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import isolate_engine, start_server  # noqa: E402
from simadmit.calibrate.client import discover, stream_completion, tokenize  # noqa: E402
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker  # noqa: E402
from simadmit.config.profile import load_profile, solo_service_s  # noqa: E402

HISTOGRAMS = {
    "server_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def sums(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram above, over every engine."""
    out = dict.fromkeys(HISTOGRAMS, (0.0, 0.0))
    names = {v: k for k, v in HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is None:
            continue
        s, n = out[key]
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                s += sample.value
            elif sample.name.endswith("_count"):
                n += sample.value
        out[key] = (s, n)
    return out


async def measure(url: str, prompts: list[int], repeats: int, profile_path: Path | None) -> None:
    profile = load_profile(profile_path) if profile_path else None
    async with httpx.AsyncClient(timeout=120) as client:
        endpoint = await discover(client, url, None)
        maker = PromptMaker(await tokenize(client, endpoint, SAMPLE_TEXT), random.Random(5))
        for _ in range(2):  # warm-up
            await stream_completion(client, endpoint, maker.make(64), 1, 120)
        header = "prompt  client TTFT  server TTFT  engine queue  prefill step  model step  HTTP  API server"
        print(header)
        for p in prompts:
            rows = []
            for _ in range(repeats):
                before = sums((await client.get(f"{url}/metrics")).text)
                a = await stream_completion(client, endpoint, maker.make(p), 1, 120)
                await asyncio.sleep(0.3)  # the finished request's stats reach the histograms
                after = sums((await client.get(f"{url}/metrics")).text)
                delta = {k: after[k][0] - before[k][0] for k in HISTOGRAMS}
                if any(after[k][1] - before[k][1] != 1 for k in HISTOGRAMS) or a.status != "ok":
                    continue  # not exactly this request in the histograms
                rows.append((a.ttft_s, delta["server_ttft"], delta["queue"], delta["prefill"]))
                await asyncio.sleep(0.2)
            if not rows:
                print(f"{p:6d}  no clean measurement")
                continue
            ttft, server, queue, prefill = (statistics.median(c) for c in zip(*rows, strict=True))
            model = (
                solo_service_s(profile.step_time, profile.engine.max_num_batched_tokens, p)
                if profile
                else float("nan")
            )
            print(f"{p:6d}  {1e3 * ttft:9.1f}ms  {1e3 * server:9.1f}ms  {1e3 * queue:10.1f}ms  "
                  f"{1e3 * prefill:10.1f}ms  {1e3 * model:8.1f}ms  {1e3 * (ttft - server):4.1f}  "
                  f"{1e3 * (server - queue - prefill):8.1f}   ({len(rows)} requests)")  # fmt: skip
        print(
            "HTTP = client TTFT - server TTFT; API server = server TTFT - engine queue - prefill step (ms, medians)"
        )


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
