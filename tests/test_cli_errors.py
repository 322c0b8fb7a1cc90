"""Bad input as a new user types it, through the `simadmit` console command: one clear line, exit code 2.

Each row of the table is one input a user could write (a scenario field, a trace file, a command-line
value), the exit code it must give and a fragment of the message it must print. Every case runs the
installed console script in a subprocess, exactly as a user would, and none may print a traceback. Rows
with exit code 0 are inputs that used to be silently mishandled and are now accepted with the meaning the
user wrote (the output fragment shows it).
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import math
import os
import pickle
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import pandas as pd
import pytest
import yaml

from simadmit.calibrate.measurements import COLUMNS
from simadmit.config.errors import InputError
from simadmit.config.profile import StepTimeModel
from simadmit.config.resources import resolve_profile, resolve_scenario, resolve_trace
from simadmit.serve.inbound import COMPLETIONS, ClientError, parse_body
from tests.fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parent.parent
PROFILE = str(ROOT / "calibration" / "llama-3.1-8b-h100.yaml")
SIMADMIT = str(Path(sys.executable).parent / "simadmit")

TIER = {
    "name": "interactive",
    "prompt_tokens": {"kind": "fixed", "value": 100},
    "output_tokens": {"kind": "fixed", "value": 20},
    "max_tokens": 64,
}
BASE: dict = {
    "name": "tiny",
    "workload": {"seed": 1, "rate_rps": 4, "duration_s": 4, "tiers": [TIER]},
    "pools": [{"name": "p", "profile": PROFILE, "replicas": 1}],
    "gateway": {"poll_interval_s": 0},
    "clients": {"max_retries": 0},
    "policies": [{"kind": "unconditional"}],
}
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_OK = AZURE_HEADER + "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.00,396,109\n"
MOONCAKE_OK = '{"timestamp": 0, "input_length": 50, "output_length": 5}\n'


def _trace_workload(path: str = "trace.csv", fmt: str = "azure", **options: object) -> Callable[[dict], None]:
    """Replace the synthetic workload by a replay of `path`."""

    def mutate(doc: dict) -> None:
        doc["workload"] = {
            "seed": 1,
            "trace": {"path": path, "format": fmt, **options},
            "tiers": [{"name": "t"}],
        }

    return mutate


def _set(path: str, value: object) -> Callable[[dict], None]:
    """Set a dotted path of the scenario (list elements by index)."""

    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        for m in mutations:
            m(doc)

    return mutate


def _classical(service: dict, policy: dict) -> Callable[[dict], None]:
    """One textbook server (batch of 1) with this service time, Poisson arrivals at rho = 0.8 of a
    0.824 s mean service, a live view and no retries."""

    def mutate(doc: dict) -> None:
        doc["workload"] = {
            "seed": 1,
            "rate_rps": 0.8 / (0.5 * math.exp(0.5)),
            "requests": 2000,
            "tiers": [TIER],
        }
        doc["pools"][0]["engine"] = {"kind": "classical", "service_time": service}
        doc["gateway"]["dispatch"] = "central"
        doc["policies"] = [policy]

    return mutate


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[dict], None] = lambda d: None
    args: tuple[str, ...] = ()
    files: dict[str, str | bytes] = field(default_factory=dict)
    code: int = 2
    fragment: str = ""
    scenario_text: str | None = None  # "default": run the bundled default scenario instead of BASE
    summary: Callable[[dict], bool] | None = None  # holds for the summary.json of a run that succeeds
    absent: str = ""  # must not be printed (a second, misleading line; a secret)


def _profile(**changes: object) -> str:
    """The bundled H100 profile with dotted fields changed (`step_time.overhead_s=...`), as YAML text."""
    doc = yaml.safe_load(Path(PROFILE).read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value
    return yaml.safe_dump(doc)


def _parquet(columns: dict[str, list[object]]) -> bytes:
    """A Parquet file of these columns, as bytes."""
    buffer = io.BytesIO()
    pd.DataFrame(columns).to_parquet(buffer)
    return buffer.getvalue()


MAPPED = {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"}
EMPIRICAL = {
    "kind": "empirical",
    "trace": {"path": "trace.csv", "format": "azure"},
    "column": "prompt_tokens",
}
SIM_CASES = [
    # --- trace content, read by `simulate` (replay, empirical lengths, fitted arrivals) ---
    Case("trace-empty-file", _trace_workload(), files={"trace.csv": ""}, fragment="trace.csv: empty file"),
    Case(
        "trace-header-only",
        _trace_workload(),
        files={"trace.csv": AZURE_HEADER},
        fragment="trace.csv: no requests in it: the file holds no rows",
    ),
    Case(
        "trace-malformed-row",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,abc,12\n"},
        fragment="trace.csv: line 4: ContextTokens 'abc' is not a whole number",
    ),
    Case(
        "trace-short-row",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,12\n"},
        fragment="line 4: expected 3 comma-separated fields, found 2",
    ),
    Case(
        "trace-negative-tokens",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,-5,12\n"},
        fragment="line 4: ContextTokens '-5' is not a whole number >= 1",
    ),
    Case(
        "trace-bad-date",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "yesterday,5,12\n"},
        fragment="line 4: TIMESTAMP 'yesterday' is not a date-time",
    ),
    Case(
        "trace-dates-with-and-without-an-offset",  # the one without read as UTC: two hours apart, not 0.32 s
        _trace_workload(),
        files={
            "trace.csv": AZURE_HEADER + "2023-11-16T18:15:46.68+02:00,374,44\n2023-11-16 18:15:47.00,396,9\n"
        },
        fragment="trace.csv: line 3: TIMESTAMP '2023-11-16 18:15:47.00' gives no UTC offset where the first",
    ),
    Case(
        "trace-gzip-named-as-csv",  # "not a UTF-8 text file", what it is left unsaid
        _trace_workload(),
        files={"trace.csv": gzip.compress(AZURE_OK.encode())},
        fragment="trace.csv: not a UTF-8 text file: a gzip file (name it trace.csv.gz)",
    ),
    Case(
        "trace-semicolon-separated",  # a line per column, each "no column" naming the one it was in
        _trace_workload(),
        files={"trace.csv": AZURE_OK.replace(",", ";")},
        fragment="trace.csv: line 1: the header is one field, its names separated by ';': a CSV separates them by "
        "commas",
    ),
    Case(
        "trace-utf16",  # as a spreadsheet's "Unicode text" export writes it: "not a UTF-8 text file", no more
        _trace_workload(),
        files={"trace.csv": AZURE_OK.encode("utf-16")},
        fragment="trace.csv: not a UTF-8 text file: a UTF-16 one (save it as UTF-8)",
    ),
    Case(
        "trace-wrong-columns",
        _trace_workload(),
        files={"trace.csv": "time,prompt,output\n1,2,3\n"},
        fragment="no column 'TIMESTAMP'",
    ),
    Case(
        "trace-truncated",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:4"},
        fragment="line 4: expected 3 comma-separated fields, found 1",
    ),
    Case(
        "trace-jsonl-truncated",
        _trace_workload("trace.jsonl", "mooncake"),
        files={"trace.jsonl": MOONCAKE_OK + '{"timestamp": 5, "input_le'},
        fragment="trace.jsonl: line 2: not valid JSON",
    ),
    Case(
        "trace-jsonl-true-as-a-number",  # read as 1 (a timestamp, a length) and run
        _trace_workload("trace.jsonl", "mooncake"),
        files={"trace.jsonl": MOONCAKE_OK + '{"timestamp": true, "input_length": 50, "output_length": 5}\n'},
        fragment="trace.jsonl: line 2: timestamp True is not a finite number",
    ),
    Case(
        "trace-jsonl-read-as-another-format",  # ten lines of "line N: TIMESTAMP is missing", then a count
        _trace_workload("trace.jsonl", "azure"),
        files={"trace.jsonl": MOONCAKE_OK * 12},
        fragment="trace.jsonl: no column 'TIMESTAMP' (columns: input_length, output_length, timestamp)",
        absent="is missing",
    ),
    Case(
        "trace-jsonl-nan-timestamp",  # said "timestamp is missing": JSON's NaN read as a Parquet null
        _trace_workload("trace.jsonl", "mooncake"),
        files={"trace.jsonl": MOONCAKE_OK + '{"timestamp": NaN, "input_length": 50, "output_length": 5}\n'},
        fragment="trace.jsonl: line 2: timestamp NaN is not a finite number",
    ),
    Case(
        "trace-jsonl-infinite-length",
        _trace_workload("trace.jsonl", "mooncake"),
        files={
            "trace.jsonl": MOONCAKE_OK + '{"timestamp": 1, "input_length": Infinity, "output_length": 5}\n'
        },
        fragment="trace.jsonl: line 2: input_length Infinity is not a whole number >= 1",
    ),
    Case(
        "trace-jsonl-true-as-a-length",
        _trace_workload("trace.jsonl", "mooncake"),
        files={"trace.jsonl": MOONCAKE_OK + '{"timestamp": 1, "input_length": true, "output_length": 5}\n'},
        fragment="trace.jsonl: line 2: input_length True is not a whole number >= 1",
    ),
    Case(
        "trace-length-rule-of-unknown-tier",  # named no file
        _trace_workload(tiers={"by": "length", "rules": [{"tier": "gold", "above": 100}]}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.tiers: the trace yields tiers ['gold'] that workload.tiers lacks",
    ),
    Case(
        "thousands-of-tiers",  # ran for minutes: a summary row per tier
        _set(
            "workload.tiers",
            [{"name": f"t{i}", "prompt_tokens": {"kind": "fixed", "value": 10}} for i in range(1001)],
        ),
        fragment="scenario.yaml: workload.tiers: List should have at most 1000 items after validation, not 1001",
    ),
    Case(
        "backoff-base-above-its-cap",  # ran, every wait the cap
        _set("clients.backoff", {"base_s": 100, "cap_s": 1}),
        fragment="scenario.yaml: clients.backoff: base_s (100 s) above cap_s (1 s): every wait would be cap_s",
    ),
    Case(
        "slo-end-before-first-token",  # ran, the TTFT target never binding: the two swapped
        _set("workload.tiers.0.slo", {"ttft_s": 10, "e2e_s": 2}),
        fragment="scenario.yaml: workload.tiers.0.slo: e2e_s (2 s) under ttft_s (10 s): a request ends after "
        "its first token, so ttft_s could never bind",
    ),
    Case(
        "trace-length-rules-under-by-share",  # ran, the rules silently ignored
        _trace_workload(tiers={"by": "share", "rules": [{"tier": "t", "above": 100}]}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.tiers: rules apply with by: length only, not by: share",
    ),
    Case(
        "trace-tier-column-under-by-share",  # ran, tiers dealt by share: the column never read
        _trace_workload(tiers={"by": "share", "column": "class"}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.tiers: column applies with by: column only, not by: share",
    ),
    Case(
        "trace-tier-default-under-by-share",  # ran, the default never applied
        _trace_workload(tiers={"by": "share", "default": "t"}),
        files={"trace.csv": AZURE_OK},
        fragment="workload.trace.tiers: default applies with by: length or by: column, not by: share",
    ),
    Case(
        "trace-tier-names-under-by-length",
        _trace_workload(tiers={"by": "length", "names": {"gold": "t"}}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.tiers: names apply with by: column only, not by: length",
    ),
    Case(
        "trace-tier-column-by-its-own-name",  # "the trace has no column 'class'" (it has), no file named
        _trace_workload(
            "trace.csv",
            "mapped",
            columns={**MAPPED, "tier": "class"},
            tiers={"by": "column", "column": "class"},
        ),
        files={"trace.csv": "t,p,o,class\n0,10,5,t\n1,10,5,gold\n"},
        fragment="scenario.yaml: workload.trace.tiers: the trace yields tiers ['gold'] that workload.tiers lacks",
    ),
    Case(
        "trace-fit-bins-too-fine",  # hung: a step per microsecond of the trace
        _set(
            "workload.arrival",
            {"kind": "fit", "trace": {"path": "trace.csv", "format": "azure"}, "bin_s": 1e-9},
        ),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:50.00,396,109\n"},
        fragment="scenario.yaml: workload: arrival.bin_s 1e-09 s cuts the trace's 3.32 s into 3.32e+09 bins",
    ),
    Case(
        "trace-empirical-lengths",
        _set("workload.tiers.0.prompt_tokens", EMPIRICAL),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,abc,12\n"},
        fragment="trace.csv: line 4: ContextTokens 'abc'",
    ),
    Case(
        "empirical-values-with-a-column",  # ran on the values, the column picking nothing
        _set(
            "workload.tiers.0.output_tokens",
            {"kind": "empirical", "values": [20, 30], "column": "output_tokens"},
        ),
        fragment="workload.tiers.0.output_tokens: column picks a trace's lengths: it does not apply to values",
    ),
    Case(
        "trace-fit-arrivals",
        _set("workload.arrival", {"kind": "fit", "trace": {"path": "trace.csv", "format": "azure"}}),
        files={"trace.csv": AZURE_HEADER + "2023-11-16 18:15:46.68,374\n"},
        fragment="trace.csv: line 2: expected 3 comma-separated fields",
    ),
    Case(
        "trace-skip-reports-its-count",
        _trace_workload(on_error="skip"),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,abc,12\nbad,1,1\n"},
        code=0,
        fragment="skipped 2 malformed rows",
    ),
    Case(
        "trace-with-a-rate-and-lengths-set-anyway",  # ran silently on the trace's own rate and lengths
        lambda d: (
            _trace_workload()(d),
            d["workload"].update(rate_rps=50),
            d["workload"]["tiers"][0].update(prompt_tokens={"kind": "fixed", "value": 9}),
        ),
        files={"trace.csv": AZURE_OK},
        code=0,
        fragment="note: workload.rate_rps, workload.tiers.0.prompt_tokens: not used when replaying a trace",
    ),
    Case(
        "trace-with-a-tier-window-and-shares-set-anyway",  # ran silently, every row dealt by length at any time
        lambda d: (
            _trace_workload(tiers={"by": "length", "rules": [{"tier": "b", "above": 380}]})(d),
            d["workload"]["tiers"].extend([{"name": "b", "share": 3, "start_s": 60}]),
        ),
        files={"trace.csv": AZURE_OK},
        code=0,
        fragment="note: workload.tiers.1.start_s, workload.tiers.1.share: not used when replaying a trace",
    ),
    Case(
        "trace-bom-crlf-trailing-blank-lines",
        _trace_workload(),
        files={"trace.csv": "\ufeff" + AZURE_OK.replace("\n", "\r\n") + "\r\n\r\n"},
        code=0,
        fragment="2 simulated requests",  # a spreadsheet export: the header is found, blank lines skipped
    ),
    Case(
        "trace-jsonl-bom-crlf",
        _trace_workload("trace.jsonl", "mooncake"),
        files={
            "trace.jsonl": "\ufeff"
            + (MOONCAKE_OK + MOONCAKE_OK.replace(": 0,", ": 1000,")).replace("\n", "\r\n")
            + "\r\n"
        },
        code=0,
        fragment="2 simulated requests",
    ),
    Case(
        "trace-binary",
        _trace_workload(),
        files={"trace.csv": AZURE_HEADER.encode() + bytes(range(128, 256))},
        fragment="trace.csv: not a UTF-8 text file",
    ),
    Case(
        "trace-parquet-damaged",
        _trace_workload("trace.parquet"),
        files={"trace.parquet": b"PAR1 not really"},
        fragment="trace.parquet: not a readable Parquet file",
    ),
    Case(
        "trace-gzip-truncated",
        _trace_workload("trace.csv.gz"),
        files={"trace.csv.gz": gzip.compress(AZURE_OK.encode())[:30]},
        fragment="trace.csv.gz: cannot read it",
    ),
    Case(
        "trace-tokens-beyond-any-context",
        _trace_workload(),
        files={"trace.csv": AZURE_OK + "2023-11-16 18:15:48.00,99999999999999999999,12\n"},
        fragment="trace.csv: line 4: ContextTokens '99999999999999999999' is more than 10,000,000 tokens",
    ),  # was an overflowing cast, then a traceback building the per-second table
    Case(
        "trace-span-too-long",
        _trace_workload(fmt="mapped", columns=MAPPED),
        files={"trace.csv": "t,p,o\n0,10,5\n1e12,10,5\n"},
        fragment="trace.csv: its requests span 1e+12 s as replayed (after speedup): at most 1e+06 s",
    ),
    Case(
        "trace-speedup-tiny",
        _trace_workload(fmt="mapped", columns=MAPPED, speedup=1e-300),
        files={"trace.csv": "t,p,o\n0,10,5\n1,10,5\n"},
        fragment="trace.csv: its requests span 1e+300 s",
    ),
    Case(
        "trace-mapped-without-columns-is-one-problem",
        _trace_workload(fmt="mapped"),
        files={"trace.csv": "t,p,o\n0,10,5\n"},
        fragment="workload.trace: format: mapped needs columns",
        absent="rate_rps",  # not also "required field is missing": a replay needs no rate
    ),
    Case(
        "service-time-trace-relative-to-the-scenario",
        _both(
            _classical(
                {"kind": "empirical", "trace": {"path": "trace.csv", "format": "azure"}},
                {"kind": "unconditional"},
            ),
            _set("workload.requests", 20),
        ),
        files={"trace.csv": AZURE_OK},
        code=0,
        fragment="simulated requests",  # was looked for in the current folder, and named no field
    ),
    Case(
        "service-time-trace-missing",
        _classical(
            {"kind": "empirical", "trace": {"path": "nope.csv", "format": "azure"}}, {"kind": "unconditional"}
        ),
        fragment="scenario.yaml: pools.0.engine.service_time.trace.path: trace 'nope.csv' not found",
    ),
    Case(
        "rate-is-true",
        _set("workload.rate_rps", True),
        fragment="workload.rate_rps: Input should be a number, not true",  # was read as 1 request/s
    ),
    Case(
        "replicas-set-to-yes",
        args=("--set", "pools.0.replicas=yes"),
        fragment="pools.0.replicas: Input should be a number, not true",
    ),
    Case(
        "set-breaks-a-rule-across-fields",  # named the file alone, where --set wrote the e2e_s that broke it
        _set("workload.tiers.0.slo", {"ttft_s": 1.0}),
        args=("--set", "workload.tiers.0.slo.e2e_s=0.5"),
        fragment="scenario.yaml and --set: workload.tiers.0.slo: e2e_s (0.5 s) under ttft_s (1 s)",
    ),
    Case(
        "pool-serves-unknown-tier",
        _set("pools.0.tiers", ["gold"]),
        fragment="scenario.yaml: pools.0.tiers: no tier 'gold' (tiers: interactive)",
    ),
    Case(
        "policy-name-given-twice",
        _set("policies", [{"kind": "unconditional"}, {"kind": "unconditional"}]),
        fragment="policies.1: policy name 'unconditional' is taken by policies.0",
    ),
    Case(
        "two-pools-one-name",  # was a traceback (the pool column's categories)
        _both(
            _set("workload.tiers", [TIER, {**TIER, "name": "batch"}]),
            _set(
                "pools",
                [{**BASE["pools"][0], "tiers": ["interactive"]}, {**BASE["pools"][0], "tiers": ["batch"]}],
            ),
        ),
        fragment="pools.1: pool name 'p' is taken by pools.0",
    ),
    Case(
        "two-variants-one-name",  # both ran, their requests mixed under one key
        _set("variants", [{"name": "a", "set": {}}, {"name": "a", "set": {"workload.rate_rps": 2}}]),
        fragment="variants.1: variant name 'a' is taken by variants.0",
    ),
    Case(
        "tier-named-all",  # its summary was overwritten by every tier's together
        _set("workload.tiers.0.name", "all"),
        fragment="workload.tiers.0.name: 'all' is what the summary calls every tier together",
    ),
    Case(
        "tier-named-like-a-pool",
        _set("workload.tiers.0.name", "pool:p"),
        fragment="workload.tiers.0.name: 'pool:p' is what the summary calls a pool",
    ),
    Case("tier-without-a-name", _set("workload.tiers.0.name", ""), fragment="workload.tiers.0.name: String"),
    Case(
        "api-key-no-header-can-carry",  # ran, the key never matching: the header's value is trimmed
        _set("gateway.http", {"api_keys": {"sk-ok": "interactive", " sk-padded ": "interactive"}}),
        fragment="scenario.yaml: gateway.http.api_keys: key 2 of 2 is empty, has spaces at an end or a control "
        "character: no `Authorization: Bearer KEY` header could carry it",
        absent="sk-padded",
    ),
    Case(
        "api-key-empty",
        _set("gateway.http", {"api_keys": {"": "interactive"}}),
        fragment="scenario.yaml: gateway.http.api_keys: key 1 of 1 is empty",
    ),
    Case(
        "api-key-of-unknown-tier",
        _set("gateway.http", {"api_keys": {"sk-secret-1": "gold"}}),
        fragment="gateway.http.api_keys: an API key maps to no tier 'gold' (tiers: interactive)",
        absent="sk-secret-1",
    ),
    Case(
        "profile-is-a-folder",
        _set("pools.0.profile", "."),
        fragment="pools.0.profile: profile '.' is a folder, not a profile file",
    ),
    Case(
        "profile-is-a-scenario",  # twelve lines: each profile field missing, each scenario section unknown
        _set("pools.0.profile", "other.yaml"),
        files={"other.yaml": yaml.safe_dump(BASE)},
        fragment="other.yaml: is a scenario, not a calibration profile",
    ),
    Case(
        "profile-empty-file",
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": ""},
        fragment="p.yaml: empty file: a calibration profile is a YAML mapping of its fields",
    ),
    Case(
        "profile-cost-infinite",
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(**{"step_time.per_decode_seq_s": float("inf")})},
        fragment="p.yaml: step_time.per_decode_seq_s: Input should be a finite number",
    ),
    Case(
        "profile-context-shorter-than-every-request",  # was a run of 100% "reject", nothing measured
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(**{"engine.max_model_len": 50})},
        fragment="scenario.yaml: workload.tiers.0: every request of tier 'interactive' is longer than its pool takes "
        "(prompt + max_tokens at least 164 tokens; the pool's context or KV capacity holds 50)",
    ),
    Case(
        "profile-kv-cache-of-one-block",  # said the pool's KV capacity holds 0 tokens, not why
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(kv_capacity_tokens=16)},
        fragment="p.yaml: kv_capacity_tokens 16 tokens hold no KV block for a sequence (blocks of 16 tokens, and "
        "vLLM keeps one back as its null block): the engine could hold no request",
    ),
    Case(
        "engine-kv-cache-under-two-blocks",  # blamed the scenario for a capacity of 0, not --set's 30 tokens
        args=("--set", "pools.0.engine={kv_capacity_tokens: 30}"),
        fragment="--set: pools.0.engine.kv_capacity_tokens: 30 tokens hold no KV block for a sequence (blocks of 16 "
        "tokens, and vLLM keeps one back as its null block): the engine could hold no request (the block size is "
        "the profile's)",
    ),
    Case(
        "variant-engine-seqs-above-the-token-budget",  # ran the variant with a batch vLLM would refuse
        _set("variants", [{"name": "big", "set": {"pools.0.engine.max_num_seqs": 100000}}]),
        fragment="scenario.yaml: variants.0 (big): pools.0.engine: max_num_batched_tokens (8192) is below "
        "max_num_seqs (100000)",
    ),
    Case(
        "variant-engine-kv-cache-of-one-block",  # ran, the variant's pool holding no request
        args=("--set", "variants=[{name: tiny-kv, set: {pools.0.engine.kv_capacity_tokens: 16}}]"),
        fragment="--set: variants.0 (tiny-kv): pools.0.engine.kv_capacity_tokens: 16 tokens hold no KV block for a "
        "sequence",
    ),
    Case(
        "variant-profile-not-found",  # an AssertionError traceback: only the scenario's own profiles were looked for
        _set("variants", [{"name": "v", "set": {"pools.0.profile": "nope.yaml"}}]),
        fragment="scenario.yaml: variants.0 (v): pools.0.profile: profile 'nope.yaml' not found",
    ),
    Case(
        "variant-trace-relative-to-the-scenario",  # was looked for in the current folder
        _set(
            "variants",
            [
                {
                    "name": "v",
                    "set": {"workload.tiers.0.prompt_tokens": EMPIRICAL},
                }
            ],
        ),
        files={"trace.csv": AZURE_OK},
        code=0,
        fragment="simulated requests",
    ),
    Case(
        "variant-set-of-a-list-element-not-there",  # blamed --set, where the scenario file's variant wrote it
        _set("variants", [{"name": "v", "set": {"pools.nope.replicas": 2}}]),
        fragment="scenario.yaml: variants.0 (v): set: pools.nope.replicas: no element 'nope' in this list",
        absent="--set",
    ),
    Case(
        "set-a-key-of-a-variants-set",  # walked into a new mapping `workload`: "replaces workload.rate_rps"
        _set("variants", [{"name": "v", "set": {"workload.rate_rps": 3}}]),
        args=("--set", "variants.v.set.workload.rate_rps=0"),
        fragment="variants.0 (v): workload.rate_rps: Input should be greater than 0",
        absent="replaces",
    ),
    Case(
        "profile-context-shorter-than-some-requests",  # a run, its rejections explained
        _both(
            _set("pools.0.profile", "p.yaml"),
            _set("workload.tiers.0.prompt_tokens", {"kind": "empirical", "values": [50, 150]}),
        ),
        files={"p.yaml": _profile(**{"engine.max_model_len": 200})},
        code=0,
        fragment="answered 400 and counted as rejected: interactive",
    ),
    Case(
        "profile-overhead-huge",
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(**{"step_time.overhead_s": 1e30})},
        fragment="p.yaml: step_time: one request filling the context (engine.max_model_len, 131072 tokens) "
        "would take 1.31e+35 s",
    ),
    Case(
        "profile-costs-all-zero",  # every request served at once, whatever the load: a table of zeros
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(**{f"step_time.{f.name}": 0.0 for f in fields(StepTimeModel)})},
        fragment="p.yaml: step_time: every coefficient is 0: a step would take no time",
    ),
    Case(
        "profile-gpus-true",
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(gpus_per_replica=True)},
        fragment="p.yaml: gpus_per_replica: Input should be a number, not true",
    ),
    Case(
        "profile-gpus-huge",  # every GPU-second and paid GPU figure multiplied by 10^15, silently
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(gpus_per_replica=10**15)},
        fragment="p.yaml: gpus_per_replica: Input should be less than or equal to 1024",
    ),
    Case(
        "profile-tensor-parallel-beyond-its-gpus",  # a replica of 1 GPU split 8 ways: accepted, silently
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(tensor_parallel=8)},
        fragment="p.yaml: tensor_parallel: must divide gpus_per_replica (1)",
    ),
    Case(
        "profile-huge-kv-block",  # allocated per block phase: 53 s and gigabytes for 39 requests
        _set("pools.0.profile", "p.yaml"),
        files={"p.yaml": _profile(kv_block_size=10**9)},
        fragment="p.yaml: kv_block_size: Input should be less than or equal to 65536",
    ),
    Case(
        "field-of-a-kind-named-by-its-path",  # "prompt_tokens.lognormal.sigma": no such key in the file
        _set("workload.tiers.0.prompt_tokens", {"kind": "lognormal", "median": 100}),
        fragment="scenario.yaml: workload.tiers.0.prompt_tokens.sigma: required field is missing",
    ),
    Case(
        "engine-field-without-a-kind",  # "pools.0.engine.continuous.max_num_seqs"
        _set("pools.0.engine", {"max_num_seqs": 0}),
        fragment="scenario.yaml: pools.0.engine.max_num_seqs: Input should be greater than 0",
    ),
    Case(
        "variant-name-with-a-slash",  # variant a/x with policy y and variant a with policy x/y: one run a/x/y
        _both(
            _set("variants", [{"name": "a/x", "set": {}}, {"name": "a", "set": {}}]),
            _set(
                "policies", [{"kind": "unconditional", "name": "y"}, {"kind": "unconditional", "name": "x/y"}]
            ),
        ),
        fragment="variants.0.name: 'a/x' names table rows, results and files: no /, \\ or control characters",
    ),
    Case(
        "policy-kind-unknown",
        _set("policies.0", {"kind": "fifo"}),
        fragment="policies.0: Input tag 'fifo' found using 'kind' does not match any of the expected tags",
    ),
    Case(
        "policies-not-a-list",
        _set("policies", {"kind": "unconditional"}),
        fragment="policies: Input should be a valid list",
    ),
    Case(
        "replications-huge",
        args=("--replications", str(10**20)),
        fragment="Invalid value for '--replications'",  # the command line's own check, before anything runs
    ),
    # --- values ---
    Case(
        "rate-inf",
        _set("workload.rate_rps", float("inf")),
        fragment="workload.rate_rps: Input should be a finite",
    ),
    Case(
        "rate-multiplier-inf",
        _set("workload.rate_multiplier", float("inf")),
        fragment="workload.rate_multiplier",
    ),
    Case("rate-nan", _set("workload.rate_rps", float("nan")), fragment="workload.rate_rps"),
    Case("negative-seed-option", args=("--seed", "-1"), fragment="--seed: must be a whole number from 0"),
    Case("negative-seed-field", _set("workload.seed", -3), fragment="workload.seed"),
    Case(
        "seed-at-the-top-with-replications",  # "must be a whole number from 0 to 2^63 - 1, got 2^63 - 1"
        args=("--seed", str(2**63 - 1), "--replications", "2"),
        fragment="--seed: 9223372036854775807: replication r runs seed + r, so with 2 replications the seed must",
    ),
    Case(
        "set-not-yaml",
        args=("--set", "workload.rate_rps=[1, 2"),
        fragment="--set: workload.rate_rps=[1, 2: not valid YAML",
    ),
    Case(
        "autoscaler-utilization-target-above-1",  # ran, and never scaled up
        _set(
            "pools.0.autoscaler",
            {"metric": "gpu_utilization", "target": 1.5, "min_replicas": 1, "max_replicas": 2},
        ),
        fragment="pools.0.autoscaler.target: 1.5 for gpu_utilization, a busy fraction: at most 1",
    ),
    Case(
        "autoscaler-starting-above-its-max-replicas",  # ran 5 replicas throughout a run shorter than one sync
        _both(
            _set("pools.0.replicas", 5),
            _set("pools.0.autoscaler", {"metric": "gpu_utilization", "target": 0.7, "max_replicas": 3}),
        ),
        fragment="scenario.yaml: pools.0: replicas (5) outside autoscaler.min_replicas..max_replicas (1..3)",
    ),
    Case(
        "token-bucket-burst-under-every-prompt",  # ran, every request of the tier rejected, said nowhere
        _set("policies", [{"kind": "token_bucket", "tiers": {"interactive": {"rate": 1000, "burst": 50}}}]),
        fragment="scenario.yaml: policies.0.tiers.interactive.burst: 50 tokens, under every request of tier "
        "'interactive' (prompt at least 100 tokens): the policy would pass none of them",
    ),
    Case(
        "rate-limit-tpm-under-every-request",  # ran, every request of the tier rejected, said nowhere
        _set("policies", [{"kind": "rate_limit", "tiers": {"interactive": {"tpm": 100}}}]),
        fragment="scenario.yaml: policies.0.tiers.interactive.tpm: 100 tokens, under every request of tier "
        "'interactive' (prompt + max_tokens at least 164 tokens)",
    ),
    Case(
        "rate-limit-rpm-under-one",  # ran: a one-minute window passes no request under 1 a minute
        _set("policies", [{"kind": "rate_limit", "tiers": {"interactive": {"rpm": 0.5}}}]),
        fragment="scenario.yaml: policies.0.tiers.interactive.rpm: 0.5 a minute: a one-minute window passes whole "
        "requests, so none (at least 1)",
    ),
    Case(
        "autoscaler-tolerance-of-a-whole",  # ran, and never scaled down (no ratio is under 1 - 5)
        _set(
            "pools.0.autoscaler",
            {"metric": "queue_wait", "target": 2, "max_replicas": 2, "tolerance": 5},
        ),
        fragment="pools.0.autoscaler.tolerance: Input should be less than 1",
    ),
    Case(
        "set-a-variant-of-an-unknown-field",  # blamed the scenario file for what --set wrote
        args=("--set", "variants=[{name: a, set: {nope: 1}}]"),
        fragment="--set: variants.0 (a): nope",
    ),
    Case("set-no-equals", args=("--set", "workload.rate_rps"), fragment="expected path=value"),
    Case(
        "set-one-path-twice",  # the last one silently won
        args=("--set", "workload.rate_rps=2", "--set", "workload.rate_rps=3"),
        fragment="--set: workload.rate_rps=3: workload.rate_rps is set twice",
    ),
    Case(
        "section-not-a-mapping",  # "Input should be a valid dictionary or instance of SLOSpec"
        _set("workload.tiers.0.slo", 3),
        fragment="scenario.yaml: workload.tiers.0.slo: Input should be a mapping of fields, not int",
    ),
    Case(
        "section-left-empty",  # "not NoneType": `clients:` with every field under it commented out
        _set("clients", None),
        fragment="scenario.yaml: clients: Input should be a mapping of fields, not empty (nothing is written under it)",
    ),
    Case(
        "set-empty-path-part",
        args=("--set", "workload..rate_rps=3"),
        fragment="--set: workload..rate_rps: a path has no empty part",  # was "workload.: unknown field"
    ),
    Case(
        "warmup-after-duration",
        _set("workload.warmup_s", 10),
        fragment="workload.warmup_s: 10 s of warm-up leaves nothing of duration_s (4 s)",
    ),
    Case(
        "default-warmup-short-duration",
        args=("--set", "workload.duration_s=5"),
        scenario_text="default",
        fragment="workload.warmup_s: 10 s of warm-up",
    ),
    Case(
        "requests-all-in-warmup",
        _both(
            _set("workload.duration_s", None), _set("workload.requests", 3), _set("workload.warmup_s", 100)
        ),
        fragment="workload.warmup_s: every request arrives within the warm-up",
    ),
    Case(
        "profile-curve-ends-at-zero-with-requests",
        _both(
            _set("workload.duration_s", None),
            _set("workload.requests", 50),
            _set("workload.arrival", {"kind": "profile", "points": [[0, 1], [2, 0]]}),
        ),
        fragment="workload.requests: the arrival profile ends at rate 0",
    ),
    Case(
        "profile-curve-times-decrease",
        _set("workload.arrival", {"kind": "profile", "points": [[0, 1], [5, 2], [3, 1]]}),
        fragment="workload.arrival: times must start at 0 and never decrease",
    ),
    Case(
        "duration-huge",
        _set("workload.duration_s", 1e9),
        fragment="workload.duration_s: 1e+09 s at 4 req/s is about 4e+09 requests",
    ),
    Case(
        "profile-factor-huge",  # "4 s at 4 req/s is about 1.6e+10 requests": the curve's factor unsaid
        _set("workload.arrival", {"kind": "profile", "points": [[0, 1e9]]}),
        fragment="workload.duration_s: 4 s at 4e+09 req/s on average (rate_rps x the arrival curve) is about",
    ),
    Case(
        "profile-factor-astronomical",  # the memory it would take printed as a number of 296 digits
        _set("workload.arrival", {"kind": "profile", "points": [[0, 1e300]]}),
        fragment="requests (~2.98e+295 GiB in memory for 1 policies)",
    ),
    Case(
        "requests-huge",
        _both(_set("workload.duration_s", None), _set("workload.requests", 10**12)),
        fragment="workload.requests: 1e+12 requests",
    ),
    Case(
        "lognormal-min-above-max",
        _set(
            "workload.tiers.0.prompt_tokens",
            {"kind": "lognormal", "median": 100, "sigma": 1, "min": 500, "max": 50},
        ),
        fragment="min (500) must not exceed max (50)",
    ),
    Case(
        "fixed-output-of-a-fraction-of-a-token",  # silently 1 token
        _set("workload.tiers.0.output_tokens", {"kind": "fixed", "value": 0.4}),
        fragment="scenario.yaml: workload.tiers.0.output_tokens: value 0.4 is not a token count (a whole number >= 1)",
    ),
    Case(
        "fixed-prompt-of-a-fraction-of-a-token",  # silently rounded
        _set("workload.tiers.0.prompt_tokens", {"kind": "fixed", "value": 100.5}),
        fragment="workload.tiers.0.prompt_tokens: value 100.5 is not a token count (a whole number >= 1)",
    ),
    Case(
        "lognormal-token-min-of-a-fraction",  # a clip below 0.5 token: no clip, as token counts are >= 1
        _set("workload.tiers.0.prompt_tokens", {"kind": "lognormal", "median": 100, "sigma": 1, "min": 0.5}),
        fragment="workload.tiers.0.prompt_tokens: min 0.5 is not a token count (a whole number >= 1)",
    ),
    Case(
        "empirical-token-values-of-fractions",
        _set("workload.tiers.0.output_tokens", {"kind": "empirical", "values": [10, 2.5]}),
        fragment="workload.tiers.0.output_tokens: values: one of them, 2.5 is not a token count",
    ),
    Case(
        "tier-start-after-end",
        _both(_set("workload.tiers.0.start_s", 3), _set("workload.tiers.0.end_s", 2)),
        fragment="workload.tiers.0: end_s (2) must be after start_s (3)",
    ),
    Case(
        "negative-wait-budget",
        _set("policies.0", {"kind": "gpu_seconds", "budgets_s": {"interactive": -1}}),
        fragment="policies.0.budgets_s.interactive: Input should be greater than 0",
    ),
    Case(
        "budget-for-unknown-tier",
        _set("policies.0", {"kind": "gpu_seconds", "budgets_s": {"interactve": 3}}),
        fragment="policies.0.budgets_s.interactve: no tier 'interactve' (tiers: interactive)",
    ),
    Case(
        "tier-cap-for-unknown-tier",
        _set("policies.0", {"kind": "gpu_seconds", "tier_max_gpu_seconds": {"bulk": 3}}),
        fragment="policies.0.tier_max_gpu_seconds.bulk: no tier 'bulk'",
    ),
    *(  # each used to run with the setting silently never applied
        Case(
            f"{policy['kind']}-of-unknown-tier",
            _set("policies.0", policy),
            fragment=f"policies.0.{where}: no tier",
        )
        for policy, where in (
            ({"kind": "predicted_ttft", "budgets_s": {"bulk": 1.0}}, "budgets_s.bulk"),
            ({"kind": "saturation", "critical": ["interactive", "bulk"]}, "critical.1"),
            ({"kind": "token_bucket", "tiers": {"bulk": {"rate": 10, "burst": 100}}}, "tiers.bulk"),
            ({"kind": "rate_limit", "tiers": {"bulk": {"rpm": 10}}}, "tiers.bulk"),
            ({"kind": "post_hoc_tokens", "tokens_per_minute": {"bulk": 1000}}, "tokens_per_minute.bulk"),
        )
    ),
    *(  # each used to run: every request rejected, or a limit of nothing
        Case(
            f"{policy['kind']}-{where}-not-positive",
            _set("policies.0", policy),
            fragment=f"{where}: Input should be greater than 0",
        )
        for policy, where in (
            ({"kind": "predicted_ttft", "budgets_s": {"interactive": -1}}, "budgets_s.interactive"),
            ({"kind": "predicted_ttft", "e2e_budgets_s": {"interactive": 0}}, "e2e_budgets_s.interactive"),
            (
                {"kind": "post_hoc_tokens", "tokens_per_minute": {"interactive": -5}},
                "tokens_per_minute.interactive",
            ),
        )
    ),
    Case(
        "engine-batched-tokens-below-seqs",
        _set("pools.0.engine", {"max_num_seqs": 256, "max_num_batched_tokens": 128}),
        fragment="pools.0.engine: max_num_batched_tokens (128) is below max_num_seqs (256)",
    ),
    Case(
        "engine-batched-tokens-below-profile-seqs",
        _set("pools.0.engine", {"max_num_batched_tokens": 16}),
        fragment="max_num_batched_tokens (16) is below max_num_seqs",
    ),
    Case(
        "tier-served-by-two-pools",
        _set(
            "pools",
            [
                {"name": "a", "profile": PROFILE, "replicas": 1},
                {"name": "b", "profile": PROFILE, "replicas": 1, "tiers": ["interactive"]},
            ],
        ),
        fragment="pools.1.tiers: tier 'interactive' is already served by pool 'a' (pools.0)",
    ),
    Case(
        "replicas-huge",
        _set("pools.0.replicas", 10**12),
        fragment="pools.0.replicas: Input should be less than or equal to",
    ),
    Case(
        "poll-interval-tiny",
        _set("gateway.poll_interval_s", 1e-12),
        fragment="gateway.poll_interval_s: Value error, must be 0"[:24],
    ),
    # --- defaults that used to distort what the user wrote (checked on summary.json; theory in
    # tests/test_queue_semantics.py): an M/G/1 at rho = 0.8 and an M/M/1/1 loss system at a = 0.8 ---
    Case(
        "lognormal-service-time-is-not-clipped",
        _classical({"kind": "lognormal", "median": 0.5, "sigma": 1.0}, {"kind": "unconditional"}),
        code=0,
        fragment="simulated requests",
        summary=lambda s: 0.74 < s["unconditional"]["all"]["utilization"] < 0.86,  # not 1.0, as with min 1
    ),
    Case(
        "gpu-seconds-without-a-budget-per-tier",  # a TypeError traceback: max() of the default budget alone
        _set("policies", [{"kind": "gpu_seconds", "budgets_s": {}}]),
        code=0,
        fragment="simulated requests",
    ),
    Case(
        "saturation-kv-threshold-as-a-percent",  # ran, the cache never 80 times full: never saturated
        _set("policies", [{"kind": "saturation", "kv_cache_threshold": 80}]),
        fragment="policies.0.kv_cache_threshold: 80: a fraction of the KV cache, at most 1 (for 80% write 0.8)",
    ),
    Case(
        "predicted-ttft-e2e-budget-under-its-ttft-budget",  # ran, the TTFT budget never binding: the two swapped
        _set(
            "policies",
            [
                {
                    "kind": "predicted_ttft",
                    "budgets_s": {"interactive": 2},
                    "e2e_budgets_s": {"interactive": 1},
                }
            ],
        ),
        fragment="policies.0: e2e_budgets_s.interactive (1 s) under budgets_s.interactive (2 s)",
    ),
    Case(
        "rate-limit-of-a-tier-without-a-limit",  # ran as listed and limited, and never was
        _set("policies", [{"kind": "rate_limit", "tiers": {"interactive": {}}}]),
        fragment="policies.0.tiers.interactive: give rpm, tpm or both",
    ),
    Case(
        "queue-depth-zero-is-a-loss-system",
        _classical(
            {"kind": "exponential", "mean": 0.5 * math.exp(0.5)}, {"kind": "queue_depth", "max_queued": 0}
        ),
        code=0,
        fragment="simulated requests",
        summary=lambda s: (
            abs(s["queue_depth"]["all"]["rejection_rate"] - 0.8 / 1.8) < 0.05
            and s["queue_depth"]["all"]["queue_wait_mean_s"] == 0
        ),  # Erlang B, nobody waits
    ),
    *(  # each was read as 1: a budget of 1 s, a length of 1 token, a priority of 1
        Case(
            f"true-inside-{where}", _set(path, value), fragment=f"{where}: Input should be a number, not true"
        )
        for path, value, where in (
            (
                "policies.0",
                {"kind": "gpu_seconds", "budgets_s": {"interactive": True}},
                "budgets_s.interactive",
            ),
            (
                "workload.tiers.0.prompt_tokens",
                {"kind": "empirical", "values": [True, 5]},
                "prompt_tokens.values.0",
            ),
            ("workload.arrival", {"kind": "profile", "points": [[0, True]]}, "arrival.points.0.1"),
            (
                "pools.0.engine",
                {"scheduling": "priority", "tier_priority": {"interactive": True}},
                "tier_priority.interactive",
            ),
        )
    ),
    Case(
        "gamma-cv-tiny",  # a traceback: the gamma shape 1 / cv^2 divided by zero
        _set("workload.arrival", {"kind": "gamma", "cv": 1e-300}),
        fragment="workload.arrival.cv: Input should be greater than or equal to 0.001",
    ),
    Case(
        "mmpp-periods-tiny",  # hung: a calm period and a burst per 1e-300 s of the run
        _set("workload.arrival", {"kind": "mmpp", "burst_factor": 2, "calm_s": 1e-300, "burst_s": 1e-300}),
        fragment="scenario.yaml: workload: arrival.calm_s 1e-300 s and burst_s 1e-300 s switch state about "
        "4e+300 times in the run's 4 s: at most 10,000,000",
    ),
    Case(
        "lognormal-min-huge",  # every token count 1e300: all refused as too long, without a word
        _set(
            "workload.tiers.0.prompt_tokens", {"kind": "lognormal", "median": 100, "sigma": 1, "min": 1e300}
        ),
        fragment="workload.tiers.0.prompt_tokens.min: Input should be less than or equal to 10000000",
    ),
    Case(
        "service-time-min-beyond-the-timeline",  # a traceback: the min was not counted in its reach
        _classical({"kind": "lognormal", "median": 1, "sigma": 0, "min": 2e6}, {"kind": "unconditional"}),
        fragment="pools.0.engine.service_time: one draw in a million reaches 2e+06 s: at most 1e+06 s",
    ),
    Case(
        "autoscaler-target-tiny",  # a traceback: metric / target overflowed to infinity
        _set(
            "pools.0.autoscaler",
            {
                "metric": "queue_wait",
                "target": 1e-320,
                "min_replicas": 1,
                "max_replicas": 2,
                "sync_period_s": 1,
            },
        ),
        code=0,
        fragment="simulated requests",
    ),
    Case(
        "set-nested-too-deeply",  # a RecursionError from the YAML parser
        args=("--set", "workload.rate_rps=" + "[" * 100_000),
        fragment="[[[: not valid YAML (nested too deeply)",
    ),
    *(  # each was a traceback (RecursionError, ValueError)
        Case(
            f"trace-jsonl-{what}",
            _trace_workload("trace.jsonl", "mooncake"),
            files={"trace.jsonl": MOONCAKE_OK + line + "\n"},
            fragment=f"trace.jsonl: line 2: not valid JSON ({reason})",
        )
        for what, line, reason in (
            ("nested-too-deeply", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
            ("number-of-5000-digits", '{"timestamp": ' + "9" * 5000 + "}", "a number too long"),
        )
    ),
    Case(
        "trace-csv-field-too-long",  # a traceback: the csv module's field limit
        _trace_workload(fmt="mapped", columns=MAPPED),
        files={"trace.csv": "t,p,o,x\n0,10,5,a\n1,10,5," + "a" * 200_000 + "\n"},
        fragment="trace.csv: line 3: not a CSV record (field larger than field limit (131072))",
    ),
    Case(
        "tier-name-with-a-slash",  # ran; then `plot` of a sweep was a traceback, `compare` "could not write"
        _set("workload.tiers.0.name", "a/b"),
        fragment="workload.tiers.0.name: 'a/b' names table rows, results and files: no /, \\ or control",
    ),
    Case(
        "policy-name-with-a-newline",  # the tables' policy rows and the notes broke over two lines
        _set("policies.0.name", "gpu\nseconds"),
        fragment="policies.0.name: 'gpu\\nseconds' names table rows, results and files: no /, \\ or control",
    ),
    Case(
        "pool-name-with-a-slash",
        _set("pools.0.name", "a/b"),
        fragment="pools.0.name: 'a/b' names table rows, results and files: no /, \\ or control",
    ),
    Case(
        "scenario-name-with-a-tab",
        _set("name", "a\tb"),
        fragment="scenario.yaml: name: 'a\\tb' names table rows, results and files",
    ),
    Case(
        "tier-shares-overflow",  # their sum overflowed: every request went to the second tier
        _set("workload.tiers", [{**TIER, "share": 1e308}, {**TIER, "name": "batch", "share": 1e308}]),
        fragment="workload.tiers.0.share: Input should be less than or equal to 1000000000000",
    ),
    *(  # ran, with goodput and throughput divided by 1e-9 s: 1,000,000,000 requests/s
        Case(
            f"trace-{what}",
            _trace_workload(),
            files={"trace.csv": AZURE_HEADER + rows},
            fragment="scenario.yaml: workload: every measured request arrives at the same instant (0 s; within 1 ms)",
        )
        for what, rows in (
            ("of-one-row", "2023-11-16 18:15:46.68,374,44\n"),
            ("all-at-one-instant", "2023-11-16 18:15:46.68,374,44\n" * 50),
        )
    ),
    Case(
        "trace-speedup-huge",  # two arrivals 3.2e-301 s apart: goodput 2,000,000,000 requests/s
        _trace_workload(speedup=1e300),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload: every measured request arrives at the same instant (3.2e-301 s",
    ),
    Case(
        "trace-length-rule-matching-nothing",  # ran, the rule never applied
        _trace_workload(tiers={"by": "length", "rules": [{"tier": "t", "above": 500, "at_most": 10}]}),
        files={"trace.csv": AZURE_OK},
        fragment="workload.trace.tiers.rules.0: at_most (10) must exceed above (500): the rule would match no",
    ),
    Case(
        "profile-path-empty",  # "profile '' is a folder": the scenario's own folder
        _set("pools.0.profile", ""),
        fragment="scenario.yaml: pools.0.profile: String should have at least 1 character",
    ),
    Case(
        "trace-path-is-a-device",  # "trace '/dev/null' not found"
        _trace_workload("/dev/null"),
        fragment="workload.trace.path: trace '/dev/null' is not a regular file (a device, pipe or socket)",
    ),
    Case(
        "key-null",  # "None: Keys should be strings"
        lambda d: d.update({None: "x"}),
        fragment="scenario.yaml: the key null is not a name: write it in quotes if it is one ('null': ...)",
    ),
    Case(
        "key-null-of-a-mapping",  # "policies.0.gpu_seconds.budgets_s.None.[key]: Input should be a valid string"
        _set("policies.0", {"kind": "gpu_seconds", "budgets_s": {None: 3}}),
        fragment="policies.0.budgets_s: the key null is not a name",
    ),
    Case(
        "set-blank-path",  # "--set: a path has no empty part", without the item typed
        args=("--set", " =2"),
        fragment="--set:  =2: expected path=value",
    ),
    Case(
        "trace-times-past-float-range",  # the request 2e308 s later was silently dropped, and the run went on
        _trace_workload(fmt="mapped", columns=MAPPED),
        files={"trace.csv": "t,p,o\n1e308,10,5\n-1e308,10,5\n"},
        fragment="trace.csv: its requests span inf s as replayed (after speedup): at most 1e+06 s",
    ),
    Case(
        "trace-csv-column-twice",  # the first of the two was read, silently
        _trace_workload(fmt="mapped", columns=MAPPED),
        files={"trace.csv": "t,p,o,p\n0,10,5,7\n1,10,5,7\n"},
        fragment="trace.csv: line 1: column 'p' is in the header twice",
    ),
    Case(
        "trace-jsonl-key-twice",  # the last of the two was read, silently
        _trace_workload("trace.jsonl", "mooncake"),
        files={"trace.jsonl": MOONCAKE_OK + '{"timestamp": 1, "input_length": 50, "input_length": 9}\n'},
        fragment="trace.jsonl: line 2: not valid JSON (key 'input_length' given twice)",
    ),
    Case(
        "variant-sets-variants",  # ran, the inner variants never
        _set("variants", [{"name": "v", "set": {"variants": [{"name": "w", "set": {}}]}}]),
        fragment="scenario.yaml: variants.0.set: a variant cannot set variants",
    ),
    Case(
        "pool-tiers-empty",  # a pool listing no tier served them all
        _set("pools.0.tiers", []),
        fragment="pools.0.tiers: List should have at least 1 item",
    ),
    Case(
        "pool-lists-a-tier-twice",  # "tier 'interactive' is already served by pool 'p' (pools.0)": itself
        _set("pools.0.tiers", ["interactive", "interactive"]),
        fragment="scenario.yaml: pools.0.tiers: tier 'interactive' is listed twice",
        absent="already served",
    ),
    Case(
        "engine-kind-unknown",  # "Input tag 'magic' found using _engine_kind() does not match ..."
        _set("pools.0.engine", {"kind": "magic"}),
        fragment="pools.0.engine: kind must be 'continuous' (the default) or 'classical'",
    ),
    Case(
        "policy-without-kind",  # "policies.0: Unable to extract tag using discriminator 'kind'"
        _set("policies.0", {"max_queued": 3}),
        fragment="scenario.yaml: policies.0.kind: required field is missing",
    ),
    Case(
        "policy-not-a-mapping",  # "Input should be a valid dictionary or object to extract fields from"
        _set("policies.0", "unconditional"),
        fragment="policies.0: Input should be a mapping of fields, not str",
    ),
    Case(
        "polls-beyond-count",  # hung: 10^10 polls of a day-long run
        _both(
            _set("workload.duration_s", 100_000),
            _set("workload.rate_rps", 0.001),
            _set("gateway", {"poll_interval_s": 0.001, "replicas": 100}),
        ),
        fragment="gateway.poll_interval_s: 0.001 s: 100 gateway replicas polling until the last arrival",
    ),
    Case(
        "autoscaler-syncs-beyond-count",  # hung: 10^9 syncs
        _both(
            _set("workload.duration_s", 1_000_000),
            _set("workload.rate_rps", 0.0001),
            _set(
                "pools.0.autoscaler",
                {
                    "metric": "queue_wait",
                    "target": 1,
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "sync_period_s": 0.001,
                },
            ),
        ),
        fragment="pools.0.autoscaler.sync_period_s: 0.001 s until the last arrival",
    ),
    Case(
        "set-whole-number-in-e-notation",  # "Input should be a valid integer, unable to parse string as an integer"
        args=("--set", "pools.0.replicas=1e3"),
        fragment="pools.0.replicas: '1e3' is text to YAML (a number needs a dot and a signed exponent, 1.0e+3): "
        "write 1000",
    ),
    Case(
        "sixty-five-pools",  # simulated, then a traceback writing the tables (np.choose takes 64 arrays)
        _both(
            _set("workload.tiers", [{**TIER, "name": f"t{i}"} for i in range(65)]),
            _set(
                "pools",
                [{"name": f"p{i}", "profile": PROFILE, "replicas": 1, "tiers": [f"t{i}"]} for i in range(65)],
            ),
        ),
        code=0,
        fragment="simulated requests",
    ),
    Case(
        "trace-dates-centuries-apart",  # ran: 585 years wrapped around int64 nanoseconds to 0.71 s
        _trace_workload(),
        files={"trace.csv": AZURE_HEADER + "1677-09-21 00:12:43,374,44\n2262-04-11 23:47:16,396,109\n"},
        fragment="trace.csv: its requests span 1.84e+10 s as replayed (after speedup): at most 1e+06 s",
    ),
    Case(
        "trace-columns-of-another-format",  # the mapping was silently ignored
        _trace_workload(columns=MAPPED),
        files={"trace.csv": AZURE_OK},
        fragment="workload.trace: columns apply to format: mapped (format azure reads its own columns)",
    ),
    Case(
        "trace-mapped-prompt-and-output-on-one-column",  # ran, every output as long as its prompt
        _trace_workload("trace.csv", "mapped", columns={**MAPPED, "output_tokens": "p"}),
        files={"trace.csv": "t,p,o\n0,100,20\n0.5,200,30\n"},
        fragment="scenario.yaml: workload.trace.columns: prompt_tokens and output_tokens both map column 'p'",
    ),
    Case(
        "trace-fixed-max-tokens-with-a-factor",  # ran, every client sending 64: the factor silently ignored
        _trace_workload(max_tokens={"kind": "fixed", "value": 64, "factor": 2}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.max_tokens: factor and cap apply to kind scaled",
    ),
    Case(
        "trace-scaled-max-tokens-with-a-value",  # ran, the value silently ignored
        _trace_workload(max_tokens={"kind": "scaled", "value": 64}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.max_tokens: value applies to kind fixed",
    ),
    Case(
        "trace-fixed-max-tokens-without-a-value",
        _trace_workload(max_tokens={"kind": "fixed"}),
        files={"trace.csv": AZURE_OK},
        fragment="scenario.yaml: workload.trace.max_tokens: kind fixed needs value",
    ),
    Case(
        "trace-partial-columns-of-another-format",  # a line per column the map lacked, not why
        _trace_workload(columns={"prompt_tokens": "foo"}),
        files={"trace.csv": AZURE_OK},
        fragment="workload.trace: columns apply to format: mapped (format azure reads its own columns)",
        absent="required field is missing",
    ),
    Case(
        "set-value-its-tag-refuses",  # a traceback
        args=("--set", "name=!!bool x"),
        fragment="--set: name=!!bool x: not valid YAML ('x' is not a !!bool)",
    ),
    Case(
        "set-mapping-with-a-key-twice",  # the last silently won, as a scenario file refuses
        args=("--set", "workload.arrival={kind: gamma, kind: poisson}"),
        fragment="not valid YAML (key 'kind' given twice)",
    ),
    Case(
        "set-child-then-its-parent",  # the parent, applied after, silently undid the child
        args=("--set", "workload.rate_rps=2", "--set", "workload={seed: 1}"),
        fragment="--set: workload: replaces workload.rate_rps, set before it: set workload first",
    ),
    Case(
        "set-value-of-the-wrong-type",  # was reported as a mistake of scenario.yaml, which has none
        args=("--set", "workload.rate_rps=fast"),
        fragment="error: --set: workload.rate_rps: Input should be a valid number",
    ),
    Case(
        "set-unknown-field",  # "scenario.yaml: workload.nope: unknown field"
        args=("--set", "workload.nope=1"),
        fragment="error: --set: workload.nope: unknown field (misspelled?)",
    ),
    Case(
        "set-list-element-by-name",  # named by index, as validation names it
        args=("--set", "workload.tiers.interactive.share=-1"),
        fragment="error: --set: workload.tiers.0.share: Input should be greater than 0",
    ),
    Case(
        "set-list-index-with-two-minus-signs",  # a ValueError traceback from int('--1')
        args=("--set", "pools.--1.replicas=2"),
        fragment="error: --set: pools.--1.replicas: no element '--1' in this list",
    ),
    Case(
        "set-list-index-of-a-superscript-digit",  # '²' is a digit to str.isdigit, not to int(): a traceback
        args=("--set", "pools.\u00b2.replicas=2"),
        fragment="error: --set: pools.\u00b2.replicas: no element '\u00b2' in this list",
    ),
    Case(
        "set-profile-not-found",  # "scenario.yaml: pools.0.profile: profile 'nope' not found"
        args=("--set", "pools.0.profile=nope"),
        fragment="error: --set: pools.0.profile: profile 'nope' not found",
    ),
    Case(
        "set-no-value",  # "scenario.yaml: workload.rate_rps: required field is missing"
        args=("--set", "workload.rate_rps="),
        fragment="--set: workload.rate_rps=: no value after '='",
    ),
    Case(
        "set-control-character",
        args=("--set", "name=ti\x01ny"),
        fragment="not valid YAML (unacceptable character #x0001: special characters are not allowed)",
    ),
    Case(
        "set-time-of-day-number",  # YAML 1.1's base 60: silently 90 s
        args=("--set", "workload.duration_s=1:30"),
        fragment="error: --set: workload.duration_s: Input should be a valid number",
    ),
    *(  # each blamed the scenario file: "scenario.yaml: polices: unknown field"
        Case(
            f"set-{what}",
            args=("--set", assignment),
            scenario_text=scenario,
            fragment=f"error: --set: {message}",
        )
        for what, assignment, scenario, message in (
            ("unknown-section", "polices.gpu_seconds.headroom=0.8", "default", "polices: unknown field"),
            ("unknown-subsection", "gateway.htttp.max_body_bytes=5", None, "gateway.htttp: unknown field"),
            ("unknown-top-level-path", "nosuch.x=1", None, "nosuch: unknown field"),
            (
                "kind-without-its-fields",
                "workload.arrival.kind=gamma",
                "default",
                "workload.arrival.cv: required",
            ),
        )
    ),
    Case(
        "trace-parquet-list-cells",  # a traceback: a list cell compared with "" element by element
        _trace_workload("trace.parquet", "mapped", columns=MAPPED),
        files={"trace.parquet": _parquet({"t": [0.0, 1.0], "p": [[1, 2], [3]], "o": [5, 5]})},
        fragment="trace.parquet: row 1: p array([1, 2]) is not a whole number >= 1",
    ),
    Case(
        "set-requests-beyond-count",  # named the scenario file, which asked for 16 requests
        args=("--set", "workload.duration_s=null", "--set", "workload.requests=100000000"),
        fragment="error: --set: workload.requests: 1e+08 requests (~186 GiB in memory for 1 policies); a run",
    ),
    Case(
        "set-rate-beyond-count",  # named the file's duration_s
        args=("--set", "workload.rate_multiplier=10000000"),
        fragment="error: --set: workload.rate_multiplier: 4 s at 4e+07 req/s is about 1.6e+08 requests",
    ),
    Case(
        "size-beyond-count-in-the-file",  # still the file's, whatever else --set writes
        _both(_set("workload.duration_s", 100_000), _set("workload.rate_rps", 100)),
        args=("--set", "workload.seed=2"),
        fragment="scenario.yaml: workload.duration_s: 100000 s at 100 req/s is about 1e+07 requests",
    ),
    Case(
        "set-duration-beyond-days",  # named the scenario file
        args=("--set", "workload.duration_s=2000000", "--set", "workload.rate_rps=0.0001"),
        fragment="error: --set: workload.duration_s: 2e+06 s: at most 1e+06 s",
    ),
    Case(
        "set-polls-beyond-count",  # named the scenario file
        _both(_set("workload.duration_s", 100_000), _set("workload.rate_rps", 0.001)),
        args=("--set", "gateway.poll_interval_s=0.001", "--set", "gateway.replicas=100"),
        fragment="error: --set: gateway.poll_interval_s: 0.001 s: 100 gateway replicas polling",
    ),
    Case(
        "retries-beyond-attempts",  # 4 million requests were let through as if each made one attempt
        _both(
            lambda d: d["workload"].pop("duration_s"),
            _set("workload.requests", 4_000_000),
            _set("clients.max_retries", 20),
        ),
        fragment="scenario.yaml: clients.max_retries: 20: 4e+06 requests (~30 GiB in memory for 1 policies "
        "should every attempt be rejected: up to 8.4e+07 attempts of 21 a request); a run makes at most 20,000,000",
    ),
    Case(
        "set-retries-beyond-attempts",
        _both(lambda d: d["workload"].pop("duration_s"), _set("workload.requests", 4_000_000)),
        args=("--set", "clients.max_retries=20"),
        fragment="error: --set: clients.max_retries: 20: 4e+06 requests (~",
    ),
]


def _write_scenario(case: Case, tmp_path: Path) -> Path:
    for name, content in case.files.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content)
    if case.scenario_text == "default":
        return ROOT / "scenarios" / "default.yaml"
    doc = copy.deepcopy(BASE)
    case.mutate(doc)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def simadmit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The installed console command, running this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [SIMADMIT, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def assert_outcome(
    result: subprocess.CompletedProcess[str], code: int, fragment: str, absent: str = ""
) -> None:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert not absent or absent not in output, output
    assert result.returncode == code, output
    if code == 2:  # one line per problem, each naming its file or option and field
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert any(fragment in line for line in lines), result.stderr
    else:
        assert fragment in output, output


@pytest.mark.parametrize("case", SIM_CASES, ids=[c.id for c in SIM_CASES])
def test_simulate_input(case: Case, tmp_path: Path) -> None:
    scenario = _write_scenario(case, tmp_path)
    result = simadmit("simulate", str(scenario), "--out", str(tmp_path / "out"), *case.args)
    assert_outcome(result, case.code, case.fragment, case.absent)
    if case.summary is not None:
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert case.summary(summary), summary


@dataclass(frozen=True)
class CalibrateCase:
    """A `simadmit calibrate ...` command; `{url}` is a fake vLLM server behaving as `server` says, `{https_url}`
    the same server named https:// (it speaks plain http), `{port}` its port."""

    id: str
    args: tuple[str, ...]
    server: str = "ok"
    code: int = 2
    fragment: str = ""


