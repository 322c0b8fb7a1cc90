"""Does a step that prefills while other sequences decode cost the sum of its parts, as the step model says?

The step model charges one step its overhead, its linear layers (prompt tokens and decoding sequences, or
the weights' read), the context its sequences hold and its prefill's attention pairs, each part alone: a
prompt prefilled beside D decoding sequences costs what it costs alone plus what their decode adds. This
reads step durations straight from the inter-token times of streams (vLLM sends each sequence's token at the
end of the step that made it) on a real vLLM server, and prints each measured step over the profile's
prediction:

- insert: D sequences decode (64-token prompts); once each has streamed 15 tokens, one prompt of P tokens
  arrives; the gap that ends at its first token is the mixed step. Beside it, the same batch's plain
  decode steps before the prompt came, and the prompt's lone prefill (its TTFT less the latency outside
  the engine). Ratios that agree across the three kinds, whatever their level, say the parts add up;
- churn: D workers each keep one request of P prompt tokens decoding 20-60 tokens, so sequences leave and
  join nearly every step (read once the burst the workers begin with has turned over: every worker has
  finished a request), against the same batch decoding with nobody joining. Its mean step over the
  model's (the steady batch, plus the joining prompts' tokens, KV and attention at the rate of joins per
  step) says whether a batch that changes every step costs what its tokens do. Keep D x P within a few
  steps' token budget: a longer burst does not turn over within the run.

    flock /tmp/vllm.lock python benchmarks/mixed_steps.py --profile runs/fidelity/profile.yaml

Starts the tests' SmolLM2 server unless `--endpoint` names a running one; its engine gets a core to itself.
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

from simadmit.calibrate.client import EventStream, completion_body, stream_event  # noqa: E402
from simadmit.config.profile import Profile, load_profile, prefill_attention_pairs  # noqa: E402

Cells = dict[tuple[int, int], list[tuple[float, ...]]]  # (prompt tokens, batch) -> one row per repeat

DECODE_PROMPT = 64  # tokens of each decoding sequence's prompt
SETTLED = 15  # tokens every decoding stream has sent before the prompt is inserted
CHURN_OUTPUT = (20, 60)  # tokens each churning request decodes
CHURN_S = 45.0  # the first ~10 s turn the starting burst over
STEADY_OUTPUT = 120  # tokens each sequence of the steady batch decodes: on average half that is in its KV


Tokens = list[tuple[float, int]]  # (perf_counter, tokens out so far) at each event of one stream


class Streams:
    """Streamed completions on one server (random token ids: no prefix-cache hits). Each event says how many
    tokens the request has made (`continuous_usage_stats`), so an API server that sends several tokens in
    one event, as it does when behind, does not pass for one long step."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, rng: random.Random) -> None:
        self.client, self.url, self.model, self.rng = client, url, model, rng

    async def tokens(self, prompt: int, output: int, into: Tokens | None = None) -> Tokens:
        """Each event of one completion (appended to `into` as they come)."""
        events = [] if into is None else into
        ids = [self.rng.randrange(1000, 40000) for _ in range(prompt)]
        body = completion_body(self.model, ids, output, usage_per_event=True)
        async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for now, payloads in EventStream(response, time.perf_counter).reads():
                for event in map(stream_event, payloads):
                    if event.get("choices"):
                        events.append((now, event["usage"]["completion_tokens"]))
        return events

    async def ttft(self, prompt: int) -> float:
        started = time.perf_counter()
        return (await self.tokens(prompt, 1))[0][0] - started


def mean_step(streams: list[Tokens], after: float, before: float) -> float:
    """Seconds per token of the streams between `after` and `before`: each token of a decoding sequence
    comes out of one step."""
    spans = [
        (b[0] - a[0], b[1] - a[1])
        for ev in streams
        for a, b in zip(ev, ev[1:], strict=False)
        if a[0] >= after and b[0] <= before
    ]
    return sum(t for t, _ in spans) / sum(n for _, n in spans)


async def insert(s: Streams, prompt: int, batch: int) -> tuple[float, float, float, float]:
    """(mixed step, plain decode step, mean context per decoding sequence at the insert, lone TTFT)."""
    live: list[Tokens] = [[] for _ in range(batch)]
    decoding = [asyncio.create_task(s.tokens(DECODE_PROMPT, 150, live[i])) for i in range(batch)]
    while min(ev[-1][1] if ev else 0 for ev in live) < SETTLED:
        await asyncio.sleep(0.02)
    inserted = time.perf_counter()
    context = DECODE_PROMPT + statistics.mean(ev[-1][1] for ev in live)
    first = (await s.tokens(prompt, 1))[0][0]
    streams = await asyncio.gather(*decoding)
    # each stream's one-token event nearest the prompt's first token (a step's tokens leave microseconds apart)
    mixed = statistics.median(
        min((abs(b[0] - first), b[0] - a[0]) for a, b in zip(ev, ev[1:], strict=False) if b[1] - a[1] == 1)[1]
        for ev in streams
    )
    plain = mean_step(streams, max(ev[3][0] for ev in streams), inserted)
    return mixed, plain, context, await s.ttft(prompt)


