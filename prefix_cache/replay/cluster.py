"""Several engine replicas behind one router (``prefix-cache replay --replicas N --router ...``).

Each replica is the scheduler of :mod:`prefix_cache.replay.simulator` with its own
``PrefixCache`` and pool, its own FCFS queue and ``max_running``; the ``clients`` users and their
conversations are shared, and each request goes to the replica the router picks when it arrives.
Replicas step in lockstep. After every step each replica publishes its cache's events through a
:class:`KVEventPublisher` (ZMQ PUB and replay ROUTER sockets on the loopback interface); a
:class:`KVEventSubscriber` feeds them to the router's :class:`BlockIndex`. Before routing the
requests that arrived during a step, the router waits until its index has applied every batch
published so far, so its view is the replicas' state at the end of the previous step: the results
do not depend on thread timing. Users think between turns on one clock for all replicas, as in
:mod:`prefix_cache.replay.clock`.

Measured per router: the aggregate hit rate; the best possible with unlimited pages (one index of
every page ever computed, over the same request order); load imbalance, the mean over steps of
(max / mean running requests over replicas); event traffic, published messages and bytes (all
frames) per admitted request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.events.index import BlockIndex
from prefix_cache.events.publisher import KVEventPublisher
from prefix_cache.events.subscriber import KVEventSubscriber
from prefix_cache.replay.clock import ThinkingUsers, ThinkTime
from prefix_cache.replay.conversation import Conversation, Workload
from prefix_cache.replay.oracle import UnlimitedPrefixIndex
from prefix_cache.replay.report import aligned
from prefix_cache.replay.routing import MAX_REPLICAS, make_router

# The per-request and per-user state of the single-engine scheduler, reused as is.
from prefix_cache.replay.simulator import Replay, SchedulerConfig, _Client, _Request, replay

LOOPBACK = "tcp://127.0.0.1:0"


@dataclass
class ClusterResult:
    """One router's replay over ``replicas`` replicas. Tokens are prompt tokens."""

    router: str
    replicas: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    best_cached_tokens: int = 0
    steps: int = 0
    imbalance_sum: float = 0.0
    busy_steps: int = 0
    messages: int = 0
    event_bytes: int = 0
    replays: int = 0
    resyncs: int = 0
    skipped_requests: int = 0
    drain_ns: int = 0
    publish_ns: int = 0
    wall_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        """With unlimited pages: every page ever computed on any replica, matchable everywhere."""
        return self.best_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """Mean over steps with a running request of max / mean running requests per replica."""
        return self.imbalance_sum / self.busy_steps if self.busy_steps else 1.0

    @property
    def drain_us(self) -> float:
        """Microseconds per replica per step in ``cache.drain_events()``."""
        return self.drain_ns / 1e3 / (self.steps * self.replicas) if self.steps else 0.0

    @property
    def publish_us(self) -> float:
        """Microseconds per replica per step in ``publish(events)``: the engine's part of publishing
        (encoding and sending happen in the publisher's thread)."""
        return self.publish_ns / 1e3 / (self.steps * self.replicas) if self.steps else 0.0

    @property
    def messages_per_request(self) -> float:
        return self.messages / self.requests if self.requests else 0.0

    @property
    def bytes_per_request(self) -> float:
        return self.event_bytes / self.requests if self.requests else 0.0


class _Replica(Replay):
    """One engine of the cluster: the single-engine scheduler whose arrivals go through the router."""

    def __init__(self, cluster: _Cluster, number: int, config: SchedulerConfig) -> None:
        super().__init__(PrefixCache(config.num_pages, config.page_size), [], config)
        self.cluster = cluster
        self.number = number
        self.oracle = cluster.oracle  # one unlimited index over all replicas: the best possible

    def _enqueue_turn(self, client: _Client) -> None:
        self.cluster.enqueue_turn(client)

    def _next_turn(self, client: _Client) -> None:
        self.cluster.next_turn(client)

    def _start_next_conversation(self) -> None:
        self.cluster.start_next_conversation()

    def _close(self, req: _Request, completed: bool) -> None:
        self.cluster.loads[self.number] -= 1
        super()._close(req, completed)