CALIBRATE_CASES = [
    CalibrateCase(
        "engine-limits-checked-before-measuring",
        (
            "calibrate",
            "--endpoint",
            "{url}",
            "--out",
            "{tmp}/p.yaml",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "32",
        ),
        fragment="--max-num-batched-tokens: max_num_batched_tokens (32) is below max_num_seqs (64)",
    ),
    CalibrateCase(
        "budget-zero",
        ("calibrate", "--endpoint", "{url}", "--out", "{tmp}/p.yaml", "--budget", "0s"),
        fragment="error: --budget: '0s': must be longer than zero",  # `error:` as every command prints
    ),
    CalibrateCase(
        "request-timeout-not-a-duration",
        ("calibrate", "--endpoint", "{url}", "--out", "{tmp}/p.yaml", "--request-timeout", "soon"),
        fragment="--request-timeout: 'soon' is not a duration",
    ),
    CalibrateCase(
        "hung-server-stops-at-the-budget",
        (
            "calibrate",
            "--endpoint",
            "{url}",
            "--out",
            "{tmp}/p.yaml",
            "--budget",
            "3s",
            "--max-concurrency",
            "2",
        ),
        server="hang",
        code=1,
        fragment="stopped at the time budget (3s): 2 requests were still waiting on the server",
    ),
    CalibrateCase(
        "resume-a-binary-measurements-file",
        ("calibrate", "--endpoint", "{url}", "--out", "{in}/binary-run.yaml", "--resume"),
        fragment="binary-run.measurements.csv: not a measurements file (not UTF-8 text)",
    ),
    CalibrateCase(
        "out-is-a-file-that-is-not-a-calibration",
        ("calibrate", "--endpoint", "{url}", "--out", "{in}/ok.yaml"),
        fragment="ok.yaml: already exists: give --out a new file, or remove it",  # it was measured, then replaced
    ),
    CalibrateCase(
        "out-inside-a-file",  # said "cannot write it (File exists)" once the server had answered
        ("calibrate", "--endpoint", "{url}", "--out", "{in}/ok.yaml/p.yaml"),
        fragment="ok.yaml is a file, not a folder",
    ),
    CalibrateCase(
        "resume-with-nothing-to-resume",
        ("calibrate", "--endpoint", "{url}", "--out", "{tmp}/typo.yaml", "--resume"),
        fragment="typo.measurements.csv: nothing to resume: no measurements file (drop --resume",
    ),
    CalibrateCase(
        "measurements-path-is-a-folder",
        ("calibrate", "--endpoint", "{url}", "--out", "{in}/taken.yaml", "--resume"),
        fragment="taken.measurements.csv: is a folder, where the measurements file goes",
    ),
    CalibrateCase(
        "resume-measurements-of-another-server",
        ("calibrate", "--endpoint", "{url}", "--out", "{in}/elsewhere.yaml", "--resume"),
        fragment="elsewhere.measurements.csv: holds measurements of another server or configuration (endpoint "
        "http://10.0.0.9:8000 -> http://127.0.0.1:",  # the same model name, another server: never mixed
    ),
    CalibrateCase(
        "resume-measurements-of-another-configuration",
        (
            "calibrate",
            "--endpoint",
            "{url}",
            "--out",
            "{in}/elsewhere.yaml",
            "--resume",
            "--max-num-seqs",
            "64",
        ),
        fragment="max_num_seqs 256 -> 64): resume against the one it measured, or give --out a new file",
    ),
    CalibrateCase(
        "resume-a-file-that-records-no-server",
        (
            "calibrate",
            "--endpoint",
            "{url}",
            "--out",
            "{in}/older.yaml",
            "--resume",
            "--budget",
            "4s",
            "--max-concurrency",
            "2",
        ),
        code=0,
        fragment="does not record which server it measured (written by an older simadmit): resuming on trust",
    ),  # fmt: skip
    CalibrateCase(
        "check-every-request-failed",
        ("calibrate", "check", "smollm2-135m-cpu", "--endpoint", "{url}", "--requests", "4", "--rate", "20"),
        server="error",
        code=1,
        fragment="all 4 requests failed (4 http_500): nothing to compare",
    ),
    CalibrateCase(
        "check-hung-server-times-out",
        (
            "calibrate",
            "check",
            "smollm2-135m-cpu",
            "--endpoint",
            "{url}",
            "--requests",
            "3",
            "--rate",
            "20",
            "--request-timeout",
            "1s",
        ),
        server="hang",
        code=1,
        fragment="all 3 requests failed (3 timeout)",
    ),
    CalibrateCase(
        "check-takes-a-bundled-profile-name",
        ("calibrate", "check", "smollm2-135m-cpu", "--endpoint", "{url}", "--requests", "3", "--rate", "20"),
        code=0,
        fragment="smollm2-135m-cpu: simulated vs measured",
    ),
    CalibrateCase(
        "model-not-served-named-without-the-key",  # printed the endpoint's user:key
        ("calibrate", "--endpoint", "{url_with_key}", "--out", "{tmp}/p.yaml", "--model", "nosuch"),
        fragment="--model: 'nosuch' is not served by http://127.0.0.1:",
    ),
    CalibrateCase(
        "check-unknown-profile",
        ("calibrate", "check", "no-such-profile", "--endpoint", "{url}"),
        fragment="no-such-profile: calibration profile file not found",
    ),
    CalibrateCase(
        "check-requests-huge",  # drew 10^8 requests' lengths and times before sending any: minutes, gigabytes
        ("calibrate", "check", "smollm2-135m-cpu", "--endpoint", "{url}", "--requests", "100000000"),
        fragment="Invalid value for '--requests'",
    ),
    CalibrateCase(
        "check-rate-tiny",  # hung: each request waited its turn, 10^300 s apart
        (
            "calibrate",
            "check",
            "smollm2-135m-cpu",
            "--endpoint",
            "{url}",
            "--requests",
            "3",
            "--rate",
            "1e-300",
        ),
        fragment="--rate: 1e-300 arrivals per second: the 3 requests would take 1.43e+300 s to send; at most 1e+06 s",
    ),
    *(  # "cannot connect ([SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006))"
        CalibrateCase(
            f"{command}-https-to-a-plain-http-server",
            args,
            fragment="--endpoint: https://127.0.0.1:{port}: the server speaks plain http, not https: write "
            "http://127.0.0.1:{port}",
        )
        for command, args in (
            ("calibrate", ("calibrate", "--endpoint", "{https_url}", "--out", "{tmp}/p.yaml")),
            ("check", ("calibrate", "check", "smollm2-135m-cpu", "--endpoint", "{https_url}/v1")),
            ("replay", ("replay", "{in}/ok.yaml", "--endpoint", "{https_url}", "--out", "{tmp}/r")),
        )
    ),
    CalibrateCase(
        "check-negative-rate",
        ("calibrate", "check", "smollm2-135m-cpu", "--endpoint", "{url}", "--rate", "-1"),
        fragment="--rate: must be a positive number",
    ),
]


