"""Replay of multi-turn chat workloads through the cache (``prefix-cache replay``).

- ``conversation``: conversations as int32 token arrays, and the prompt / reply caps.
- ``sharegpt``: record-by-record reading of the (truncated) ShareGPT JSON file.
- ``chat``: the Llama 3 tokenizer and chat-template framing.
- ``synthetic``: a seeded synthetic workload (system prompt, turns, parallel samples).
- ``workloads``: either source, tokenized and capped, as a ``Workload``.
- ``simulator``: the continuous-batching scheduler that drives a ``PrefixCache`` and times it.
- ``clock``: the simulated clock (seconds per step) and users' think time between turns.
- ``oracle``: the best possible hits, from a page index that never evicts.
- ``report``: the text report.
- ``routing``, ``cluster``: several replicas behind a router, events over ZMQ (``--replicas``).
"""
