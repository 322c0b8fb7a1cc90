"""Fixtures shared by test modules: one real vLLM server per session, whichever modules ask for it."""

from tests.vllm_server import engine_alone_fixture, vllm_server_fixture  # noqa: F401