class _Cluster:
    def __init__(
        self,
        conversations: list[Conversation],
        config: SchedulerConfig,
        replicas: int,
        router: str,
        on_request_done: Callable[[int], object] | None,
    ) -> None:
        self.config = config
        self.oracle = UnlimitedPrefixIndex(config.page_size)
        self.unstarted = deque(conversations)
        self.sessions: dict[_Client, int] = {}
        self.pending: list[_Request] = []
        self.loads = [0] * replicas
        self.replicas = [_Replica(self, r, config) for r in range(replicas)]
        if on_request_done is not None:
            for replica in self.replicas:
                replica._on_request_done = on_request_done
        self.index = BlockIndex(replicas, config.page_size)
        self.router = make_router(router, replicas, self.index)
        self.result = ClusterResult(router, replicas)
        # Steps elapsed on the simulated clock, idle ones included, and the users thinking.
        self.clock = 0
        self.thinking: ThinkingUsers[_Client] | None = None
        if config.think_time > 0:
            self.thinking = ThinkingUsers(ThinkTime(config.think_time, config.seed), config.step_time)

    def start_next_conversation(self) -> None:
        if self.unstarted:
            client = _Client(self.unstarted.popleft())
            self.sessions[client] = len(self.sessions)
            self.enqueue_turn(client)

    def enqueue_turn(self, client: _Client) -> None:
        turn = client.conv.turns[client.turn]
        tokens = np.concatenate([client.context, turn.user])
        client.outstanding = len(turn.replies)
        for sample, reply in enumerate(turn.replies):
            self.pending.append(_Request(client, sample, tokens, reply))

    def next_turn(self, client: _Client) -> None:
        """The next turn of ``client``, whose turn ended this step: now, or after a think time."""
        if self.thinking is None:
            self.enqueue_turn(client)
        else:
            self.thinking.think(client, self.clock + 1)

    def arrive(self) -> None:
        """Users done thinking send their next turn; with nothing to run anywhere, the clock first
        jumps to the next one."""
        thinking = self.thinking
        if not thinking:
            return
        if not self.pending and not any(r._queue or r._running for r in self.replicas):
            self.clock = max(self.clock, thinking.next_step)
        for client in thinking.back(self.clock):
            self.enqueue_turn(client)

    def route_pending(self) -> None:
        for req in self.pending:
            replica = self.router.choose(req.prompt, self.sessions[req.client], self.loads)
            self.loads[replica] += 1
            self.replicas[replica]._queue.append(req)
        self.pending = []

    def busy(self) -> bool:
        return bool(self.pending or self.thinking) or any(r._queue or r._running for r in self.replicas)

    def run(self) -> ClusterResult:
        res = self.result
        start = time.perf_counter()
        publishers: list[KVEventPublisher] = []
        try:
            for _ in self.replicas:
                publishers.append(KVEventPublisher(LOOPBACK, LOOPBACK))
            with KVEventSubscriber(self.index) as subscriber:
                for number, pub in enumerate(publishers):
                    subscriber.connect(number, pub.endpoint, pub.replay_endpoint)
                for _ in range(self.config.clients):
                    self.start_next_conversation()
                while self.busy():
                    subscriber.wait_for({n: pub.next_seq for n, pub in enumerate(publishers)})
                    self.arrive()
                    self.route_pending()
                    self.step()
                    self.clock += 1
                    for replica, pub in zip(self.replicas, publishers, strict=True):
                        t0 = time.perf_counter_ns()
                        events = replica.cache.drain_events()
                        t1 = time.perf_counter_ns()
                        pub.publish(events)
                        res.drain_ns += t1 - t0
                        res.publish_ns += time.perf_counter_ns() - t1
                for pub in publishers:
                    pub.flush()
                for number in range(len(publishers)):
                    res.replays += subscriber.counters(number).replays
                    res.resyncs += subscriber.counters(number).resyncs
        finally:
            for pub in publishers:
                pub.close()
        for replica, pub in zip(self.replicas, publishers, strict=True):
            part = replica.result
            res.requests += part.requests
            res.prompt_tokens += part.prompt_tokens
            res.cached_tokens += part.cached_tokens
            res.best_cached_tokens += part.best_cached_tokens
            res.skipped_requests += part.skipped_requests
            res.messages += pub.published
            res.event_bytes += pub.bytes_sent
        res.wall_seconds = time.perf_counter() - start
        return res

    def step(self) -> None:
        """One lockstep scheduler step of every replica (as ``Replay.run`` does for one)."""
        for replica in self.replicas:
            replica._admit()
        running = [len(replica._running) for replica in self.replicas]
        self.result.steps += 1
        if any(running):
            self.result.busy_steps += 1
            self.result.imbalance_sum += max(running) * len(running) / sum(running)
        for replica in self.replicas:
            replica._decode_step()
        for replica in self.replicas:
            replica._close_finished()


