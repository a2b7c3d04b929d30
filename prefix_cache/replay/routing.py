"""Routers that pick an engine replica for each request (``prefix-cache replay --router``).

Each router sees the prompt, the session (conversation) it belongs to and the router's own count of
outstanding requests per replica (sent and not yet finished), and returns a replica number.

- ``round-robin``: replicas in turn.
- ``least-loaded``: the replica with the fewest outstanding requests (lowest number on ties).
- ``session``: a conversation sticks to one replica, ``xxh3_64(session id) % replicas`` (what a
  load balancer with session affinity does).
- ``prefix``: the replica holding the longest prefix of the prompt, from a :class:`BlockIndex` fed by
  the replicas' KV events, among the replicas at most ``slack`` requests busier than the least loaded
  one (``slack = max(2, ceil(load_slack * mean outstanding))``); ties go to the less loaded replica.
  Without the cap every turn of every conversation would pile onto whichever replica served its
  first turn.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
from xxhash import xxh3_64_intdigest

from prefix_cache.events.index import BlockIndex

ROUTERS = ("round-robin", "least-loaded", "session", "prefix")
#: The replay runs every replica in one process, in lockstep: a cap keeps a run bounded.
MAX_REPLICAS = 64


class Router(Protocol):
    def choose(self, prompt: np.ndarray, session: int, loads: list[int]) -> int:
        """The replica for a request; ``loads[r]`` counts replica ``r``'s outstanding requests."""
        ...


class RoundRobin:
    def __init__(self, num_replicas: int) -> None:
        self._num_replicas = num_replicas
        self._next = 0

    def choose(self, prompt: np.ndarray, session: int, loads: list[int]) -> int:
        replica = self._next
        self._next = (replica + 1) % self._num_replicas
        return replica


class LeastLoaded:
    def choose(self, prompt: np.ndarray, session: int, loads: list[int]) -> int:
        return loads.index(min(loads))


class SessionAffinity:
    def __init__(self, num_replicas: int) -> None:
        self._num_replicas = num_replicas

    def choose(self, prompt: np.ndarray, session: int, loads: list[int]) -> int:
        return xxh3_64_intdigest(session.to_bytes(8, "little")) % self._num_replicas


class PrefixAware:
    """Longest cached prefix per ``index``, under a load cap (see the module docstring)."""

    def __init__(self, index: BlockIndex, load_slack: float = 0.25) -> None:
        if not load_slack >= 0:
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        self.index = index
        self.load_slack = load_slack

    def choose(self, prompt: np.ndarray, session: int, loads: list[int]) -> int:
        hits = self.index.match(prompt)
        least = min(loads)
        slack = max(2, math.ceil(self.load_slack * sum(loads) / len(loads)))
        best = -1
        for replica, load in enumerate(loads):
            if load <= least + slack and (best < 0 or (hits[replica], -load) > (hits[best], -loads[best])):
                best = replica
        return best


def make_router(name: str, num_replicas: int, index: BlockIndex | None = None) -> Router:
    """The router called ``name`` (one of ``ROUTERS``); ``prefix`` needs the ``index``."""
    if name == "round-robin":
        return RoundRobin(num_replicas)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "session":
        return SessionAffinity(num_replicas)
    if name == "prefix":
        if index is None:
            raise ValueError("the prefix router needs a BlockIndex")
        return PrefixAware(index)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
