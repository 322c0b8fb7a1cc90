"""The live gateway under stress and failure, against fake vLLM backends: a burst racing for the budget,
backends that stop answering or refuse connections, clients that leave mid-stream, two gateways with their
own stale views of the same backends, and the snapshot rule on its own."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import httpx
import pytest

from simadmit.calibrate.metrics import EngineGauges
from simadmit.serve.backends import LivePool
from tests.serve_fake import FakeVllm, serving
from tests.serve_helpers import COST, completion, make_server, stack, until


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


# --- the snapshot rule, without HTTP ----------------------------------------------------------------------


def test_snapshot_is_own_books_plus_others_at_the_mean_estimate() -> None:
    """In-flight work = this gateway's requests at their estimates + the requests a backend holds beyond
    them at the mean estimate priced; others' work is spread over tiers in this gateway's admitted mix;
    a stale backend leaves the snapshot unless the scenario keeps it; a refused one until a poll answers."""
    pool = LivePool("p", ["http://a", "http://b"], 2, 64, prior_estimate_gpu_s=1.0, on_stale="unavailable")
    a, b = pool.backends
    for tier, gpu_s in (("chat", 1.0), ("batch", 3.0)):
        pool.priced(gpu_s, 0)
        pool.charge(a, tier, gpu_s)
    mean = 2.0  # the plain mean of the first prices: the prior is gone after the first
    assert pool.mean_estimate == pytest.approx(mean)
    pool.answering(a)
    pool.answering(a)
    pool.polled(a, EngineGauges(running=3, waiting=1, kv_usage=0.5), now=10.0)  # 2 of them are not ours
    pool.polled(b, EngineGauges(running=0, waiting=0, kv_usage=0.1), now=10.0)
    snap = pool.snapshot(10.0)
    assert snap.in_flight_gpu_s == pytest.approx(4.0 + 2 * mean)
    assert snap.in_flight_by_tier == pytest.approx({"chat": 1.0 + mean, "batch": 3.0 + mean})
    assert (snap.running, snap.queued, snap.free_batch_slots, snap.available_gpus) == (3, 1, 60 + 64, 4)
    assert snap.kv_used_fraction == pytest.approx(0.3)
    assert pool.route("least_work") is b and pool.route("least_loaded") is b

    pool.poll_failed(b, now=10.5, stale_after_s=1.0)  # silent for 0.5 s: not yet stale
    assert pool.snapshot(10.5).available_gpus == 4
    aborted: list[str] = []
    b.aborters.add(aborted.append)
    pool.poll_failed(b, now=11.0, stale_after_s=1.0)
    assert pool.snapshot(11.0).available_gpus == 2 and pool.route("least_work") is a
    assert len(aborted) == 1 and "stopped answering" in aborted[0]
    pool.polled(b, EngineGauges(0, 0, 0), now=11.2)  # it answers again: it rejoins
    assert pool.snapshot(11.2).available_gpus == 4

    pool.refused(a)
    assert pool.available() == [b]
    pool.release(a, "chat", 1.0, answered=True)
    pool.release(a, "batch", 3.0, answered=True)
    assert pool.own_gpu_s == 0 and pool.own_requests == 0 and pool.own_by_tier == {"chat": 0, "batch": 0}

    kept = LivePool("p", ["http://a"], 1, 8, 1.0, on_stale="last_known")
    kept.poll_failed(kept.backends[0], now=5.0, stale_after_s=1.0)
    assert kept.snapshot(5.0).available_gpus == 1


def test_own_requests_before_their_first_token_are_not_subtracted_from_vllms_count() -> None:
    """vLLM's gauges can leave out requests without a first token: with nothing waiting, of this gateway's
    3 requests only the one answering is in the count of 5, so the other 4 are another gateway's; once all
    3 answer, 2 are; requests vLLM reports waiting may be this gateway's pending ones."""
    pool = LivePool("p", ["http://a"], 1, 64, prior_estimate_gpu_s=1.0, on_stale="unavailable")
    (a,) = pool.backends
    for _ in range(3):
        pool.charge(a, "chat", 1.0)
    pool.answering(a)
    pool.polled(a, EngineGauges(running=5, waiting=0, kv_usage=0.1), now=1.0)
    assert a.others_at_poll == 4 and pool.snapshot(1.0).in_flight_gpu_s == pytest.approx(3.0 + 4.0)
    pool.answering(a)
    pool.answering(a)
    pool.polled(a, EngineGauges(running=5, waiting=0, kv_usage=0.1), now=1.2)
    assert a.others_at_poll == 2
    pool.release(a, "chat", 1.0, answered=True)
    assert (a.own_requests, a.own_answering) == (2, 2)
    pool.charge(a, "chat", 1.0)
    pool.charge(a, "chat", 1.0)  # 2 answering, 2 pending; vLLM: 3 running, 1 waiting
    pool.polled(a, EngineGauges(running=3, waiting=1, kv_usage=0.1), now=1.4)
    assert a.others_at_poll == 1


