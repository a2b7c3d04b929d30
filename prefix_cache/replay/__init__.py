"""Replay of multi-turn chat workloads through the cache."""