def replay_cluster(
    conversations: list[Conversation],
    config: SchedulerConfig,
    replicas: int,
    router: str,
    on_request_done: Callable[[int], object] | None = None,
) -> ClusterResult:
    """Replay ``conversations`` over ``replicas`` replicas, each with ``config``'s pages and
    ``max_running``, behind ``router``; ``config.clients`` users in all."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be an int in [1, {MAX_REPLICAS}], got {replicas!r}")
    if config.host_pages:
        raise ValueError(f"host_pages must be 0 behind a router (one engine only), got {config.host_pages}")
    return _Cluster(conversations, config, replicas, router, on_request_done).run()


def format_cluster_report(
    workload: Workload,
    config: SchedulerConfig,
    replicas: int,
    one_cache_hit_rate: float,
    results: list[ClusterResult],
) -> str:
    """The routers side by side; ``one_cache_hit_rate`` is the hit rate of a single engine with
    ``replicas`` times the pages and running requests."""
    think = (
        f", think time {config.think_time:g} s mean at {config.step_time:g} s per step"
        if config.think_time
        else ""
    )
    head = [
        f"workload      {workload.name}: {len(workload.conversations):,} conversations, "
        f"{config.clients} clients{think}",
        f"replicas      {replicas} x ({config.num_pages:,} pages x {config.page_size} tokens, "
        f"{config.max_running} running max); events over ZMQ on loopback",
        f"one cache     {one_cache_hit_rate:.2%} hit rate with {replicas * config.num_pages:,} pages and "
        f"{replicas * config.max_running} running max (the same total size)",
        "",
    ]
    columns = (
        "router",
        "hit rate",
        "unlimited",
        "imbalance",
        "msgs/req",
        "bytes/req",
        "drain, publish",
        "replays",
        "time",
    )
    rows = [
        (
            r.router,
            f"{r.hit_rate:.2%}",
            f"{r.best_hit_rate:.2%}",
            f"{r.imbalance:.2f}",
            f"{r.messages_per_request:.1f}",
            f"{r.bytes_per_request:,.0f}",
            f"{r.drain_us:.1f}, {r.publish_us:.1f} µs",
            f"{r.replays}",
            f"{r.wall_seconds:.1f} s",
        )
        for r in results
    ]
    lines = aligned(columns, rows)
    notes = [
        "",
        "hit rate: cached / prompt tokens over all replicas; unlimited: the best possible with unlimited",
        "pages for the same request order; imbalance: mean over steps of max / mean running requests per",
        "replica; msgs, bytes/req: event batches published (all frames) per admitted request; drain,",
        "publish: the engine's time in cache.drain_events() and in publish(events) per replica per step.",
    ]
    return "\n".join(head + lines + notes)


def compare_routers(
    workload: Workload, config: SchedulerConfig, replicas: int, routers: Sequence[str], progress: bool = False
) -> str:
    """Replay ``workload`` behind each of ``routers`` and once through one engine of the same total
    size; the report of :func:`format_cluster_report`."""
    for name in routers:
        make_router(name, replicas, BlockIndex(replicas, config.page_size))  # fails before any work
    conversations = workload.conversations
    total = sum(len(t.replies) for conv in conversations for t in conv.turns)
    results = []
    for name in routers:
        if progress:
            from tqdm import tqdm  # optional dependency: the ``replay`` extra

            with tqdm(desc=name, unit="req", total=total) as bar:
                results.append(replay_cluster(conversations, config, replicas, name, bar.update))
        else:
            results.append(replay_cluster(conversations, config, replicas, name))
    one = replace(config, num_pages=replicas * config.num_pages, max_running=replicas * config.max_running)
    _, single = replay(conversations, one)
    return format_cluster_report(workload, config, replicas, single.hit_rate, results)
