"""inferq: priority-, deadline- and GPU-aware scheduling of LLM inference requests on Redis."""

__version__ = "0.1.0"
