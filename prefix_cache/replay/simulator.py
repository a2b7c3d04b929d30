"""A continuous-batching scheduler that replays chat conversations through a :class:`PrefixCache`.

Model of the engine:

- ``clients`` users each replay one conversation turn by turn and then start the next unstarted
  one. A turn's requests (one per parallel sample) arrive when the user's previous turn has finished
  every sample, at the back of one FCFS queue; with a ``think_time``, after the user has read the
  reply and typed the next message (:mod:`prefix_cache.replay.clock`: a simulated clock of
  ``step_time`` seconds per step).
- Each scheduler step first admits requests from the head of the queue while fewer than
  ``max_running`` run. Admission is the prefill: ``open`` the prompt, ``allocate`` its uncached
  tokens and ``commit`` them, all in that step. Then every running request decodes one reply token
  (``allocate(seq, 1)``, ``commit``), and requests whose reply is complete are ``close``\\ d.
- No preemption, so admission reserves the pages a request's whole reply will need: the head waits
  (its prefix stays locked by its ``open``) until free plus evictable pages cover the pages every
  running request may still allocate plus its own prompt and reply. Should its ``open`` lock
  evictable pages the running requests count on, it closes again and reopens once the pages it
  took and those it still needs are spare. A head that cannot fit even with nothing running is
  skipped and its conversation ends there; nothing can deadlock.
- With a host tier (``host_pages > 0``), GPU eviction moves cached pages to host pages and ``open``
  also finds a prefix there: it gives the sequence GPU pages for that part and queues their loads.
  Each step ends with one ``take_transfers`` whose copies are done at once (``transfers_done``):
  data movement is not simulated, only the bookkeeping. A request whose prefix is loading holds its
  pages and a running slot from admission, and prefills at the next step, once the loads are done.
  Since opening takes pages for the loads (and evicts for them), a head with fewer spare pages
  than its prompt and reply need is first looked up with ``match`` (and again after a prefill,
  which may have cached more of its prompt; the time counts as ``open``'s) and opened only if its
  prefix on the GPU can make up the difference.
- Alongside, :class:`UnlimitedPrefixIndex` sees the same opens and commits and gives the hits of a
  cache with unlimited pages: the best possible hit rate for this request order.

Time inside cache calls is measured with ``time.perf_counter_ns`` around the calls only. The decode
step times the loop over running requests as a whole, to keep the timer out of a ~1 µs operation;
the loop itself adds about 0.1 µs per request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache
from prefix_cache.cache.stats import CacheStats
from prefix_cache.replay.clock import ThinkingUsers, ThinkTime
from prefix_cache.replay.conversation import Conversation
from prefix_cache.replay.oracle import ROOT, UnlimitedPrefixIndex


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the simulated engine; pages of ``page_size`` tokens.

    16384 pages of 16 tokens hold 262k tokens: 32 GiB of KV at Llama-3-8B's 128 KiB per token,
    a fraction of one H200's memory.

    ``think_time``: mean seconds a user thinks between a turn's end and the conversation's next
    turn, exponentially distributed (:class:`prefix_cache.replay.clock.ThinkTime`); 0 for none, the
    next turn arriving as the previous one ends. ``step_time``: simulated seconds per engine step,
    whatever it computes (20 ms: a decode step of a few dozen requests on an 8B model). ``seed``
    seeds the think times. ``host_pages``: pages of the cache's host tier, 0 for none;
    ``host_write_through``: the tier copies pages when they are cached (``PrefixCache(...,
    write_through=True)``), not when evicted.
    """

    num_pages: int = 16384
    page_size: int = 16
    max_running: int = 64
    clients: int = 128
    think_time: float = 0.0
    step_time: float = 0.02
    seed: int = 0
    host_pages: int = 0
    host_write_through: bool = False


