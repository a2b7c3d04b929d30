"""prefix-cache: prefix KV-cache bookkeeping and cascade attention for LLM serving engines."""

__version__ = "0.1.0"
