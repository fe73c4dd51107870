"""kvgate: admit LLM requests by the engines' real KV-cache state, not by requests per second."""

__version__ = "0.1.0"
