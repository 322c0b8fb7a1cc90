"""Open-loop load generation against a live OpenAI-compatible endpoint (`simadmit replay`)."""