# --- the race the headroom exists for ---------------------------------------------------------------------


def test_burst_never_takes_one_gateways_work_past_its_budget(tmp_path: Path) -> None:
    """300 simultaneous requests of random prompt lengths (given as token ids) against a pool of 100 x 0.9 GPU-seconds: the
    decision is atomic in the event loop, so the admitted in-flight work never passes 90 GPU-seconds, and the
    requests it leaves out are exactly those that would have (the last admit fits, the next would not)."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        rng = random.Random(7)
        sizes = [rng.randint(1, 400) for _ in range(300)]
        changes = {  # nothing may time out however slowly a loaded machine runs client, gateway and backend
            "policies__0__max_pool_gpu_seconds": 100.0,
            "gateway__http__stale_after_s": 60.0,
            "gateway__http__connect_timeout_s": 60.0,
        }
        async with stack(tmp_path, [fake], **changes) as (server, client):

            async def send(tokens: int) -> httpx.Response:  # token ids: no /tokenize round trip
                return await client.post("/v1/completions", json=completion(prompt=list(range(tokens))))

            tasks = [asyncio.create_task(send(n)) for n in sizes]
            await until(lambda: sum(t.done() for t in tasks) + fake.running == len(tasks), timeout_s=60)
            pool = server.pools[0]
            admitted_gpu_s = pool.own_gpu_s
            assert fake.running == pool.own_requests > 50
            assert admitted_gpu_s <= 90.0 + 1e-9
            assert pool.peak_own_gpu_s <= 90.0 + 1e-9
            assert admitted_gpu_s + min(n / 1000 + 1.0 for n in sizes) > 90.0 - 1.4  # the pool is nearly full
            fake.release()
            codes = [(await t).status_code for t in tasks]
            assert codes.count(200) == fake.completed and set(codes) == {200, 429}
            await until(lambda: pool.own_requests == 0)
            assert pool.own_gpu_s == 0

    run(main())


# --- failing backends -------------------------------------------------------------------------------------


def test_backend_that_stops_answering_is_cut_off_and_rejoins(tmp_path: Path) -> None:
    """Backend A goes silent: once its /metrics is stale its in-flight requests end with a 503 (a JSON error
    when nothing was sent yet, a stream too since its 200 waits for its first event), it is marked down, new
    requests go to B, and it rejoins when it answers again. With every backend silent, requests get 429
    pool_exhausted."""

    async def main() -> None:
        a, b = FakeVllm(), FakeVllm()
        a.hold()
        b.hold()
        async with stack(tmp_path, [a, b]) as (server, client):
            plain = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: a.running == 1)
            other = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: b.running == 1)
            streamed = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True)))
            await until(lambda: a.running == 2)
            a.hanging = True
            r = await plain
            assert r.status_code == 503 and "stopped answering" in r.json()["error"]["message"]
            s = await streamed
            assert s.status_code == 503 and "stopped answering" in s.json()["error"]["message"]
            pool = server.pools[0]
            assert pool.available() == [pool.backends[1]] and pool.own_requests == 1
            health = await client.get("/health")
            assert health.json()["pools"]["pool"]["available"] == 1
            assert (
                f'backend="{pool.backends[0].url}",pool="pool"}} 0.0' in (await client.get("/metrics")).text
            )
            b.release()
            assert (await other).status_code == 200
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
            assert len(b.bodies) == 2 and len(a.bodies) == 2

            b.hanging = True
            await until(lambda: not pool.available())
            r = await client.post("/v1/completions", json=completion())
            assert r.status_code == 429 and r.json()["error"]["reason"] == "pool_exhausted"
            assert r.headers["retry-after"] == "5"
            assert (await client.get("/health")).status_code == 503

            a.hanging = b.hanging = False
            a.release()
            await until(lambda: len(pool.available()) == 2)
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    run(main())


@pytest.mark.parametrize("on_stale", ["unavailable", "last_known"])
def test_stale_metrics_are_treated_as_the_scenario_says(
    tmp_path: Path, on_stale: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Only /metrics goes silent, requests are still served: `unavailable` cuts the backend off (its request
    ends with a 503, new ones get pool_exhausted); `last_known` keeps routing to it on its last gauges. The
    operator is told once when it goes stale, and once when it answers again."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], gateway__http__on_stale=on_stale) as (server, client):
            held = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: fake.running == 1)
            fake.metrics_silent = True
            backend = server.pools[0].backends[0]
            await until(lambda: backend.stale)
            if on_stale == "unavailable":
                assert (await held).status_code == 503
                r = await client.post("/v1/completions", json=completion())
                assert r.status_code == 429 and r.json()["error"]["reason"] == "pool_exhausted"
            else:
                assert not held.done()
                fake.release()
                assert (await held).status_code == 200
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
            fake.metrics_silent = False
            fake.release()
            await until(lambda: not backend.stale)
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    with caplog.at_level(logging.WARNING, logger="simadmit.gateway"):
        run(main())
    said = [r.getMessage() for r in caplog.records if r.name == "simadmit.gateway"]
    then = "unavailable, its requests cut off" if on_stale == "unavailable" else "kept on its last gauges"
    assert len(said) == 2, said
    assert "/metrics not answering" in said[0] and said[0].endswith(then), said
    assert "answers /metrics again" in said[1], said


def test_a_backend_streaming_answers_is_not_stale_while_its_metrics_are_silent(tmp_path: Path) -> None:
    """/metrics goes silent while a stream runs twice `stale_after_s` (vLLM's API server too busy to
    answer it, its engine serving): the stream ends whole with a 200 (it was cut off with a 503), and the
    backend goes stale once nothing has come from it for `stale_after_s`, and rejoins when polls answer."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=40)
        fake.token_interval_s = 0.1  # 4 s of tokens, against 2 s of silence to be stale
        async with stack(tmp_path, [fake], gateway__http__stale_after_s=2.0) as (server, client):
            backend = server.pools[0].backends[0]
            fake.metrics_silent = True
            r = await client.post("/v1/completions", json=completion(stream=True))
            assert r.status_code == 200 and r.text.count('"text":"t') == 40, r.text[-300:]
            assert not backend.stale
            await until(lambda: backend.stale, timeout_s=30)  # polls time out after 2 s: stale at the first
            fake.metrics_silent = False
            await until(lambda: not backend.stale)

    run(main())


