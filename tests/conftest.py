"""Fixtures shared by test modules: one real vLLM server per session, whichever modules ask for it."""

from tests.vllm_server import vllm_server_fixture  # noqa: F401