@pytest.mark.parametrize("case", CALIBRATE_CASES, ids=[c.id for c in CALIBRATE_CASES])
def test_calibrate_input(case: CalibrateCase, tmp_path: Path, inputs: dict[str, str]) -> None:
    with FakeVllm(then=case.server) as server:
        urls = {
            "url": server.url,
            "url_with_key": server.url.replace("http://", "http://user:sk-secret-3@"),
            "https_url": server.url.replace("http://", "https://"),
            "port": server.url.rpartition(":")[2],
        }
        args = [a.format(**inputs, **urls, tmp=tmp_path) for a in case.args]
        result = simadmit(*args, "--model", "fake-model") if "check" in args else simadmit(*args)
    fragment = case.fragment.format(**urls)
    if case.code == 1:  # a run that stopped: one line saying why, never a traceback
        assert "Traceback" not in result.stdout + result.stderr
        assert result.returncode == 1, result.stdout + result.stderr
        assert fragment in result.stderr, result.stderr
        return
    assert_outcome(result, case.code, fragment)


STUDY_SEED_CASES = [
    ("sweep", "--param", "workload.rate_multiplier=1", "--seed", "-1"),
    ("optimize", "--slo", "interactive.ttft_p99<=3s", "--seed", "-2"),
]


@pytest.mark.parametrize("args", STUDY_SEED_CASES, ids=[a[0] for a in STUDY_SEED_CASES])
def test_study_negative_seed(args: tuple[str, ...], tmp_path: Path) -> None:
    """A seed the random streams refuse is one line and exit 2 before anything runs, as under `simulate`."""
    result = simadmit(args[0], "default", *args[1:], "--out", str(tmp_path / "out"))
    assert_outcome(result, 2, "--seed: must be a whole number from 0")
    assert not (tmp_path / "out").exists()