@dataclass
class ReplayResult:
    """What a replay measured. Token counts are tokens; times are nanoseconds in cache calls.

    ``cached_tokens`` sums ``num_cached_tokens`` over admitted requests, ``best_cached_tokens`` the
    same with unlimited pages. ``skipped_requests`` could not fit in the pool even alone;
    ``cut_replies`` ran out of pages mid-decode (not expected: admission reserves their pages).
    ``steps`` counts the steps the engine ran, ``idle_steps`` those the simulated clock skipped
    while every user was thinking; ``simulated_seconds`` is the clock at the end. With a host tier,
    ``host_cached_tokens`` is the part of ``cached_tokens`` found on the host (loaded), and
    ``saved_pages`` / ``loaded_pages`` count the copies of the transfer batches.
    """

    conversations: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    best_cached_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    idle_steps: int = 0
    simulated_seconds: float = 0.0
    skipped_requests: int = 0
    cut_replies: int = 0
    conversations_cut: int = 0
    peak_running: int = 0
    peak_locked_pages: int = 0
    peak_used_pages: int = 0
    open_ns: int = 0
    prefill_ns: int = 0
    decode_ns: int = 0
    close_ns: int = 0
    transfer_ns: int = 0
    saved_pages: int = 0
    loaded_pages: int = 0
    closed: int = 0
    wall_seconds: float = 0.0
    stats: CacheStats | None = field(default=None, repr=False)

    @property
    def hit_rate(self) -> float:
        """Cached share of prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        """Share of prompt tokens found on the GPU."""
        return self.hit_rate - self.host_hit_rate

    @property
    def host_hit_rate(self) -> float:
        """Share of prompt tokens found on the host tier and loaded."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        """Cached share of prompt tokens with unlimited pages."""
        return self.best_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def admit_us(self) -> float:
        """Microseconds in cache calls per admitted request (open, allocate, commit)."""
        return self.open_us + self.prefill_us

    @property
    def open_us(self) -> float:
        """Microseconds in ``open`` per admitted request (with the ``open`` and ``close`` of a queue
        head that had to let go of its prefix and reopen later)."""
        return self.open_ns / 1e3 / self.requests if self.requests else 0.0

    @property
    def prefill_us(self) -> float:
        """Microseconds per admitted request in ``allocate`` + ``commit`` of its uncached prompt
        tokens (attempts that raised ``OutOfPages`` included)."""
        return self.prefill_ns / 1e3 / self.requests if self.requests else 0.0

    @property
    def decode_us(self) -> float:
        """Microseconds in cache calls per running request per step (allocate + commit of 1 token)."""
        return self.decode_ns / 1e3 / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def close_us(self) -> float:
        """Microseconds in ``close`` per finished request."""
        return self.close_ns / 1e3 / self.closed if self.closed else 0.0

    @property
    def transfer_us(self) -> float:
        """Microseconds per step in ``take_transfers`` + ``transfers_done`` (host tier only)."""
        return self.transfer_ns / 1e3 / self.steps if self.steps else 0.0


class _Request:
    """One request: a prompt and the reply it decodes. ``pos`` counts reply tokens committed."""

    __slots__ = (
        "best_hit",
        "client",
        "gpu_hit",
        "host_hit",
        "last_page",
        "looked_at",
        "pos",
        "prompt",
        "reply",
        "reply_ids",
        "sample",
        "seq",
        "tokens",
    )

    def __init__(self, client: _Client, sample: int, prompt: np.ndarray, reply: np.ndarray) -> None:
        self.client = client
        self.sample = sample
        self.prompt = prompt
        self.reply = reply
        self.tokens = np.concatenate([prompt, reply])
        self.seq = None
        self.reply_ids: list[int] = []  # the reply as ints, from admission on
        self.pos = 0
        # Unlimited-pages hit and the page it ends at (see UnlimitedPrefixIndex), set at open.
        self.best_hit = 0
        self.last_page = ROOT
        # Prompt tokens its ``open`` found on the host tier, to be loaded.
        self.host_hit = 0
        # Its prompt's prefix on the GPU when the scheduler last had to look (-1: not yet), and
        # the replay's prefills by then (a prefill since may have cached more of it).
        self.gpu_hit = -1
        self.looked_at = 0


class _Client:
    """A user replaying one conversation: its history so far and the samples still outstanding."""

    __slots__ = ("context", "conv", "cut", "outstanding", "turn")

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self.turn = 0
        self.context = conv.prefix
        self.outstanding = 0
        self.cut = False


class Replay:
    """Replays conversations through ``cache``; :meth:`run` does it once.

    ``on_request_done(n)`` is called as ``n`` requests end or are given up (for a progress bar).
    """

    def __init__(
        self,
        cache: PrefixCache,
        conversations: list[Conversation],
        config: SchedulerConfig,
        on_request_done: Callable[[int], object] | None = None,
    ) -> None:
        if config.max_running < 1 or config.clients < 1:
            raise ValueError("max_running and clients must be at least 1")
        if not config.think_time >= 0 or not config.step_time > 0:
            raise ValueError(
                f"think_time must be >= 0 and step_time > 0, got {config.think_time} and {config.step_time}"
            )
        self.cache = cache
        self.config = config
        self.ps = config.page_size
        self.oracle = UnlimitedPrefixIndex(config.page_size)
        self.result = ReplayResult()
        self._unstarted = deque(conversations)
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []
        # With a host tier: admitted requests whose prefix loads during this step.
        self._tiered = config.host_pages > 0
        self._loading: list[_Request] = []
        # Pages the head of the queue took from the free and evictable ones when it last opened
        # and had to let go, and those it needed beyond (0: none): it opens again once as many are
        # spare.
        self._let_go_need = 0
        # Prompts prefilled so far (see ``_Request.looked_at``).
        self._prefills = 0
        self._on_request_done = on_request_done or (lambda n: None)
        # Steps elapsed on the simulated clock, idle ones included, and the users thinking.
        self._clock = 0
        self._thinking: ThinkingUsers[_Client] | None = None
        if config.think_time > 0:
            self._thinking = ThinkingUsers(ThinkTime(config.think_time, config.seed), config.step_time)

    def run(self) -> ReplayResult:
        """Replay every conversation to the end; returns the measurements."""
        start = time.perf_counter()
        for _ in range(self.config.clients):
            self._start_next_conversation()
        cache, res = self.cache, self.result
        while self._queue or self._running or self._loading or self._thinking:
            self._arrive()
            self._admit()
            res.steps += 1
            res.peak_running = max(res.peak_running, len(self._running))
            self._decode_step()
            # Sampled when the step's pages are all allocated, before finished requests let go.
            free, evictable = cache.num_free_pages, cache.num_evictable_pages
            res.peak_locked_pages = max(res.peak_locked_pages, cache.num_pages - free - evictable)
            res.peak_used_pages = max(res.peak_used_pages, cache.num_pages - free)
            self._close_finished()
            if self._tiered:
                self._transfer()
            self._clock += 1
        res.simulated_seconds = self._clock * self.config.step_time
        res.wall_seconds = time.perf_counter() - start
        res.stats = cache.stats
        return res

    # -- arrivals -----------------------------------------------------------------------------------

    def _arrive(self) -> None:
        """Users done thinking send their next turn; with nothing to run, the clock first jumps to
        the next one."""
        thinking = self._thinking
        if not thinking:
            return
        if not self._queue and not self._running and not self._loading:
            idle = thinking.next_step - self._clock
            if idle > 0:
                self.result.idle_steps += idle
                self._clock += idle
        for client in thinking.back(self._clock):
            self._enqueue_turn(client)

    def _start_next_conversation(self) -> None:
        if self._unstarted:
            client = _Client(self._unstarted.popleft())
            self.result.conversations += 1
            self._enqueue_turn(client)

    def _enqueue_turn(self, client: _Client) -> None:
        turn = client.conv.turns[client.turn]
        prompt = np.concatenate([client.context, turn.user])
        client.outstanding = len(turn.replies)
        for sample, reply in enumerate(turn.replies):
            self._queue.append(_Request(client, sample, prompt, reply))

    def _finish(self, req: _Request, completed: bool) -> None:
        """Bookkeeping after a request ends: the next turn once all samples are done."""
        client = req.client
        client.outstanding -= 1
        if req.sample == 0:
            if completed:
                client.context = req.tokens
            else:
                client.cut = True  # the conversation cannot go on without its reply
        self._on_request_done(1)
        if client.outstanding:
            return
        client.turn += 1
        remaining = client.conv.turns[client.turn :]
        if remaining and not client.cut:
            self._next_turn(client)
            return
        if remaining:
            self.result.conversations_cut += 1
            self._on_request_done(sum(len(t.replies) for t in remaining))
        self._start_next_conversation()

    def _next_turn(self, client: _Client) -> None:
        """The next turn of ``client``, whose turn ended this step: now, or after a think time."""
        if self._thinking is None:
            self._enqueue_turn(client)
        else:
            self._thinking.think(client, self._clock + 1)

    # -- admission ----------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def _reserved_pages(self) -> int:
        """Pages the running and loading requests may still allocate until their replies are
        complete."""
        ps = self.ps
        reserved = sum(-(-len(r.tokens) // ps) - -(-(len(r.prompt) + r.pos) // ps) for r in self._running)
        if self._loading:
            reserved += sum(
                -(-len(r.tokens) // ps) - -(-r.seq.num_allocated_tokens // ps) for r in self._loading
            )
        return reserved

    def _admit(self) -> None:
        cache, res = self.cache, self.result
        if self._loading:
            self._prefill_loaded()
        while self._queue and len(self._running) + len(self._loading) < self.config.max_running:
            req = self._queue[0]
            if req.seq is None:
                spare = cache.num_free_pages + cache.num_evictable_pages - self._reserved_pages()
                # With nothing running nothing will be freed: the head opens (and is skipped below
                # if it cannot fit even so).
                busy = self._running or self._loading
                if busy and spare < self._let_go_need:
                    return  # the head's last open took more pages than are spare now
                need = self._pages(len(req.tokens))
                if busy and self._tiered and spare < need:
                    # Opening takes pages for the loads of its prefix on the host, and evicts for
                    # them: it fits only if its prefix on the GPU (which running requests may hold,
                    # so that it takes no spare page) makes up the difference, so look before
                    # opening (again only after a prefill, which may have cached more of the
                    # prompt: a sibling sample's), and wait while even that would not do. (Without
                    # a host tier an open takes no page but its prefix's, and is its own look.)
                    if req.gpu_hit < 0 or req.looked_at != self._prefills:
                        t0 = time.perf_counter_ns()
                        req.gpu_hit = cache.match(req.prompt)
                        res.open_ns += time.perf_counter_ns() - t0
                        req.looked_at = self._prefills
                    if spare < need - req.gpu_hit // self.ps:
                        return
                t0 = time.perf_counter_ns()
                req.seq = cache.open(req.prompt)
                res.open_ns += time.perf_counter_ns() - t0
                if self._tiered:
                    req.host_hit = req.seq.num_loading_tokens
                req.best_hit, req.last_page = self.oracle.match(req.prompt)
                left = cache.num_free_pages + cache.num_evictable_pages - self._reserved_pages()
                if left < 0:
                    # Its prefix locked evictable pages (and, with a host tier, took pages for its
                    # loads) that running requests count on: let go until the pages it took and
                    # those it still needs are spare, so it is not opened and closed again at every
                    # step.
                    remaining = self._pages(len(req.tokens)) - req.seq.num_cached_tokens // self.ps
                    t0 = time.perf_counter_ns()
                    cache.close(req.seq)
                    res.open_ns += time.perf_counter_ns() - t0
                    req.seq = None
                    self._let_go_need = spare - left + remaining
                    return
                self._let_go_need = 0
            cached = req.seq.num_cached_tokens
            needed = self._pages(len(req.tokens)) - cached // self.ps + self._reserved_pages()
            # A prefix still loading (the head may have waited while its loads were made) is
            # prefilled at the next step.
            loading = self._tiered and req.seq.num_loading_tokens > 0
            if cache.num_free_pages + cache.num_evictable_pages >= needed:
                admitted = loading or self._prefill(req)
            else:
                admitted = False
            if not admitted:
                if self._running or self._loading:
                    return  # FCFS: the head waits for running requests to free pages
                self._skip(req)
                continue
            self._queue.popleft()
            (self._loading if loading else self._running).append(req)
            req.reply_ids = req.reply.tolist()
            res.requests += 1
            res.prompt_tokens += len(req.prompt)
            res.cached_tokens += cached
            res.host_cached_tokens += req.host_hit
            res.best_cached_tokens += req.best_hit
            req.last_page = self.oracle.extend_all(req.last_page, req.prompt, req.best_hit)

    def _prefill(self, req: _Request) -> bool:
        """``allocate`` and ``commit`` the uncached prompt tokens of ``req``; False if the pool ran
        out of pages (nothing allocated)."""
        cache = self.cache
        cached = req.seq.num_cached_tokens
        t0 = time.perf_counter_ns()
        try:
            cache.allocate(req.seq, len(req.prompt) - cached)
            cache.commit(req.seq, req.prompt[cached:])
            self._prefills += 1
            done = True
        except OutOfPages:
            done = False
        self.result.prefill_ns += time.perf_counter_ns() - t0
        return done

    def _prefill_loaded(self) -> None:
        """The requests whose prefix was loaded from the host tier last step start running."""
        loaded, self._loading = self._loading, []
        for req in loaded:
            if self._prefill(req):
                self._running.append(req)
            else:
                # Not expected (admission reserved its pages): the reply is cut before it starts.
                self.result.cut_replies += 1
                self._close(req, completed=False)

    def _skip(self, req: _Request) -> None:
        """Drop a request that cannot fit even in an idle pool."""
        self._queue.popleft()
        self.result.skipped_requests += 1
        self._close(req, completed=False)

    # -- decode -------------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        """One reply token for every running request."""
        cache, res = self.cache, self.result
        allocate, commit = cache.allocate, cache.commit
        # Built before the timer starts: the sampled token as an engine holds it after ``.tolist()``
        # on the sampler's output, in the one-int list of the engine contract. (A one-token int32
        # view takes ``commit``'s other per-token path, about 0.15 µs slower.)
        work = [(r.seq, [r.reply_ids[r.pos]]) for r in self._running]
        starved = []
        t0 = time.perf_counter_ns()
        for seq, token in work:
            try:
                allocate(seq, 1)
            except OutOfPages:
                starved.append(seq)
                continue
            commit(seq, token)
        res.decode_ns += time.perf_counter_ns() - t0
        res.decode_tokens += len(work) - len(starved)
        if starved:
            # Not expected (admission reserves the pages): end those replies where they are.
            cut = [r for r in self._running if r.seq in starved]
            self._running = [r for r in self._running if r.seq not in starved]
            for req in cut:
                res.cut_replies += 1
                self._close(req, completed=False)
        ps, oracle = self.ps, self.oracle
        for req in self._running:
            req.pos += 1
            end = len(req.prompt) + req.pos
            if end % ps == 0:
                req.last_page = oracle.extend(req.last_page, req.tokens[end - ps : end])

    def _close_finished(self) -> None:
        running = self._running
        if any(r.pos == len(r.reply) for r in running):
            self._running = [r for r in running if r.pos < len(r.reply)]
            for req in running:
                if req.pos == len(req.reply):
                    self._close(req, completed=True)

    def _close(self, req: _Request, completed: bool) -> None:
        t0 = time.perf_counter_ns()
        self.cache.close(req.seq)
        self.result.close_ns += time.perf_counter_ns() - t0
        self.result.closed += 1
        self._finish(req, completed)

    # -- host tier ----------------------------------------------------------------------------------

    def _transfer(self) -> None:
        """The copies the cache asks for this step, made at once: saves of GPU-evicted pages to
        the host, loads of host prefixes into the pages of the requests now loading."""
        cache, res = self.cache, self.result
        t0 = time.perf_counter_ns()
        batch = cache.take_transfers()
        if batch is not None:
            cache.transfers_done(batch)
        res.transfer_ns += time.perf_counter_ns() - t0
        if batch is not None:
            res.saved_pages += len(batch.saves)
            res.loaded_pages += len(batch.loads)


def replay(
    conversations: list[Conversation],
    config: SchedulerConfig,
    cache: PrefixCache | None = None,
    progress: bool = False,
) -> tuple[PrefixCache, ReplayResult]:
    """Replay ``conversations`` through ``cache`` (a new one sized by ``config`` if None, with
    ``config.host_pages`` host pages; a given cache must have them).

    ``progress`` shows a progress bar of requests on stderr (tqdm, the ``replay`` extra). Returns the
    cache, in its final state, and the measurements.
    """
    if cache is None:
        # Nobody drains events here: recording them would only pile them up.
        cache = PrefixCache(
            config.num_pages,
            config.page_size,
            record_events=False,
            host_pages=config.host_pages,
            write_through=config.host_write_through and config.host_pages > 0,
        )
    total = sum(len(t.replies) for conv in conversations for t in conv.turns)
    if not progress:
        return cache, Replay(cache, conversations, config).run()
    from tqdm import tqdm

    with tqdm(desc="replaying", unit="req", total=total) as bar:
        return cache, Replay(cache, conversations, config, on_request_done=bar.update).run()
