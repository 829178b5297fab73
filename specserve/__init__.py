"""specserve: speculative decoding served as draft, target and orchestrator services."""

__version__ = "0.1.0"
