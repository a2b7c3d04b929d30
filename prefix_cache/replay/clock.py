"""The replay's simulated clock: a fixed duration per engine step, and users who think between turns.

Cost model: every engine step takes ``step_time`` seconds, whatever it holds (the step's
admissions and their prefills, one decode token per running request). Step ``s`` runs from
``s * step_time`` to ``(s + 1) * step_time``; a turn ends at the end of the step that finished its
last sample.

Think time: a user reads the reply and types the next message before the conversation's next turn
arrives. The seconds are drawn, once per turn, from an exponential distribution of mean
``think_time`` (memoryless: a user who has thought for a while is no likelier to be done). A turn
that ends at time ``t`` has its next turn join the queue at the start of the first step that starts
at or after ``t + think time``. While users think, the other conversations keep running and
churning the pool; when every user is thinking the engine is idle and the clock jumps to the next
arrival. A user whose conversation ended starts the next one at once, as without think time.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

import numpy as np

User = TypeVar("User")


class ThinkTime:
    """Think times in seconds: exponential with mean ``mean_seconds`` (``> 0``), from ``seed``."""

    def __init__(self, mean_seconds: float, seed: int = 0) -> None:
        if not mean_seconds > 0:
            raise ValueError(f"mean_seconds must be > 0, got {mean_seconds}")
        self.mean_seconds = mean_seconds
        self._rng = np.random.default_rng(seed)

    def draw(self) -> float:
        """One think time, in seconds."""
        return float(self._rng.exponential(self.mean_seconds))


class ThinkingUsers(Generic[User]):
    """Users between two turns, and the step at which each comes back.

    ``step_time``: seconds per engine step, ``> 0``. Users who come back at the same step come back
    in the order they started thinking, so a replay is deterministic.
    """

    def __init__(self, think_time: ThinkTime, step_time: float) -> None:
        if not step_time > 0:
            raise ValueError(f"step_time must be > 0, got {step_time}")
        self.think_time = think_time
        self.step_time = step_time
        self._heap: list[tuple[int, int, User]] = []
        self._pushed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def think(self, user: User, end_step: int) -> None:
        """``user``'s turn ended at the start of step ``end_step`` (the end of the step before):
        they come back at the first step that starts at or after a think time drawn now."""
        back = end_step + math.ceil(self.think_time.draw() / self.step_time)
        heapq.heappush(self._heap, (back, self._pushed, user))
        self._pushed += 1

    @property
    def next_step(self) -> int:
        """The step at which the next user comes back (there must be one)."""
        return self._heap[0][0]

    def back(self, step: int) -> list[User]:
        """The users who come back at or before step ``step``, in order; they stop thinking."""
        heap = self._heap
        users = []
        while heap and heap[0][0] <= step:
            users.append(heapq.heappop(heap)[2])
        return users
