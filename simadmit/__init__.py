"""simadmit: capacity planning for queue-based admission control in front of a vLLM pool."""

__version__ = "0.1.0"