# --- every other command, as a new user mistypes it ---------------------------------------------------
# Arguments are formatted with: {in} a folder of inputs (ok.yaml: a valid tiny scenario; binary.yaml; a
# folder, and one named taken.measurements.csv; a top-level list; dup.yaml: ok.yaml naming it twice;
# huge.yaml: ok.yaml at 10^8 requests per second; a damaged Parquet), {tmp} the test's own folder, {sim}
# and {other} the `simulate --out` folders of ok.yaml and of ok.yaml at twice the rate, {refused} a URL
# nobody listens on, {busy} a port something already listens on.


@dataclass(frozen=True)
class CommandCase:
    id: str
    args: tuple[str, ...]
    code: int = 2
    fragment: str = ""
    absent: str = ""  # must not be printed (a secret)


COMMAND_CASES = [
    CommandCase(
        "simulate-binary-scenario", ("simulate", "{in}/binary.yaml"), fragment="binary.yaml: not a text file"
    ),
    CommandCase(
        "simulate-utf16-scenario",  # PowerShell's `>` writes UTF-16: "not a text file (byte 0 is not UTF-8)"
        ("simulate", "{in}/utf16.yaml"),
        fragment="utf16.yaml: not a UTF-8 text file: a UTF-16 one (save it as UTF-8)",
    ),
    CommandCase(
        "simulate-folder-as-scenario",
        ("simulate", "{in}/folder"),
        fragment="folder: is a folder, not a scenario",
    ),
    CommandCase(
        "simulate-list-scenario",
        ("simulate", "{in}/list.yaml"),
        fragment="list.yaml: a scenario must be a YAML",
    ),
    CommandCase(
        "simulate-device-as-scenario",  # "scenario file not found"
        ("simulate", "/dev/null"),
        fragment="/dev/null: scenario file is not a regular file (a device, pipe or socket)",
    ),
    CommandCase(
        "simulate-value-its-tag-refuses",  # a ValueError traceback from PyYAML's !!int constructor
        ("simulate", "{in}/bad-tag.yaml"),
        fragment="bad-tag.yaml: line 1: not valid YAML ('tiny' is not a !!int)",
    ),
    CommandCase(
        "simulate-binary-tag",  # was read as the text b'hello' decodes to, and the run went ahead
        ("simulate", "{in}/binary-tag.yaml"),
        fragment="binary-tag.yaml: line 1: not valid YAML (no field takes a !!binary value",
    ),
    CommandCase(
        "simulate-set-tag",  # a Python set, taken as a list in no set order
        ("simulate", "{in}/set-tag.yaml"),
        fragment="set-tag.yaml: line 6: not valid YAML (no field takes a !!set value",
    ),
    CommandCase(
        "simulate-a-profile-as-the-scenario",  # ten lines: each scenario section missing, each profile field unknown
        ("simulate", PROFILE),
        fragment="llama-3.1-8b-h100.yaml: is a calibration profile, not a scenario",
    ),
    CommandCase(
        "simulate-nested-too-deeply",  # a RecursionError from the YAML parser
        ("simulate", "{in}/deep.yaml"),
        fragment="deep.yaml: not valid YAML (nested too deeply)",
    ),
    CommandCase(
        "simulate-control-character-in-scenario",  # PyYAML's two lines, naming a position but no line
        ("simulate", "{in}/control.yaml", "--out", "{tmp}/run"),
        fragment="control.yaml: line 1: not valid YAML (unacceptable character #x0000: special characters are "
        "not allowed)",
    ),
    CommandCase(
        "simulate-bom-crlf-scenario",
        ("simulate", "{in}/bom-crlf.yaml", "--out", "{tmp}/run"),
        code=0,
        fragment="simulated requests",
    ),
    CommandCase(
        "simulate-out-is-a-device",
        ("simulate", "{in}/ok.yaml", "--out", "/dev/full"),
        fragment="/dev/full: is a file, not a folder",
    ),
    CommandCase(
        "sweep-range-huge",
        ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1:2:1000000000", "--out", "{tmp}/s"),
        fragment="1,000,000,000 values; a sweep runs at most 10,000 points",
    ),
    CommandCase(
        "sweep-grid-huge",
        (
            "sweep",
            "{in}/ok.yaml",
            "--param",
            "workload.rate_rps=1:2:200",
            "--param",
            "workload.warmup_s=0:1:200",
            "--out",
            "{tmp}/s",
        ),
        fragment="--param: 200 x 200: a sweep runs at most 10,000 points",
    ),  # fmt: skip
    CommandCase(
        "optimize-search-one-path-twice",  # both ranges searched, the last one's values the ones that ran
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--search",
            "workload.rate_multiplier=0.5:1",
            "--search",
            "workload.rate_multiplier=1:2",
            "--out",
            "{tmp}/o",
        ),
        fragment="--search workload.rate_multiplier=1:2: workload.rate_multiplier is already searched: give each path once",
    ),  # fmt: skip
    CommandCase(
        "sweep-range-to-the-largest-float",  # the point's value printed as an integer of 308 digits
        ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1:1e308:3", "--out", "{tmp}/s"),
        fragment="point {{'workload.rate_rps': 5e+307}}: {in}/ok.yaml: workload.duration_s: 4 s at 5e+307 req/s",
    ),
    CommandCase(
        "sweep-value-is-printed-as-typed",
        ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=a:b:3", "--out", "{tmp}/s"),
        fragment="--param: workload.rate_rps=a:b:3: a range is",  # not an emoji, not markup
    ),
    CommandCase(
        "sweep-mappings-with-commas",  # split at every comma, the message not saying how else to write them
        (
            "sweep",
            "{in}/ok.yaml",
            "--param",
            "pools.0.engine.tier_priority={{a: 1, b: 2}},{{a: 2, b: 1}}",
            "--out",
            "{tmp}/s",
        ),  # fmt: skip
        fragment="values with commas of their own go in a YAML list, path=[{{a: 1, b: 2}}, ...]",
    ),
    CommandCase(
        "sweep-a-null-value",
        ("sweep", "{in}/ok.yaml", "--param", "clients.abandon_after_s=null,5", "--out", "{tmp}/s"),
        fragment="--param: clients.abandon_after_s=null,5: a value is null or empty",
    ),
    CommandCase(
        "sweep-unknown-path-said-once",  # the same line once per value
        ("sweep", "{in}/ok.yaml", "--param", "workload.bogus=1,2,3", "--out", "{tmp}/s"),
        fragment="--param workload.bogus: {in}/ok.yaml: workload.bogus: unknown field",
        absent="workload.bogus=",
    ),
    CommandCase(
        "sweep-value-echoed-as-yaml",  # "workload.seed=True", a value the user never typed
        ("sweep", "{in}/ok.yaml", "--param", "workload.seed=true,2", "--out", "{tmp}/s"),
        fragment="--param workload.seed=true: {in}/ok.yaml: workload.seed: Input should be a number, not true",
    ),
    *(
        CommandCase(
            f"sweep-{what}",
            ("sweep", "{in}/ok.yaml", "--param", f"workload.rate_rps={value}", "--out", "{tmp}/s"),
            fragment=f"--param: workload.rate_rps={value}: {message}",
        )
        for what, value, message in (
            (
                "range-end-not-a-number",
                "1e:2:3",
                "a range is lo:hi:n (finite numbers with lo <= hi, n whole)",
            ),
            ("range-of-four-parts", "1:2:3:4", "a range is lo:hi:n"),  # ran 223,384 req/s (YAML base 60)
            ("range-of-five-parts", "1:2:3:4:5", "a range is lo:hi:n"),  # blamed ok.yaml's duration_s
            (
                "range-high-below-low",
                "1:0.5:3",
                "a range is lo:hi:n (finite numbers with lo <= hi",
            ),  # ran; --search refuses it
            ("range-count-fractional", "1:2:2.5", "a range is lo:hi:n"),  # ran at 3722.5 req/s (YAML base 60)
            ("range-without-count", "1:4", "a range is lo:hi:n"),  # ran at 64 req/s (YAML base 60)
            ("range-count-superscript", "1:4:\u00b2", "a range is lo:hi:n"),  # int('²'): a traceback
            ("value-given-twice", "2,2.0", "the value 2.0 is given twice"),  # each point ran twice
            # "values are not valid YAML", not why
            ("value-its-tag-refuses", "!!int x,2", "values are not valid YAML ('x' is not a !!int)"),
        )
    ),
    *(  # each started 100,000 worker processes
        CommandCase(
            f"{args[0]}-jobs-huge",
            (*args, "--jobs", "100000", "--out", "{tmp}/o"),
            fragment="--jobs: 100000 worker processes on this machine's",
        )
        for args in (
            ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1,2"),
            ("optimize", "{in}/ok.yaml", "--slo", "interactive.ttft_p99<=3s"),
        )
    ),
    *(
        CommandCase(
            f"{args[0]}-scenario-with-variants",  # simulated the scenario alone, its variants left out unsaid
            (*args, "--out", "{tmp}/run"),
            code=0,
            fragment=f"note: {args[0]} runs the scenario's own settings; its variants (one, two) are left out",
        )
        for args in (
            ("sweep", "{in}/variants.yaml", "--param", "workload.rate_rps=1,2"),
            ("optimize", "{in}/variants.yaml", "--slo", "interactive.ttft_p99<=3s", "--loads", "1"),
        )
    ),
    CommandCase(
        "optimize-search-on-a-policy-the-scenario-lacks",  # searched for no policy: a search of nothing, exit 0
        (
            "optimize",
            "{in}/queue-depth.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--search",
            "policies.queue_dept.max_queued=1:8",
            "--out",
            "{tmp}/o",
        ),
        fragment="--search policies.queue_dept.max_queued=1:8: policies.queue_dept.max_queued names no policy of "
        "the scenario (its policies: queue_depth)",
    ),  # fmt: skip
    CommandCase(
        "optimize-a-load-twice",  # the same simulations run twice, to no end
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--loads",
            "1,2,1.0",
            "--out",
            "{tmp}/o",
        ),
        fragment="--loads: 1,2,1.0: 1 given twice",
    ),
    CommandCase(
        "optimize-two-limits-on-one-side-of-a-measure",  # one of them never binds: a typo, silently
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--slo",
            "interactive.ttft_p99<=2s",
            "--out",
            "{tmp}/o",
        ),
        fragment="--slo interactive.ttft_p99<=2s: interactive.ttft_p99_s is already limited by --slo "
        "interactive.ttft_p99<=3s",
    ),  # fmt: skip
    CommandCase(
        "optimize-rounds-huge",  # 1.8e9 simulations, started one by one
        (
            "optimize",
            "{in}/queue-depth.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--rounds",
            "100000000",
            "--out",
            "{tmp}/o",
        ),
        fragment="--rounds, --candidates, --fresh-seeds: 100000000, 5, 2: up to 1,800,000,012 simulations",
    ),  # fmt: skip
    CommandCase(
        "optimize-search-to-infinity",  # a traceback (an infinite integer bound)
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--search",
            "pools.0.replicas=1:inf",
            "--out",
            "{tmp}/o",
        ),
        fragment="--search: pools.0.replicas=1:inf: expected path=lo:hi, finite numbers with lo <= hi",
    ),  # fmt: skip
    CommandCase(
        "sweep-binary-scenario",
        ("sweep", "{in}/binary.yaml", "--param", "workload.rate_rps=1,2", "--out", "{tmp}/s"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "sweep-replications-huge",
        (
            "sweep",
            "{in}/ok.yaml",
            "--param",
            "workload.rate_rps=1,2",
            "--replications",
            "5000",
            "--out",
            "{tmp}/s",
        ),
        fragment="Invalid value for '--replications'",
    ),  # fmt: skip
    CommandCase(
        "optimize-negative-load",
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--loads",
            "1,-2",
            "--out",
            "{tmp}/o",
        ),
        fragment="--loads: 1,-2: expected comma-separated multipliers above 0",
    ),  # fmt: skip
    CommandCase(
        "optimize-infinite-load",
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--loads",
            "inf",
            "--out",
            "{tmp}/o",
        ),
        fragment="--loads: inf: expected comma-separated multipliers above 0",
    ),  # fmt: skip
    CommandCase(
        "optimize-unknown-objective",
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--objective",
            "speed",
            "--out",
            "{tmp}/o",
        ),
        fragment="--objective: speed: expected one of goodput",
    ),  # fmt: skip
    CommandCase(
        "optimize-folder-as-scenario",
        ("optimize", "{in}/folder", "--slo", "interactive.ttft_p99<=3s", "--out", "{tmp}/o"),
        fragment="folder: is a folder, not a scenario file",
    ),
    CommandCase("plot-a-file", ("plot", "{in}/ok.yaml"), fragment="ok.yaml: is a file, not a folder (give a"),
    CommandCase(
        "plot-a-missing-folder",  # "not a directory", as if something were there
        ("plot", "{in}/nowhere"),
        fragment="nowhere: folder not found (give a simulate or sweep --out folder)",
    ),
    CommandCase(
        "plot-binary-scenario",
        ("plot", "{sim}", "--scenario", "{in}/binary.yaml"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "plot-a-table-without-a-column-it-draws",  # a KeyError traceback
        ("plot", "{in}/older-run"),
        fragment="older-run/requests.parquet: no column 'decision', which plot draws from",
    ),
    CommandCase(
        "plot-a-table-with-text-for-latencies",  # a ValueError traceback from matplotlib's float conversion
        ("plot", "{in}/text-run"),
        fragment="text-run/requests.parquet: ttft_s: holds str values, not numbers, where plot draws them",
    ),
    CommandCase(
        "plot-a-timeline-with-text-for-counts",  # drew category axes, one tick per text, and exited 0
        ("plot", "{in}/text-timeline"),
        fragment="text-timeline/timeseries.parquet: queued: holds str values, not numbers, where plot draws",
    ),
    CommandCase(
        "plot-a-table-overwritten-in-place",  # its size as the manifest says, junk inside: a traceback
        ("plot", "{in}/overwritten"),
        fragment="overwritten/requests.parquet: not a requests table (Could not open Parquet input source",
    ),
    CommandCase(
        "plot-folder-without-manifest",
        ("plot", "{in}/damaged"),
        fragment="damaged: incomplete folder: no manifest.json",
    ),
    CommandCase(
        "replay-key-given-twice",
        ("replay", "{in}/dup.yaml", "--endpoint", "{refused}", "--out", "{tmp}/r"),
        fragment="dup.yaml: line 25: not valid YAML (key 'name' given twice)",  # not the last one silently
    ),
    CommandCase(
        "gateway-key-given-twice",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/dup.yaml",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        fragment="dup.yaml: line 25: not valid YAML (key 'name' given twice)",
    ),
    CommandCase(
        "replay-endpoint-with-a-key",  # the key was printed back in the connection-refused line
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused_with_key}", "--out", "{tmp}/r"),
        fragment="--endpoint: {refused}: connection refused",
        absent="sk-secret-2",
    ),
    CommandCase(
        "replay-endpoint-with-a-key-and-a-bad-port",  # the key was printed back with the URL
        (
            "replay",
            "{in}/ok.yaml",
            "--endpoint",
            "http://user:sk-secret-4@127.0.0.1:99999",
            "--out",
            "{tmp}/r",
        ),
        fragment="--endpoint: 'http://127.0.0.1:99999': the port must be a number from 1 to 65535",
        absent="sk-secret-4",
    ),
    CommandCase(
        "replay-connection-refused",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--out", "{tmp}/r"),
        fragment="connection refused (is the server running on that port?)",
    ),
    CommandCase(
        "replay-out-is-a-file",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--out", "{in}/ok.yaml"),
        fragment="ok.yaml: is a file, not a folder",  # refused before anything is sent
    ),
    CommandCase(
        "replay-binary-scenario",
        ("replay", "{in}/binary.yaml", "--endpoint", "{refused}", "--out", "{tmp}/r"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "replay-not-a-url",
        ("replay", "{in}/ok.yaml", "--endpoint", "localhost:8000", "--out", "{tmp}/r"),
        fragment="--endpoint: 'localhost:8000' is not an http(s) URL",
    ),
    CommandCase(
        "replay-endpoint-host-idna-cannot-encode",
        ("replay", "{in}/ok.yaml", "--endpoint", "http://\u2603.invalid:8000", "--out", "{tmp}/r"),
        fragment="--endpoint: 'http://\u2603.invalid:8000' is not an http(s) URL like http://host:8000 (Invalid IDNA",
    ),
    CommandCase(
        "replay-endpoint-control-character",
        ("replay", "{in}/ok.yaml", "--endpoint", "http://127.0.0.1:8000/\x01", "--out", "{tmp}/r"),
        fragment="--endpoint: 'http://127.0.0.1:8000/\\x01' is not an http(s) URL like http://host:8000",
    ),
    CommandCase(
        "replay-endpoint-port-out-of-range",
        ("replay", "{in}/ok.yaml", "--endpoint", "http://127.0.0.1:99999", "--out", "{tmp}/r"),
        fragment="--endpoint: 'http://127.0.0.1:99999': the port must be a number from 1 to 65535",
    ),
    CommandCase(
        "replay-endpoint-port-not-a-number",
        ("replay", "{in}/ok.yaml", "--endpoint", "http://127.0.0.1:80a", "--out", "{tmp}/r"),
        fragment="--endpoint: 'http://127.0.0.1:80a': the port must be a number",
    ),
    CommandCase(
        "replay-second-endpoint-not-a-url",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--endpoint", "host:9000", "--out", "{tmp}/r"),
        fragment="--endpoint: 'host:9000' is not an http(s) URL",  # before the first is even tried
    ),
    CommandCase(
        "replay-endpoint-given-twice",
        (
            "replay",
            "{in}/ok.yaml",
            "--endpoint",
            "{refused}",
            "--endpoint",
            "{refused}/v1/",
            "--out",
            "{tmp}/r",
        ),
        fragment="--endpoint: {refused} given twice",
    ),
    CommandCase(
        "replay-server-not-a-url",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--server", "h:80", "--out", "{tmp}/r"),
        fragment="--server: 'h:80' is not an http(s) URL",
    ),
    CommandCase(
        "replay-negative-seed",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--seed", "-1", "--out", "{tmp}/r"),
        fragment="--seed: must be a whole number from 0 to 2^63 - 1, got -1",
    ),
    CommandCase(
        "replay-seed-too-large",
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--seed", str(2**64), "--out", "{tmp}/r"),
        fragment="--seed: must be a whole number from 0 to 2^63 - 1",  # not found after the run is sent
    ),
    CommandCase(
        "replay-workload-too-big",
        (
            "replay",
            "{in}/ok.yaml",
            "--endpoint",
            "{refused}",
            "--set",
            "workload.rate_rps=100000000",
            "--out",
            "{tmp}/r",
        ),
        fragment="error: --set: workload.rate_rps: 4 s at 1e+08 req/s is about 4e+08 requests",  # not drawn
    ),
    CommandCase(
        "replay-workload-without-requests",
        (
            "replay",
            "{in}/ok.yaml",
            "--endpoint",
            "{refused}",
            "--set",
            "workload.rate_rps=0.0001",
            "--out",
            "{tmp}/r",
        ),
        fragment="ok.yaml and --set: workload: no request arrives in this workload",  # --set's rate made it so
    ),
    CommandCase(
        "compare-different-scenarios",
        ("compare", "{sim}", "{other}"),
        fragment="other: not the request list of",
    ),
    CommandCase(
        "compare-damaged-parquet",
        ("compare", "{in}/damaged", "{sim}"),
        fragment="damaged/requests.parquet: not a requests table of simulate or replay",
    ),
    CommandCase(
        "compare-foreign-table",
        ("compare", "{in}/foreign", "{sim}"),
        fragment="foreign/requests.parquet: not a requests table of simulate or replay (no column",
    ),
    CommandCase(
        "compare-warmup-nan",
        ("compare", "{sim}", "{sim}", "--warmup", "nan"),
        fragment="--warmup: must be a finite",
    ),
    CommandCase(
        "compare-warmup-infinite",  # "must be 0 or more seconds, got inf": it is
        ("compare", "{sim}", "{sim}", "--warmup", "inf"),
        fragment="--warmup: must be a finite number of seconds, 0 or more, got inf",
    ),
    CommandCase(
        "compare-warmup-past-every-arrival",
        ("compare", "{sim}", "{sim}", "--warmup", "1000"),
        fragment="--warmup: 1000 s leaves out every request of {sim} (the last arrives at",
    ),
    CommandCase(
        "compare-a-replay-as-the-simulation",  # the folders swapped: reported the replay's error against the run
        ("compare", "{in}/replayed", "{sim}"),
        fragment="replayed: holds a replay run: the first folder is the simulation (compare SIM_DIR REAL_DIR...)",
    ),
    CommandCase(
        "compare-out-is-a-run-folder",
        ("compare", "{sim}", "{sim}", "--out", "{sim}"),
        fragment="{sim}: holds a simulate run: give --out a folder of its own",  # never mixed into it
    ),
    CommandCase(
        "sweep-out-is-a-simulate-run",
        ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1,2", "--out", "{sim}"),
        fragment="{sim}: holds a simulate run: give --out a folder of its own",  # was written into it
    ),
    CommandCase(
        "optimize-out-is-a-simulate-run",
        ("optimize", "{in}/ok.yaml", "--slo", "interactive.ttft_p99<=3s", "--out", "{sim}"),
        fragment="{sim}: holds a simulate run: give --out a folder of its own",
    ),
    *(  # a sweep was written into the simulate run; simulate replaced it
        CommandCase(
            f"{args[0]}-out-has-a-damaged-manifest",
            (*args, "--out", "{in}/damaged-manifest"),
            fragment="damaged-manifest: holds a run whose manifest.json cannot be read: give --out a folder",
        )
        for args in (
            ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1,2"),
            ("simulate", "{in}/ok.yaml"),
        )
    ),
    CommandCase(
        "compare-real-run-given-twice",  # counted as two real runs
        ("compare", "{sim}", "{other}", "{other}/"),
        fragment="{other}: given twice (itself, or through the folder holding its repeats): name each real run",
    ),
    CommandCase(
        "compare-out-inside-a-simulate-run",  # written there; simulating that run again was then refused
        ("compare", "{sim}", "{sim}", "--out", "{sim}/report"),
        fragment="{sim}/report: is inside {sim}, a simulate run's folder: give --out a folder of its own",
    ),
    CommandCase(
        "simulate-out-inside-a-replay-run",  # written into the replayed run's folder
        ("simulate", "{in}/ok.yaml", "--out", "{in}/replayed/sub"),
        fragment="replayed/sub: is inside {in}/replayed, a replay run's folder: give --out a folder of its own",
    ),
    CommandCase(
        "simulate-out-is-a-link",  # the link was swapped for a new folder, a stale `.previous` link left beside it
        ("simulate", "{in}/ok.yaml", "--out", "{in}/link-to-sim"),
        fragment="link-to-sim: is a link to {sim} (the folder is replaced whole, the link with it): give --out",
    ),
    CommandCase(
        "simulate-out-is-a-dangling-link",  # "could not write the outputs (Not a directory)"
        ("simulate", "{in}/ok.yaml", "--out", "{in}/dangling"),
        fragment="dangling: is a link to {in}/nowhere (it points nowhere): give --out the folder itself",
    ),
    CommandCase(
        "simulate-out-is-a-replay-run",
        ("simulate", "{in}/ok.yaml", "--out", "{in}/replayed"),
        fragment="replayed: holds a replay run: give --out a folder of its own",  # its measurements replaced
    ),
    CommandCase(
        "simulate-out-is-a-sweep",
        ("simulate", "{in}/ok.yaml", "--out", "{in}/swept"),
        fragment="swept: holds a sweep run: give --out a folder of its own",
    ),
    CommandCase(
        "simulate-out-is-a-folder-of-the-users-yaml-and-csv",  # replaced whole: the user's files were deleted
        ("simulate", "{in}/ok.yaml", "--out", "{in}/mine"),
        fragment="mine: holds files simadmit did not write (data.csv, s.yaml); give a new or empty folder",
    ),
    CommandCase(
        "sweep-workload-too-big-at-one-point",
        ("sweep", "{in}/ok.yaml", "--param", "workload.duration_s=4,1e9", "--out", "{tmp}/s"),
        fragment="point {{'workload.duration_s': '1e9'}}: {in}/ok.yaml: workload.duration_s: 1e+09 s at 4 req/s",
    ),  # was a traceback from the worker's simulation
    CommandCase(
        "optimize-workload-too-big",
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--set",
            "workload.duration_s=1e9",
            "--out",
            "{tmp}/o",
        ),
        fragment="--loads 1: --set: workload.duration_s: 1e+09 s at 4 req/s",
    ),
    CommandCase(
        "optimize-bad-trace-before-any-simulation",
        ("optimize", "{in}/bad-trace.yaml", "--slo", "t.ttft_p99<=3s", "--jobs", "1", "--out", "{tmp}/o"),
        fragment="--loads 1: {in}/bad.csv: line 4: ContextTokens 'abc' is not a whole number >= 1",
    ),
    CommandCase(
        "gateway-needs-no-replayed-trace",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/trace-absent.yaml",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        fragment="--port {busy}: cannot listen there",  # past the scenario: the trace is never read
    ),
    CommandCase(
        "gateway-two-profiles-for-one-pool",  # the last was taken, silently
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--profile",
            "llama-3.1-8b-h100",
            "--profile",
            "p=smollm2-135m-cpu",
            "--port",
            "{busy}",
        ),
        fragment="--profile p=smollm2-135m-cpu: pool 'p' already has a profile (--profile llama-3.1-8b-h100)",
    ),
    CommandCase(
        "gateway-profile-is-a-folder",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--profile",
            "{in}/folder",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        fragment="pools.0.profile: profile '{in}/folder' is a folder, not a profile file",
    ),
    CommandCase(
        "compare-out-is-a-file",
        ("compare", "{sim}", "{sim}", "--out", "{in}/ok.yaml"),
        fragment="ok.yaml: is a file, not a folder",
    ),
    CommandCase(
        "gateway-backend-host-idna-cannot-encode",
        ("gateway", "--backend", "http://\u2603.invalid:8000", "--port", "1"),
        fragment="--backend: 'http://\u2603.invalid:8000' is not an http(s) URL like http://host:8000 (Invalid IDNA",
    ),
    CommandCase(
        "gateway-port-out-of-range",
        ("gateway", "--backend", "{refused}", "--port", "99999"),
        fragment="Invalid value for '--port'",
    ),
    CommandCase(
        "gateway-port-in-use",
        ("gateway", "--backend", "{refused}", "--host", "127.0.0.1", "--port", "{busy}"),
        fragment="--host 127.0.0.1 --port {busy}: cannot listen there (Address already in use)",
    ),
    CommandCase(
        "gateway-host-empty",  # listened on every address, as `--host "$UNSET"` would
        ("gateway", "--backend", "{refused}", "--host", "", "--port", "{busy}"),
        fragment="--host '': no address given (0.0.0.0 listens on every address)",
    ),
    CommandCase(
        "gateway-binary-scenario",
        ("gateway", "--backend", "{refused}", "--scenario", "{in}/binary.yaml"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "gateway-profile-empty",  # blamed the scenario: "ok.yaml: pools.0.profile: at least 1 character"
        ("gateway", "--backend", "{refused}", "--scenario", "{in}/ok.yaml", "--profile", "p="),
        fragment="error: --profile 'p=': no profile given (a file or a bundled name)",
    ),
    CommandCase(
        "gateway-profile-not-found",  # "--set: pools.0.profile: ...", an option not given
        ("gateway", "--backend", "{refused}", "--scenario", "{in}/ok.yaml", "--profile", "nope.yaml"),
        fragment="error: --profile: pools.0.profile: profile 'nope.yaml' not found",
    ),
    CommandCase(
        "scenario-time-of-day-number",  # YAML 1.1's base 60: a run of 90 s
        ("simulate", "{in}/base-60.yaml", "--out", "{tmp}/o"),
        fragment="base-60.yaml: workload.duration_s: Input should be a valid number",
    ),
    CommandCase(
        "sweep-values-of-time-of-day",  # YAML 1.1's base 60: 90 and 120 req/s
        ("sweep", "{in}/ok.yaml", "--param", "workload.rate_rps=1:30,2:00", "--out", "{tmp}/s"),
        fragment="--param workload.rate_rps: {in}/ok.yaml: workload.rate_rps: Input should be a valid number",
    ),
    CommandCase(
        "gateway-binary-profile",
        ("gateway", "--backend", "{refused}", "--profile", "{in}/binary.yaml"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "gateway-tier-header-with-a-space",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--set",
            "gateway.http.tier_header=x tier",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        fragment="--set: gateway.http.tier_header: 'x tier' is not an HTTP header name",  # the value --set wrote
    ),
    CommandCase(
        "gateway-one-header-for-two-things",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--set",
            "gateway.http.deadline_header=X-Tier",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        # gateway.http is a mapping --set created, and the clash is of the header it wrote
        fragment="--set: gateway.http: tier_header, deadline_header and elapsed_header must be different",
    ),
    CommandCase(
        "gateway-tokenizer-not-found",
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--set",
            "gateway.http.tokenizer=no.json",
            "--host",
            "127.0.0.1",
            "--port",
            "{busy}",
        ),
        fragment="error: --set: gateway.http.tokenizer: {in}/no.json: file not found",  # not ok.yaml, which has none
    ),
    *(  # both were "file not found"
        CommandCase(
            f"gateway-tokenizer-{what}",
            (
                "gateway",
                "--backend",
                "{refused}",
                "--scenario",
                "{in}/ok.yaml",
                "--set",
                f"gateway.http.tokenizer={path}",
                "--host",
                "127.0.0.1",
                "--port",
                "{busy}",
            ),
            fragment=f"error: --set: gateway.http.tokenizer: {shown}: {why}",
        )  # fmt: skip
        for what, path, shown, why in (
            ("a-folder", "folder", "{in}/folder", "is a folder"),
            ("a-device", "/dev/null", "/dev/null", "is not a regular file (a device, pipe or socket)"),
        )
    ),
    CommandCase(
        "gateway-central-dispatch-set-on-the-command-line",  # named ok.yaml, which does not write it
        (
            "gateway",
            "--backend",
            "{refused}",
            "--scenario",
            "{in}/ok.yaml",
            "--set",
            "gateway.dispatch=central",
        ),
        fragment="error: --set: gateway.dispatch: central (holding admitted requests in the gateway",
    ),
    CommandCase(
        "calibrate-out-is-a-folder",
        ("calibrate", "--endpoint", "{refused}", "--out", "{in}/folder"),
        fragment="error: {in}/folder: is a folder; give the profile's file",  # `error:` as every command
    ),
    CommandCase(
        "calibrate-budget-spent-before-the-server-answered",  # said "0 requests ... kept in ...; --resume"
        ("calibrate", "--endpoint", "http://127.0.0.1:{busy}", "--out", "{in}/silent.yaml", "--budget", "2s"),
        code=1,
        fragment="nothing was measured ({in}/silent.measurements.csv was not written): run the same command "
        "again, without --resume",
    ),
    CommandCase(
        "calibrate-gpus-huge",  # measured for the whole budget, then refused the fitted profile
        ("calibrate", "--endpoint", "{refused}", "--out", "{in}/gpus.yaml", "--gpus", "100000"),
        fragment="Invalid value for '--gpus': Input should be less than or equal to 1024",
    ),
    CommandCase(
        "calibrate-out-names-a-new-folder",  # measured, then wrote the profile as a file named `new`
        ("calibrate", "--endpoint", "{refused}", "--out", "{in}/new/"),
        fragment="error: {in}/new: names a folder (it ends in /); give the profile's file",
    ),
    CommandCase(
        "calibrate-out-is-a-dangling-link",  # measured in full, then "cannot write it" at the end
        ("calibrate", "--endpoint", "{refused}", "--out", "{in}/dangling"),
        fragment="dangling: is a link to {in}/nowhere, which points nowhere: give --out a new file",
    ),
    CommandCase(
        "calibrate-budget-huge",
        ("calibrate", "--endpoint", "{refused}", "--out", "{tmp}/p.yaml", "--budget", "99999h"),
        fragment="error: --budget: '99999h': at most a week",
    ),
    CommandCase(
        "calibrate-binary-workload",
        ("calibrate", "--endpoint", "{refused}", "--out", "{tmp}/p.yaml", "--workload", "{in}/binary.yaml"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "calibrate-workload-too-big",
        ("calibrate", "--endpoint", "{refused}", "--out", "{tmp}/p.yaml", "--workload", "{in}/huge.yaml"),
        fragment="huge.yaml: workload.duration_s: 4 s at 1e+08 req/s is about 4e+08 requests",
    ),
    CommandCase(
        "calibrate-check-binary-profile",
        ("calibrate", "check", "{in}/binary.yaml", "--endpoint", "{refused}"),
        fragment="binary.yaml: not a text file",
    ),
    CommandCase(
        "calibrate-check-folder-as-profile",
        ("calibrate", "check", "{in}/folder", "--endpoint", "{refused}"),
        fragment="folder: is a folder, not a calibration profile file",
    ),
    *(  # a traceback: the file system refuses the name wherever a command first touches it
        CommandCase(f"{what}-name-too-long", args, fragment="x" * 40 + ": File name too long")
        for what, args in (
            ("out", ("simulate", "{in}/ok.yaml", "--out", "{tmp}/" + "x" * 300)),
            ("scenario", ("simulate", "{tmp}/" + "x" * 300, "--out", "{tmp}/o")),
            ("plot-folder", ("plot", "{tmp}/" + "x" * 300)),
        )
    ),
    CommandCase(
        "replay-empty-label",  # was sent, with an empty policy column
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--label", " ", "--out", "{tmp}/r"),
        fragment="--label: must not be empty",
    ),
    CommandCase(
        "replay-label-with-a-slash",  # was sent; the policy column held what no scenario's policy may be named
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--label", "a/b", "--out", "{tmp}/r"),
        fragment="--label: 'a/b' names table rows, results and files: no /, \\ or control characters",
    ),
    CommandCase(
        "plot-an-optimize-folder",  # "no sweep.parquet, ... to plot", while a replay's line said plot drew it
        ("plot", "{in}/optimized"),
        fragment="optimized: holds an optimize run: plot draws simulate and sweep folders (optimize.csv holds",
    ),
    CommandCase(
        "plot-a-replay-folder",  # "incomplete folder: ... run the command that writes it again"
        ("plot", "{in}/replayed"),
        fragment="replayed: holds a replay run: plot draws simulate and sweep folders",
    ),
    *(
        CommandCase(
            f"optimize-slo-limit-{limit}",
            ("optimize", "{in}/ok.yaml", "--slo", f"interactive.ttft_p99<={limit}", "--out", "{tmp}/o"),
            fragment=f"--slo: interactive.ttft_p99<={limit}: the limit",  # not a traceback, nor never met
        )
        for limit in (".", "1e", "-3s", "1e999")
    ),
    CommandCase(
        "plot-scenario-of-other-tiers",  # drew the run's figures without a single SLA line
        ("plot", "{sim}", "--scenario", "{in}/batch-tier.yaml"),
        fragment="batch-tier.yaml: workload.tiers: none of them (batch) is a tier of the run in",
    ),
    CommandCase(
        "replay-repeat-huge",  # a typo of 10^8 runs was sent, one after another, for years
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--repeat", "100000000", "--out", "{tmp}/r"),
        fragment="'--repeat': Input should be less than or equal to 1000",
    ),
    CommandCase(
        "replay-timeout-infinite",  # an attempt to a server that hangs was waited on for ever
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--timeout", "inf", "--out", "{tmp}/r"),
        fragment="--timeout: must be from 1 to 86400 seconds, got inf",
    ),
    CommandCase(
        "replay-timeout-nan",  # was refused as "less than or equal to 86400"
        ("replay", "{in}/ok.yaml", "--endpoint", "{refused}", "--timeout", "nan", "--out", "{tmp}/r"),
        fragment="--timeout: must be from 1 to 86400 seconds, got nan",
    ),
    CommandCase(
        "sweep-address-without-the-ray-backend",  # ran on this machine, the cluster named never used
        ("sweep", "{in}/ok.yaml", "--address", "10.0.0.9:6379", "--out", "{tmp}/s"),
        fragment="--address: 10.0.0.9:6379: a Ray cluster's address: add --backend ray",
    ),
    CommandCase(
        "sweep-ray-address-nobody-answers",  # Ray retried the connection without end
        ("sweep", "{in}/ok.yaml", "--backend", "ray", "--address", "{refused_address}", "--out", "{tmp}/s"),
        fragment="--address: {refused_address}: no Ray cluster answers there (Connection refused)",
    ),
    CommandCase(
        "optimize-slo-percent-of-a-latency",  # read as 0.5 s
        ("optimize", "{in}/ok.yaml", "--slo", "interactive.ttft_p99<=50%", "--out", "{tmp}/o"),
        fragment="the unit '%' does not fit ttft_p99_s (write s or ms, or no unit)",
    ),
    CommandCase(
        "optimize-slo-floor-on-a-latency",  # taken as "at least 3 s": met only by a slow setting
        ("optimize", "{in}/ok.yaml", "--slo", "interactive.ttft_p99>=3s", "--out", "{tmp}/o"),
        fragment="ttft_p99_s is better the lower it is: bound it with <=",
    ),
    CommandCase(
        "optimize-slo-rate-without-its-percent",  # rejection<=2 read as a share of 2: met by every setting
        ("optimize", "{in}/ok.yaml", "--slo", "interactive.rejection<=2", "--out", "{tmp}/o"),
        fragment="rejection_rate is a share, from 0 to 1: for 2 percent write 2%",
    ),
    CommandCase(
        "optimize-set-beyond-count",  # named the scenario file at every load, which asks for 16 requests
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--set",
            "workload.duration_s=1000000",
            "--set",
            "workload.rate_rps=100",
            "--out",
            "{tmp}/o",
        ),
        fragment="error: --loads 1: --set: workload.duration_s: 1e+06 s at 100 req/s is about 1e+08 requests",
    ),
    CommandCase(
        "optimize-load-beyond-count",  # named the file's duration_s
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--loads",
            "1,10000000",
            "--out",
            "{tmp}/o",
        ),
        fragment="error: --loads 1e+07: --loads: workload.rate_multiplier: 4 s at 4e+07 req/s",
    ),
    CommandCase(
        "optimize-search-true-false-as-numbers",  # searched 0 and 1, written as numbers in optimize.csv
        (
            "optimize",
            "{in}/ok.yaml",
            "--slo",
            "interactive.ttft_p99<=3s",
            "--search",
            "clients.honor_retry_after=0:1",
            "--out",
            "{tmp}/o",
        ),
        fragment="error: --search clients.honor_retry_after=0:1: true or false, not a number: write "
        "clients.honor_retry_after=false:true to try both",
    ),
    CommandCase(
        "optimize-slo-unit-of-hours",  # "expected tier.measure<=value", the unit not named
        ("optimize", "{in}/ok.yaml", "--slo", "interactive.ttft_p99<=1h", "--out", "{tmp}/o"),
        fragment="the unit 'h' does not fit ttft_p99_s",
    ),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The files, folders, runs and ports the command cases refer to."""
    root = tmp_path_factory.mktemp("inputs")
    doc = copy.deepcopy(BASE)
    text = yaml.safe_dump(doc, sort_keys=False)
    (root / "ok.yaml").write_text(text)
    (root / "bom-crlf.yaml").write_text("\ufeff" + text.replace("\n", "\r\n") + "\r\n\r\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)))
    (root / "utf16.yaml").write_bytes(text.encode("utf-16"))
    (root / "binary-run.measurements.csv").write_bytes(bytes(range(256)))
    (root / "list.yaml").write_text("- name: tiny\n")
    (root / "queue-depth.yaml").write_text(
        yaml.safe_dump({**doc, "policies": [{"kind": "queue_depth", "max_queued": 4}]}, sort_keys=False)
    )
    (root / "bad-tag.yaml").write_text(text.replace("name: tiny", "name: !!int tiny"))
    (root / "binary-tag.yaml").write_text(text.replace("name: tiny", "name: !!binary aGVsbG8="))
    (root / "set-tag.yaml").write_text(text.replace("  tiers:", "  tiers: !!set", 1))
    (root / "batch-tier.yaml").write_text(text.replace("name: interactive", "name: batch"))
    (root / "deep.yaml").write_text("workload: " + "[" * 100_000 + "]" * 100_000 + "\n")
    (root / "dup.yaml").write_text(text + "name: again\n")
    (root / "control.yaml").write_text(text.replace("name: tiny", "name: ti\x00ny"))
    (root / "variants.yaml").write_text(
        yaml.safe_dump({**doc, "variants": [{"name": "one", "set": {}}, {"name": "two", "set": {}}]})
    )
    (root / "base-60.yaml").write_text(text.replace("duration_s: 4", "duration_s: 1:30"))
    (root / "huge.yaml").write_text(
        yaml.safe_dump({**doc, "workload": {**doc["workload"], "rate_rps": 10**8}})
    )
    (root / "folder").mkdir()
    (root / "taken.measurements.csv").mkdir()
    # files written before rows recorded their round and their tokens' arrivals
    header = ",".join(c for c in COLUMNS if c not in ("round", "token_times_s"))
    row = "warmup,1,0,1,fake-model,1700000000.0,16,16,8,8,0.01,0.001,0.001,0.001,0.001,8,0.02,ok"
    elsewhere = "endpoint=http://10.0.0.9:8000 vllm=fake max_model_len=2048 kv_block_size=16 engines=1 "
    elsewhere += "max_num_seqs=256 max_num_batched_tokens=8192"
    (root / "elsewhere.measurements.csv").write_text(f"{header}\n{row},{elsewhere}\n")
    (root / "older.measurements.csv").write_text(f"{header.removesuffix(',server')}\n{row}\n")
    (root / "damaged").mkdir()
    (root / "damaged" / "requests.parquet").write_bytes(b"PAR1 truncated")
    for name, rate in (("sim", 4), ("other", 8)):
        ran = simadmit(
            "simulate", str(root / "ok.yaml"), "--out", str(root / name), "--set", f"workload.rate_rps={rate}"
        )
        assert ran.returncode == 0, ran.stderr
    (root / "link-to-sim").symlink_to(root / "sim")
    shutil.copytree(root / "sim", root / "overwritten")
    junk = root / "overwritten" / "requests.parquet"
    junk.write_bytes(b"\xff" * junk.stat().st_size)
    (root / "damaged-manifest").mkdir()
    for table in ("requests.parquet", "timeseries.parquet", "summary.json"):
        (root / "damaged-manifest" / table).write_bytes((root / "sim" / table).read_bytes())
    (root / "damaged-manifest" / "manifest.json").write_text("{")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "replayed").mkdir()  # what `replay --out` leaves: its tables and facts, no manifest
    (root / "replayed" / "requests.parquet").write_bytes((root / "sim" / "requests.parquet").read_bytes())
    (root / "replayed" / "replay.json").write_text("{}")
    (root / "optimized").mkdir()
    (root / "optimized" / "manifest.json").write_text(
        '{"command": "optimize", "partial": false, "files": {}}'
    )
    (root / "swept").mkdir()
    (root / "mine").mkdir()  # a user's own folder of scenarios and traces, no run
    (root / "mine" / "s.yaml").write_text(text)
    (root / "mine" / "data.csv").write_text(AZURE_OK)
    (root / "swept" / "manifest.json").write_text('{"command": "sweep", "partial": false, "files": {}}')
    (root / "bad.csv").write_text(AZURE_OK + "2023-11-16 18:15:48.00,abc,12\n")
    for name, trace in (("bad-trace", "bad.csv"), ("trace-absent", "absent.csv")):
        replay_doc = copy.deepcopy(doc)
        _trace_workload(trace)(replay_doc)
        (root / f"{name}.yaml").write_text(yaml.safe_dump(replay_doc))
    # runs whose requests or timeseries table lacks a column plot draws from, or holds text in one, manifests whole
    ran = pd.read_parquet(root / "sim" / "requests.parquet")
    timeline = pd.read_parquet(root / "sim" / "timeseries.parquet")
    for name, file, table in (
        ("older-run", "requests.parquet", ran.drop(columns=["decision"])),
        ("text-run", "requests.parquet", ran.assign(ttft_s="fast")),
        ("text-timeline", "timeseries.parquet", timeline.assign(queued=timeline["queued"].astype(str))),
    ):
        (root / name).mkdir()
        table.to_parquet(root / name / file)
        size = (root / name / file).stat().st_size
        (root / name / "manifest.json").write_text(
            json.dumps({"command": "simulate", "partial": False, "files": {file: size}})
        )
    (root / "foreign").mkdir()
    (root / "foreign" / "requests.parquet").write_bytes((root / "sim" / "timeseries.parquet").read_bytes())
    with socket.socket() as free, socket.socket() as busy:
        free.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield {
            "in": str(root), "sim": str(root / "sim"), "other": str(root / "other"),
            "refused": f"http://127.0.0.1:{free.getsockname()[1]}", "busy": str(busy.getsockname()[1]),
            "refused_with_key": f"http://user:sk-secret-2@127.0.0.1:{free.getsockname()[1]}",
            "refused_address": f"127.0.0.1:{free.getsockname()[1]}",
        }  # fmt: skip


@pytest.mark.parametrize("case", COMMAND_CASES, ids=[c.id for c in COMMAND_CASES])
def test_command_input(case: CommandCase, inputs: dict[str, str], tmp_path: Path) -> None:
    args = [a.format(**inputs, tmp=tmp_path) for a in case.args]
    assert_outcome(simadmit(*args, timeout=120), case.code, case.fragment.format(**inputs), case.absent)


def test_a_link_leading_nowhere_is_named_as_such(tmp_path: Path) -> None:
    """A scenario that is a loop of links, and a trace that is a link to a deleted file, are one line
    each saying so (a bare "not found" sends the user looking for a file that is there, as a link)."""
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    result = simadmit("simulate", str(tmp_path / "loop.yaml"), "--out", str(tmp_path / "o1"))
    assert_outcome(
        result, 2, "loop.yaml: scenario file not found: a link to a missing file or a loop of links"
    )
    (tmp_path / "trace.csv").symlink_to(tmp_path / "deleted.csv")
    doc = copy.deepcopy(BASE)
    _trace_workload("trace.csv")(doc)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    result = simadmit("simulate", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o2"))
    assert_outcome(result, 2, "trace 'trace.csv' not found: a link to a missing file or a loop of links")


def _not_searchable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """`Path.is_file` as Python 3.11 answers for a file in a folder of mode 000 (as a user: root may search
    any folder): a PermissionError, not False."""
    is_file = Path.is_file

    def denied(self: Path) -> bool:
        if folder in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", denied)


@pytest.mark.parametrize(
    "resolve",
    [
        lambda folder: resolve_scenario(folder / "f.yaml"),
        lambda folder: resolve_profile("locked/f.yaml", folder.parent),
        lambda folder: resolve_trace("locked/f.yaml", folder.parent),
    ],
    ids=["scenario", "profile", "trace"],
)
def test_a_file_in_a_folder_that_cannot_be_searched(
    resolve: Callable[[Path], object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scenario, profile or trace in a folder of mode 000 is the line of a file that cannot be read, not
    the PermissionError traceback `Path.is_file` raised."""
    folder = tmp_path / "locked"
    _not_searchable(monkeypatch, folder)
    with pytest.raises(InputError) as err:
        resolve(folder)
    assert err.value.problems == [f"{folder / 'f.yaml'}: cannot read it (Permission denied)"]


