"""Shared set-up of the gateway's tests: a tiny scenario whose cost model makes estimates easy to count.

Prefill 1,000 and decode 100 tokens per GPU-second: a 10-word prompt with max_tokens 100 is charged exactly
0.01 + 1.0 = 1.01 GPU-seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from simadmit.config.loading import scenario_from_dict
from simadmit.serve.app import GatewayServer
from simadmit.serve.settings import serve_settings
from tests.serve_fake import FakeVllm, serving

PROMPT = "one two three four five six seven eight nine ten"  # 10 tokens for the fake backend
COST = 0.01 + 1.0  # GPU-seconds of PROMPT with max_tokens 100

PROFILE = {
    "model": "fake",
    "gpu": "none",
    "gpus_per_replica": 1,
    "tensor_parallel": 1,
    "step_time": {
        "overhead_s": 0.001,
        "per_prefill_token_s": 0.001,
        "per_decode_seq_s": 0.001,
        "per_context_token_s": 0.0,
    },
    "kv_capacity_tokens": 100000,
    "kv_block_size": 16,
    "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 2048},
    "summary": {"prefill_tokens_per_gpu_s": 1000, "decode_tokens_per_gpu_s": 100},
}

SCENARIO: dict[str, Any] = {
    "name": "serve-test",
    "workload": {
        "rate_rps": 10,
        "duration_s": 10,
        "tiers": [
            {"name": "interactive", "share": 1, "prompt_tokens": {"kind": "fixed", "value": 10},
             "output_tokens": {"kind": "fixed", "value": 5}, "max_tokens": 100},
            {"name": "batch", "share": 1, "prompt_tokens": {"kind": "fixed", "value": 10},
             "output_tokens": {"kind": "fixed", "value": 5}, "max_tokens": 100},
        ],
    },
    "pools": [{"name": "pool", "profile": "fake.yaml", "replicas": 1}],
    "gateway": {"poll_interval_s": 0.02, "http": {"stale_after_s": 1.0, "api_keys": {"sk-batch": "batch"}}},
    "policies": [
        {"kind": "gpu_seconds", "budgets_s": {"interactive": 100.0, "batch": 100.0}, "headroom": 0.9,
         "max_pool_gpu_seconds": 10.0},
    ],
}  # fmt: skip


def make_server(tmp_path: Path, backends: list[str], **changes: Any) -> GatewayServer:
    """A gateway for SCENARIO with `changes` applied (dotted paths, as with --set)."""
    (tmp_path / "fake.yaml").write_text(yaml.safe_dump(PROFILE))
    data = copy.deepcopy(SCENARIO)
    overrides = {k.replace("__", "."): v for k, v in changes.items()}
    spec = scenario_from_dict(data, tmp_path / "scenario.yaml", overrides)
    return GatewayServer(serve_settings(spec, tmp_path, backends, None))


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `condition()` holds, checking every few milliseconds; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path,
    fakes: list[FakeVllm],
    extra_urls: tuple[str, ...] = (),
    userinfo: str = "",
    **changes: Any,
) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient]]:
    """Fake backends (and `extra_urls`), a gateway in front of them, and a client to the gateway; yields
    once every fake backend has been polled. `userinfo` (`user:key@`) goes into the fakes' URLs."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            (await stack.enter_async_context(serving(f.app))).replace("://", f"://{userinfo}") for f in fakes
        ]
        server = make_server(tmp_path, urls + list(extra_urls), **changes)
        url = await stack.enter_async_context(serving(server.app))
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=None))
        )
        await until(
            lambda: all(b.polled_ok_at > float("-inf") for b in server.pools[0].backends[: len(urls)])
        )
        yield server, client


def completion(max_tokens: int | None = 100, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake", "prompt": PROMPT, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body
