"""Backends found by DNS: a Kubernetes headless Service resolves to the addresses of its ready pods.

A backend given as `dns+http://NAME:PORT` is re-resolved every `DISCOVERY_INTERVAL_S`; each address becomes a
backend `http://ADDRESS:PORT`. New addresses join the pool (polled from then on); vanished ones retire: they
get no new work and leave once this gateway's requests on them have finished, so a pod scaled down by an
autoscaler drains rather than failing its requests.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

DNS_PREFIX = "dns+"
DISCOVERY_INTERVAL_S = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


def is_discovered(url: str) -> bool:
    return url.startswith(DNS_PREFIX)


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6), sorted; none if it does not resolve."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


async def backend_urls(spec: str, resolver: Resolver) -> list[str]:
    """The backend URLs a `dns+http://NAME:PORT` spec stands for now."""
    parts = urlsplit(spec[len(DNS_PREFIX) :])
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = await resolver(parts.hostname or "", port)
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses]