def test_a_backends_key_is_never_shown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A backend addressed as http://user:key@host: the key is in no log line, error body or metric label
    (the stale message printed the URL whole), while the backend is still named by its host."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], userinfo="ops:s3cret@") as (server, client):
            held = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: fake.running == 1)
            fake.metrics_silent = True
            await until(lambda: server.pools[0].backends[0].stale)
            shown = [(await held).text, (await client.get("/metrics")).text]
            fake.metrics_silent = False
            fake.release()
        shown += [r.getMessage() for r in caplog.records]
        host = server.pools[0].backends[0].shown
        assert host.startswith("http://127.0.0.1:") and all("s3cret" not in text for text in shown), shown
        assert host in shown[0] and host in shown[1] and host in shown[2], shown

    with caplog.at_level(logging.WARNING, logger="simadmit.gateway"):
        run(main())


def test_backend_refusing_connections_gets_503_and_no_more_work(tmp_path: Path) -> None:
    """A backend that is gone (connection refused) fails the request routed to it with a 503 and takes no
    more work until a poll of it answers; the other backend serves the rest."""

    async def main() -> None:
        a, gone = FakeVllm(), FakeVllm()
        a.hold()
        async with serving(gone.app) as gone_url:
            pass  # the port is closed again: connections are refused
        async with stack(tmp_path, [a], extra_urls=(gone_url,), gateway__http__stale_after_s=30.0) as (
            server,
            client,
        ):
            pool = server.pools[0]
            gone_backend = pool.backends[1]
            gone_backend.polled_ok_at = server.now()  # as if it had answered just before going away
            gone_backend.stale = False
            first = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: a.running == 1)
            r = await client.post("/v1/completions", json=completion())
            assert r.status_code == 503 and "could not be reached" in r.json()["error"]["message"]
            assert gone_backend.refused_until_poll and pool.available() == [pool.backends[0]]
            third = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: a.running == 2)
            a.release()
            assert (await first).status_code == (await third).status_code == 200
            assert pool.own_requests == 0

    run(main())


