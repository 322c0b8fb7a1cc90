"""Does a step's cost depend on how its prompt tokens are split among requests, as the step model says?

The step model charges a prefill step per token plus per (token, context) pair: k prompts of T/k tokens
in one step cost the same linear part as one prompt of T tokens but only 1/k of its attention. This sends
k prompts of T/k tokens at once (random token ids, so no prefix-cache hits; one output token) to a real
vLLM server, for k = 1, 2, 4, 8, 16 and T = 2048 and 1024, `--repeats` times. The first request of a burst
reaches the engine alone and is prefilled alone; the other k - 1 share the next step (within the token
budget), so the table gives both: measured seconds / the profile's prediction. A ratio that stays flat
across k says the split between the per-token and the attention cost is right; a ratio that is the same
everywhere but not 1 says the machine runs at another speed than when the profile was measured.

    flock /tmp/vllm.lock python benchmarks/batched_prefill.py --profile runs/fidelity/profile.yaml

Starts the tests' SmolLM2 server unless `--endpoint` names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fidelity import isolate_engine, start_server  # noqa: E402

from simadmit.config.profile import load_profile, prefill_attention_pairs  # noqa: E402

SPLITS = (1, 2, 4, 8, 16)
TOTALS = (2048, 1024)


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: int, rng: random.Random) -> float:
    """Seconds until one completion of `prompt` random token ids and one output token returns."""
    ids = [rng.randrange(1000, 40000) for _ in range(prompt)]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "ignore_eos": True}
    started = time.perf_counter()
    answer = await client.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()
    return time.perf_counter() - started


async def measure(url: str, repeats: int) -> list[tuple[int, int, float, float]]:
    """(T, k, first request's seconds, the others' seconds after it) for every burst."""
    rng = random.Random(7)
    out = []
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        for _ in range(3):  # warm-up
            await complete(client, url, model, 64, rng)
        for _ in range(repeats):
            for total in TOTALS:
                for k in SPLITS:
                    await asyncio.sleep(0.3)
                    prompt = total // k - (k == 1)
                    times = sorted(
                        await asyncio.gather(*(complete(client, url, model, prompt, rng) for _ in range(k)))
                    )
                    out.append((total, k, times[0], times[-1] - times[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="the profile calibrated on this server")
    ap.add_argument("--endpoint", help="use this running server instead of starting one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/batched-prefill"))
    args = ap.parse_args()
    step = load_profile(args.profile).step_time

    def predicted(prompts: list[int]) -> float:
        pairs = sum(prefill_attention_pairs(p, 0) for p in prompts)
        return step.step_time(sum(prompts), 0, sum(prompts), pairs)

    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url = args.endpoint or stack.enter_context(start_server(args.out))
        print(isolate_engine(), flush=True)
        rows = asyncio.run(measure(url, args.repeats))
    print(f"{os.getloadavg()[0]:.1f} load average; measured / predicted, median over {args.repeats} repeats")
    print("| T | k | prompt | first, alone | the other k-1 in one step |")
    print("|---|---|---|---|---|")
    for total in TOTALS:
        for k in SPLITS:
            mine = [r for r in rows if r[0] == total and r[1] == k]
            prompt = total // k - (k == 1)
            alone = statistics.median(r[2] for r in mine) / predicted([prompt])
            rest = statistics.median(r[3] for r in mine) / predicted([prompt] * (k - 1)) if k > 1 else None
            print(f"| {total} | {k} | {prompt} | {alone:.2f} | {'-' if rest is None else f'{rest:.2f}'} |")


if __name__ == "__main__":
    main()