async def churn(s: Streams, prompt: int, batch: int, rng: random.Random) -> tuple[float, float, float]:
    """(mean step while churning, joins per step, mean context per sequence), from the time every worker has
    finished its first request (the burst they began with has turned over) until they stop."""
    streams: list[list[Tokens]] = [[] for _ in range(batch)]
    stop = time.perf_counter() + CHURN_S

    async def worker(mine: list[Tokens]) -> None:
        while time.perf_counter() < stop:
            mine.append(await s.tokens(prompt, rng.randint(*CHURN_OUTPUT)))

    await asyncio.gather(*(worker(mine) for mine in streams))
    lo, hi = max(mine[0][-1][0] for mine in streams), stop - 1.0
    every = [ev for mine in streams for ev in mine]
    step = mean_step(every, lo, hi)
    joins = sum(lo <= ev[0][0] <= hi for ev in every)
    return step, joins * step / (hi - lo), prompt + statistics.mean(CHURN_OUTPUT) / 2


async def steady(s: Streams, prompt: int, batch: int, output: int) -> float:
    """Mean step of `batch` sequences decoding together, none joining or leaving."""
    streams = await asyncio.gather(*(s.tokens(prompt, output) for _ in range(batch)))
    return mean_step(streams, max(ev[3][0] for ev in streams), min(ev[-3][0] for ev in streams))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="the profile calibrated on this server")
    ap.add_argument("--endpoint", help="use this running server instead of starting one")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", default="128,512,1024,1900", help="prompt tokens inserted ('': none)")
    ap.add_argument("--batches", default="1,8,32", help="sequences decoding")
    ap.add_argument("--churn-prompts", default="16,128", help="prompt tokens of churning requests ('': none)")
    ap.add_argument("--out", type=Path, default=Path("runs/mixed-steps"))
    args = ap.parse_args()
    profile = load_profile(args.profile)
    prompts, batches, churning = (
        [int(v) for v in a.split(",") if v] for a in (args.prompts, args.batches, args.churn_prompts)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url = args.endpoint or stack.enter_context(start_server(args.out))
        print(isolate_engine(), flush=True)
        inserts, churns = asyncio.run(measure(url, prompts, batches, churning, args.repeats))
    print(f"{os.getloadavg()[0]:.1f} load average; measured / predicted, median over {args.repeats} repeats")
    print_tables(profile, inserts, churns)


async def measure(
    url: str, prompts: list[int], batches: list[int], churning: list[int], repeats: int
) -> tuple[Cells, Cells]:
    """Every insert and churn cell `repeats` times, in rounds (a drift of the machine spreads over all)."""
    rng = random.Random(7)
    inserts: Cells = {}
    churns: Cells = {}
    async with httpx.AsyncClient(timeout=300) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        s = Streams(client, url, model, rng)
        await steady(s, 32, 8, 40)  # warm-up
        for _ in range(repeats):
            for prompt in prompts:
                for batch in batches:
                    inserts.setdefault((prompt, batch), []).append(await insert(s, prompt, batch))
            for batch in (b for b in batches if b > 1):
                for prompt in churning:
                    still = await steady(s, prompt, batch, STEADY_OUTPUT)
                    churns.setdefault((prompt, batch), []).append(
                        (still, *await churn(s, prompt, batch, rng))
                    )
    return inserts, churns


def print_tables(profile: Profile, inserts: Cells, churns: Cells) -> None:
    step = profile.step_time

    def median(rows: list[tuple[float, ...]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    print("| prompt | decoding | mixed step, s | mixed | lone prefill | plain decode |")
    print("|---|---|---|---|---|---|")
    for (prompt, batch), rows in sorted(inserts.items()):
        pairs = prefill_attention_pairs(prompt, 0)
        context = batch * median(rows, 2)
        mixed = step.step_time(prompt, batch, context + prompt, pairs)
        lone = step.step_time(prompt, 0, prompt, pairs) + profile.api_latency_s
        plain = step.step_time(0, batch, context)
        print(
            f"| {prompt} | {batch} | {median(rows, 0):.3f} | {median(rows, 0) / mixed:.2f} "
            f"| {median(rows, 3) / lone:.2f} | {median(rows, 1) / plain:.2f} |"
        )
    print("\n| prompt | decoding | joins per step | steady | churning |")
    print("|---|---|---|---|---|")
    for (prompt, batch), rows in sorted(churns.items()):
        joins, context = median(rows, 2), batch * median(rows, 3)
        still = step.step_time(0, batch, batch * (prompt + STEADY_OUTPUT / 2))
        # the mean step: the batch's decode and `joins` prompts' prefill (their tokens, KV and attention)
        tokens = joins * prompt
        moving = step.step_time(tokens, batch, context + tokens, joins * prefill_attention_pairs(prompt, 0))
        print(
            f"| {prompt} | {batch} | {joins:.2f} | {median(rows, 0) / still:.2f} | {median(rows, 1) / moving:.2f} |"
        )


if __name__ == "__main__":
    main()