# --- clients that leave ------------------------------------------------------------------------------------


def test_client_leaving_mid_stream_aborts_the_backend_request(tmp_path: Path) -> None:
    """The client reads two tokens and hangs up: the gateway closes the backend request (which vLLM takes as
    an abort) and releases its GPU-seconds."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=50)
        fake.stall_after = 2
        async with stack(tmp_path, [fake]) as (server, client):
            async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                async for chunk in r.aiter_raw():
                    if b"t1 " in chunk:
                        break
            await until(lambda: fake.cancelled == 1)
            pool = server.pools[0]
            await until(lambda: pool.own_requests == 0)
            assert pool.own_gpu_s == 0 and fake.completed == 0
            assert "simadmit_gateway_client_disconnects_total 1.0" in (await client.get("/metrics")).text

    run(main())


def test_client_leaving_before_the_answer_aborts_too(tmp_path: Path) -> None:
    """A non-streamed request whose client times out is aborted at the backend as well."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake]) as (server, client):
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=completion(), timeout=0.3)
            await until(lambda: fake.cancelled == 1)
            await until(lambda: server.pools[0].own_requests == 0)
            assert "simadmit_gateway_client_disconnects_total 1.0" in (await client.get("/metrics")).text

    run(main())


# --- several gateways ------------------------------------------------------------------------------------