def test_input_error_crosses_process_boundaries_whole() -> None:
    """Workers send errors back pickled: the lines arrive as lines, the message as it was."""
    error = InputError(["a.yaml: workload.rate_rps: must be > 0", "b.csv: line 4: not a number"])
    copied = pickle.loads(pickle.dumps(error))
    assert type(copied) is InputError
    assert copied.problems == error.problems and str(copied) == str(error)


@pytest.mark.parametrize("command", ["simulate", "sweep", "optimize"])
def test_a_scenario_of_megabytes_is_refused_before_it_is_parsed(command: str, tmp_path: Path) -> None:
    """A valid scenario padded past 1 MiB (a data file passed as the scenario: parsing 2 MB of YAML took
    16 s): one line naming the file and its size, exit 2, whichever command reads it."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE) + "# padding\n" * 120_000)
    extra = {"sweep": ("--param", "workload.rate_rps=1,2"), "optimize": ("--slo", "interactive.ttft_p99<=3s")}
    result = simadmit(command, str(path), "--out", str(tmp_path / "o"), *extra.get(command, ()))
    assert_outcome(result, 2, f"{path}: 1.1 MiB, over the 1 MiB read as a scenario")
    assert not (tmp_path / "o").exists()


def test_a_sweep_reads_its_scenario_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """A tier named `café` in a UTF-8 scenario: `sweep` read the file a second time in the locale's encoding
    (a UnicodeDecodeError traceback in an ASCII locale, the name garbled in a Latin-1 one)."""
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(BASE).replace("interactive", "café"), encoding="utf-8")
    ascii_locale = {"PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "POSIX", "LANG": ""}
    result = subprocess.run(
        [SIMADMIT, "sweep", str(tmp_path / "s.yaml"), "--param", "workload.rate_rps=1,2", "--out", str(tmp_path / "o")],
        capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT), **ascii_locale}, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert "café" in pd.read_parquet(tmp_path / "o" / "sweep.parquet")["tier"].unique()


def test_a_bad_trace_of_one_sweep_point_is_refused_before_any_point_runs(tmp_path: Path) -> None:
    """Every point's traces are read before the sweep starts: a malformed row of one point's trace is the
    one line `simulate` prints, naming the first point it was found in (once, though two points read it),
    exit code 2, and no point runs (none is saved)."""
    (tmp_path / "good.csv").write_text(AZURE_OK)
    (tmp_path / "bad.csv").write_text(AZURE_OK + "2023-11-16 18:15:48.00,abc,12\n")
    doc = copy.deepcopy(BASE)
    _trace_workload("good.csv")(doc)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    result = simadmit(
        "sweep", str(tmp_path / "s.yaml"), "--param", "workload.trace.path=good.csv,bad.csv",
        "--param", "workload.rate_multiplier=1,2", "--jobs", "2", "--out", str(tmp_path / "out"), timeout=180,
    )  # fmt: skip
    assert_outcome(
        result,
        2,
        "point {'workload.trace.path': 'bad.csv', 'workload.rate_multiplier': 1}: "
        f"{tmp_path / 'bad.csv'}: line 4: ContextTokens 'abc' is not a whole number >= 1",
    )
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert not (tmp_path / "out").exists()  # the good point did not run first


USAGE_MISTAKES = [
    ("simulate", "--replications", "0"),
    ("simulate", "--bogus"),
    ("sweep", "--jobs", "many"),
    ("gateway", "--backend", "http://127.0.0.1:1", "--port", "0"),
    ("replay",),
    ("nosuch",),
]


@pytest.mark.parametrize("args", USAGE_MISTAKES, ids=["-".join(a) for a in USAGE_MISTAKES])
def test_command_line_mistakes_are_one_line(args: tuple[str, ...]) -> None:
    """The command line's own checks (types, ranges, unknown options and commands) speak like every other
    input error: one `error:` line, pointing to the help, and exit code 2."""
    result = simadmit(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help)" in lines[0], result.stderr


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "a number too long"),
    ],
    ids=["nested-too-deeply", "number-of-5000-digits"],
)
def test_gateway_request_body_the_json_reader_refuses_is_a_400(raw: bytes, why: str) -> None:
    """A body Python's JSON reader cannot take is the client's 400, as any other malformed body (these were
    a RecursionError and a ValueError: a 500 and a traceback in the gateway's log)."""
    with pytest.raises(ClientError) as err:
        parse_body(raw, COMPLETIONS, 16)
    assert err.value.status == 400 and str(err.value) == f"request body is not valid JSON: {why}"
