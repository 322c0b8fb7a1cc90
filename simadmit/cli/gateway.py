"""`simadmit gateway`: run a scenario's admission layer as an HTTP gateway in front of vLLM backends.

The scenario, its `--set` overrides and `--profile` are read and checked exactly as `simulate` reads them,
so a bad argument prints one line and exits with code 2 before anything listens.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Annotated

import typer

from simadmit.cli.common import fail
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario_with_origin
from simadmit.config.overrides import parse_assignments
from simadmit.config.resources import resolve_scenario


def profile_overrides(profiles: list[str], pools: list[str]) -> dict[str, object]:
    """`--profile PATH` (every pool) or `--profile POOL=PATH` as overrides of the pools' profiles, one per
    pool; a path that exists here is made absolute, since the scenario resolves relative paths against its
    own folder."""
    out: dict[str, object] = {}
    given: dict[str, str] = {}  # pool -> the argument that gave its profile
    for arg in profiles:
        name, sep, ref = arg.partition("=")
        if not sep:
            name, ref = "", arg
        elif name not in pools:
            raise InputError([f"--profile {arg}: no pool named {name!r} (pools: {', '.join(pools)})"])
        if not ref.strip():  # else the scenario's pools.N.profile would be blamed for it
            raise InputError([f"--profile {arg!r}: no profile given (a file or a bundled name)"])
        if Path(ref).is_file():
            ref = str(Path(ref).resolve())
        for i, pool in enumerate(pools):
            if name in ("", pool):
                if pool in given:  # which one the gateway prices with would be the order's accident
                    why = f"pool {pool!r} already has a profile (--profile {given[pool]}): give each pool one"
                    raise InputError([f"--profile {arg}: {why}"])
                given[pool] = arg
                out[f"pools.{i}.profile"] = ref
    return out


def gateway(
    backend: Annotated[
        list[str],
        typer.Option(help="a vLLM backend's base URL (repeat); POOL=URL when the scenario has several pools"),
    ],
    scenario: Annotated[
        Path | None, typer.Option(help="scenario YAML, or a bundled scenario's name (default: the default)")
    ] = None,
    profile: Annotated[
        list[str],
        typer.Option(help="cost profile for every pool, or POOL=PROFILE (a file or a bundled name)"),
    ] = [],  # noqa: B006
    policy: Annotated[
        str | None,
        typer.Option(help="which of the scenario's policies (default: its only, else its gpu_seconds)"),
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 9000,
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
) -> None:
    """Admit, reject (429 + Retry-After) and proxy OpenAI-compatible requests as the scenario's policy says."""
    import uvicorn

    from simadmit.serve.app import GatewayServer
    from simadmit.serve.settings import serve_settings

    try:
        overrides = parse_assignments(set_)
        path = resolve_scenario(scenario)
        # the gateway draws no workload: a trace the scenario replays need not be on this machine
        spec, base, origin = load_scenario_with_origin(path, overrides, workload_traces=False)
        if profile:
            profiles = profile_overrides(profile, [p.name for p in spec.pools])
            given_by = dict.fromkeys(profiles, "--profile")
            spec, base, origin = load_scenario_with_origin(
                path, overrides | profiles, workload_traces=False, given_by=given_by
            )
        settings = serve_settings(spec, base, backend, policy, origin)
        host = host.removeprefix("[").removesuffix("]")  # [::1], as an IPv6 address is written in a URL
        if not host.strip():  # the socket would take "" for every address: an unset variable, not a choice
            raise InputError(["--host '': no address given (0.0.0.0 listens on every address)"])
        listener = listen(host, port)
    except InputError as e:
        fail(e.problems)
    server = GatewayServer(settings)
    shown = f"[{host}]" if ":" in host else host  # the URL a client is given: http://[::1]:9000
    typer.echo(
        f"simadmit gateway on http://{shown}:{port}: policy {settings.policy_name}, "
        + "; ".join(f"{p.name}: {len(p.backends)} backend(s)" for p in server.pools)
        + (
            f"; rate limits 1/{settings.limit_share} each, for gateway.replicas = {settings.limit_share} processes"
            if settings.limit_share > 1
            else ""
        )
    )
    logging.basicConfig(format="simadmit gateway: %(message)s", level=logging.WARNING)
    # on SIGTERM, requests in flight get 25 s to finish: inside Kubernetes' default 30 s grace period
    config = uvicorn.Config(
        server.app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=25
    )
    uvicorn.Server(config).run(sockets=[listener])


def listen(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything starts: a port in use is one line, exit 2."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        why = (e.strerror or str(e)).split(" (while")[0]  # not the address again
        raise InputError([f"--host {host} --port {port}: cannot listen there ({why})"]) from None


def register(app: typer.Typer) -> None:
    app.command()(gateway)