@pytest.mark.parametrize("poll_interval_s", [3600.0, 0.02])
def test_two_gateways_see_each_other_only_through_polls(tmp_path: Path, poll_interval_s: float) -> None:
    """Two gateways in front of one backend, 10 x 0.9 GPU-seconds each. Gateway 1 admits 8 requests (8.08
    GPU-s). Without a poll since, gateway 2 sees nothing of them and admits 8 more: the pool holds twice one
    gateway's budget (the overshoot headroom exists for). After a poll it counts them at its mean estimate
    (8 x 1.0) and admits none."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with serving(fake.app) as url:
            g1 = make_server(tmp_path, [url], gateway__poll_interval_s=poll_interval_s)
            g2 = make_server(tmp_path, [url], gateway__poll_interval_s=poll_interval_s)
            async with serving(g1.app) as u1, serving(g2.app) as u2, httpx.AsyncClient(timeout=10) as client:
                await until(
                    lambda: (
                        g1.pools[0].backends[0].polled_ok_at > -1
                        and g2.pools[0].backends[0].polled_ok_at > -1
                    )
                )

                async def burst(base: str, rejected: int) -> list[int]:
                    """Send 12; once `rejected` have their answer (the admitted ones are held), those."""
                    rs = [
                        asyncio.create_task(client.post(f"{base}/v1/completions", json=completion()))
                        for _ in range(12)
                    ]
                    await until(lambda: sum(t.done() for t in rs) >= rejected)
                    return [t for t in rs if t.done()]  # type: ignore[misc]

                first = await burst(u1, 4)
                await until(lambda: fake.running == 8)
                assert all(t.result().status_code == 429 for t in first)
                if poll_interval_s < 1:
                    await until(lambda: g2.gateway.views[0].in_flight_gpu_s >= 8.0)
                expected = 16 if poll_interval_s > 1 else 8
                second = await burst(u2, 12 - (expected - 8))
                await until(lambda: fake.running == expected)
                assert all(t.result().status_code == 429 for t in second)
                assert len(second) == 12 - (expected - 8)
                assert g1.pools[0].own_gpu_s == pytest.approx(8 * COST)
                fake.release()
                await until(lambda: fake.completed == expected)

    run(main())


# --- backends found by DNS --------------------------------------------------------------------------------


def test_backends_found_by_dns_join_and_drain(tmp_path: Path) -> None:
    """`dns+http://NAME:PORT` follows what NAME resolves to (a headless Service): an address that appears
    joins and takes work; one that disappears gets no new work and leaves once its requests have ended."""

    async def main() -> None:
        a, b = FakeVllm(), FakeVllm()
        a.hold()
        addresses = ["127.0.0.1"]

        async def resolver(host: str, port: int) -> list[str]:
            assert host == "pool.headless"
            return list(addresses)

        async with serving(a.app) as url_a:
            port = int(url_a.rsplit(":", 1)[1])
            async with serving(b.app, host="127.0.0.2", port=port):
                server = make_server(tmp_path, [f"dns+http://pool.headless:{port}"])
                server.resolve = resolver
                server.discovery_interval_s = 0.02
                pool = server.pools[0]
                async with serving(server.app) as gw, httpx.AsyncClient(base_url=gw, timeout=30) as client:
                    await until(lambda: [x.url for x in pool.available()] == [url_a])
                    held = asyncio.create_task(client.post("/v1/completions", json=completion()))
                    await until(lambda: a.running == 1)
                    addresses[:] = ["127.0.0.1", "127.0.0.2"]
                    await until(lambda: len(pool.available()) == 2)
                    assert (await client.post("/v1/completions", json=completion())).status_code == 200
                    assert len(b.bodies) == 1  # the newcomer had the least work
                    addresses[:] = ["127.0.0.2"]
                    await until(lambda: len(pool.available()) == 1)
                    assert [x.url for x in pool.backends] == [url_a, f"http://127.0.0.2:{port}"]  # draining
                    a.release()
                    assert (await held).status_code == 200
                    await until(lambda: len(pool.backends) == 1)
                    assert (await client.post("/v1/completions", json=completion())).status_code == 200
                    assert len(a.bodies) == 1 and len(b.bodies) == 2

    run(main())


def test_dns_spec_becomes_one_url_per_address() -> None:
    """IPv6 addresses are bracketed; the spec's scheme and port are kept."""
    from simadmit.serve.discovery import backend_urls

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.0.0.5", "fd00::1"] if (host, port) == ("vllm.ns.svc", 8000) else []

    urls = asyncio.run(backend_urls("dns+http://vllm.ns.svc:8000", resolver))
    assert urls == ["http://10.0.0.5:8000", "http://[fd00::1]:8000"]
