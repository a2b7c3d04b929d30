"""The engine: requests in, tokens out, one ``step`` at a time.

Per step: the scheduler picks samples and allocates their pages; one cascade plan for the batch,
``backend.plan`` once; the model's forward writes each new token's K/V into its page and runs
``backend.run`` per layer; the next tokens are sampled; the computed tokens are ``commit``-ted, so
newly full pages become matchable; finished samples are closed, their full pages staying cached for
the conversation's next turn.

The forward runs in a ``ModelRunner`` (``runner.py``): on CUDA with backend "auto" or "triton"
(those that take a ``GraphCapacity``), a step whose batch is all single-token chunks (decodes) is
replayed from a CUDA graph of its batch-size bucket (``cuda_graphs.py``); prefill and mixed steps, a
decode plan over its bucket's capacity, and everything on the CPU run eagerly. With tensor
parallelism (``tensor_parallel.py``) the runner is rank 0's, which sends each step to the others.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from prefix_cache import CascadePlanner, PrefixCache

from .model import LlamaModel
from .request import Request, Sample, SamplingParams, Status
from .runner import KV_CACHE_DTYPES, ModelRunner
from .sampling import sample_tokens, token_logprobs
from .scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """num_pages, page_size: the KV pool; kv_cache_dtype: its dtype, "auto" (the model's) or "fp8"
    (``torch.float8_e4m3fn`` with the model's per-layer ``kv_scales``: half the bytes of bf16 per
    page, so the same memory holds twice the pages); backend: "auto", "torch", "triton" or
    "flashinfer"; cascade: False plans a single level (plain paged attention); planner: the cascade
    cost model's thresholds.

    cuda_graphs: replay decode-only steps from CUDA graphs (CUDA, backend "auto" or "triton" only).
    graph_max_pages_per_seq: a graph bucket of B decodes takes plans listing up to B times this many
        page ids over all levels (more: that step runs eagerly); None: ``num_pages``, so every plan fits
        (device buffers of 4 bytes per page id, per bucket).
    host_pages: pages of the cache's host tier in (pinned, on a CUDA machine) host memory, 0 for none:
        evicted prefixes wait there and come back by copy (docs/offload.md). One process only (no
        tensor parallelism).
    host_write_through: copy prefixes to the host tier when they are cached rather than when
        evicted (``PrefixCache(write_through=True)``, docs/offload.md); needs ``host_pages``.
    """

    num_pages: int = 2048
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    backend: str = "torch"
    cascade: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    planner: CascadePlanner = field(default_factory=CascadePlanner)
    cuda_graphs: bool = True
    graph_max_pages_per_seq: int | None = None
    host_pages: int = 0
    host_write_through: bool = False

    def __post_init__(self) -> None:
        if type(self.host_pages) is not int or not 0 <= self.host_pages < 2**31:
            raise ValueError(f"host_pages must be an int in [0, 2**31), got {self.host_pages!r}")
        if self.host_write_through and not self.host_pages:
            raise ValueError("host_write_through needs a host tier (host_pages > 0)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.graph_max_pages_per_seq is not None and self.graph_max_pages_per_seq < 1:
            raise ValueError(
                f"graph_max_pages_per_seq must be >= 1 or None, got {self.graph_max_pages_per_seq}"
            )


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    steps: int = 0
    shared_levels: int = 0  # summed over steps
    prefill_tokens: int = 0  # query tokens of chunks that were not a single decode token
    decode_tokens: int = 0
    graph_steps: int = 0  # steps replayed from (or captured into) a CUDA graph
    peak_pages_in_use: int = 0  # pages holding KV of live sequences (not free, not merely cached)
    peak_running: int = 0


def engine_planner(config: EngineConfig) -> CascadePlanner:
    """The planner of an engine of ``config``: one level without cascade; with an fp8 pool, the
    cascade-or-one-level choice weighs KV reads at fp8's byte per element."""
    planner = config.planner
    if not config.cascade:
        planner = CascadePlanner(planner.min_shared_tokens, planner.min_saved_tokens, max_levels=1)
    if config.kv_cache_dtype == "fp8" and planner.cost_model is not None:
        planner = dataclasses.replace(planner, cost_model=planner.cost_model.for_kv_itemsize(1))
    return planner


class LLMEngine:
    """A Llama model served over a ``PrefixCache`` and a cascade attention backend."""

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        stop_token_ids: frozenset[int] = frozenset(),
        runner: ModelRunner | None = None,
    ) -> None:
        """runner: where the steps run (default: a ``ModelRunner`` of ``model`` in this process);
        tensor parallelism passes rank 0's, whose model is ``model``'s shard."""
        self.model, self.config = model, config
        self.stop_token_ids = stop_token_ids
        if config.host_pages and runner is not None:
            raise ValueError("a host tier (host_pages) needs the engine's own runner: no tensor parallelism")
        self.cache = PrefixCache(
            config.num_pages,
            config.page_size,
            record_events=False,
            host_pages=config.host_pages,
            write_through=config.host_write_through,
        )
        self.scheduler = Scheduler(self.cache, config.scheduler)
        self.planner = engine_planner(config)
        self.runner = runner or ModelRunner(model, config, self.planner.max_levels)
        self.kv_pool, self.backend, self.graphs = self.runner.kv_pool, self.runner.backend, self.runner.graphs
        self.mover = None
        # Batches of copies on the mover's stream, oldest first, with their handles.
        self._copies: deque = deque()
        if config.host_pages:
            from prefix_cache.offload import HostKVPool, KVMover

            _, _, page_size, heads, head_dim = self.kv_pool[0].shape
            host = HostKVPool(
                config.host_pages, len(self.kv_pool), page_size, heads, head_dim, self.kv_pool[0].dtype
            )
            self.mover = KVMover(self.kv_pool, host)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = count()

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: object, params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a prompt (1-D token ids). Raises ValueError, queueing nothing, for an empty prompt,
        ids outside the vocabulary, a duplicate id, or a request that cannot fit in the KV pool."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.model.config.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.model.config.vocab_size})")
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids.astype(np.int32), params)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Stop a request now, or only its sample ``index`` (finishing with ``reason``: "abort", or
        "stop" when the caller found a stop string); unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for s in request.samples:
            if not s.finished and index in (None, s.index):
                self.scheduler.finish(s, reason)
        if request.finished:
            del self.requests[request_id]

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ------------------------------------------------------------------ a step

    def step(self) -> list[Sample]:
        """Run one batch; returns the samples that got a new token (``s.output[-1]``), finished ones
        included (``s.finished``), and those that failed (``s.finish_reason == "error"``, no new
        token, ``s.request.error`` says why).

        A request whose sampling raises fails alone; an exception in the batch's forward fails the
        requests of that batch (they cannot be told apart). Either way the engine keeps serving."""
        batch = self.scheduler.schedule()
        if self.mover is not None:
            batch = self._transfer(batch)
        if not batch:
            return []
        try:
            return self._run(batch)
        except Exception as error:  # the batch's requests fail, the engine goes on
            return self._fail({s.request: error for s, _ in batch})

    def _transfer(self, batch: list[tuple[Sample, int]]) -> list[tuple[Sample, int]]:
        """The copies the cache asks for this step, on the mover's stream, in the background: the
        saves of prefixes evicted (write-back) or cached (write-through), the loads of prefixes
        found on the host. A forward waits on the device only for saves still reading a page it
        writes (``_wait_for_saves``). A sample whose loads are not done yet sits out until they
        are (other requests keep running); when they fail, it computes those tokens instead.
        Returns this step's batch without such samples."""
        failed = False
        transfers = self.cache.take_transfers()
        if transfers is not None:
            saved = loaded = None
            try:
                if len(transfers.saves):
                    saved = self.mover.save(transfers.saves[:, 0], transfers.saves[:, 1])
                if len(transfers.loads):
                    loaded = self.mover.load(transfers.loads[:, 0], transfers.loads[:, 1])
            except Exception:  # refused before any copy: the batch fails
                self.cache.transfers_done(transfers, ok=False)
                failed = True
            else:
                self._copies.append((transfers, saved, [h for h in (saved, loaded) if h is not None]))
        while self._copies and all(handle.done() for handle in self._copies[0][2]):
            transfers, _, handles = self._copies.popleft()
            # On CUDA an error of the copies themselves shows in the stream (sticky), not here.
            ok = all(handle.ok for handle in handles)
            self.cache.transfers_done(transfers, ok=ok)
            failed |= not ok
        for s in self.scheduler.running if failed else ():
            if s.num_computed > s.seq.num_tokens:  # its loads failed: compute from its GPU prefix
                s.num_computed = s.seq.num_tokens
        return [(s, n) for s, n in batch if not s.seq.num_loading_tokens]

    def _run(self, batch: list[tuple[Sample, int]]) -> list[Sample]:
        cache, ps = self.cache, self.config.page_size
        qo_lens = np.array([n for _, n in batch], dtype=np.int64)
        starts = np.array([s.num_computed for s, _ in batch], dtype=np.int64)
        tokens = np.concatenate([s.tokens[a : a + n] for (s, n), a in zip(batch, starts, strict=True)])
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, qo_lens, strict=True)])
        tables = [s.seq.block_table for s, _ in batch]
        slots = np.concatenate(
            [
                t[p // ps].astype(np.int64) * ps + p % ps
                for t, p in zip(tables, np.split(positions, np.cumsum(qo_lens)[:-1]), strict=True)
            ]
        )
        plan = self.planner.plan(tables, starts + qo_lens, qo_lens, ps)
        if self._copies:
            self._wait_for_saves(slots // ps)
        # A sample gets a next token when this chunk reaches the end of its known tokens.
        done = [i for i, (s, n) in enumerate(batch) if s.num_computed + n == s.num_tokens]
        rows = (np.cumsum(qo_lens) - 1)[done]
        logits, from_graph = self.runner.execute(plan, tokens, positions, slots, rows)
        self.stats.graph_steps += from_graph
        sampled = [batch[i][0] for i in done]
        next_tokens, failures = sample_tokens(logits, sampled)
        for s, entry in zip(sampled, token_logprobs(logits, sampled, next_tokens), strict=True):
            if entry is not None:
                s.logprobs.append(entry)
        now = time.perf_counter()

        for (s, n), a in zip(batch, starts, strict=True):
            cache.commit(s.seq, s.tokens[a : a + n])
            s.num_computed += n
        self._account(plan, qo_lens)
        failed = self._fail({sampled[row].request: error for row, error in failures.items()})
        for s, token in zip(sampled, next_tokens, strict=True):
            if not s.finished:
                self._append(s, token, now)
        return [s for s in sampled if s.finish_reason != "error"] + failed

    def _wait_for_saves(self, written: np.ndarray) -> None:
        """Order the saves still in flight that read a GPU page of ``written`` (the pages this
        step's forward writes KV into: pages freed since the save was queued, and handed out again)
        before the forward, on the device. Write-back frees the pages it saves at once, so a forward
        soon writes them; write-through saves pages that stay cached, so most steps wait for
        nothing."""
        for transfers, saved, _ in self._copies:
            if saved is not None and not saved.done() and np.isin(transfers.saves[:, 0], written).any():
                saved.wait_on()

    def _fail(self, failures: dict[Request, Exception]) -> list[Sample]:
        """End each request with reason "error", ``request.error`` naming its exception; returns the
        samples this ended."""
        failed = []
        for request, error in failures.items():
            request.error = f"{type(error).__name__}: {error}"
            for s in request.samples:
                if not s.finished:
                    self.scheduler.finish(s, "error")
                    failed.append(s)
            self.requests.pop(request.request_id, None)
        return failed

    def _append(self, s: Sample, token: int, now: float) -> None:
        request, params = s.request, s.request.params
        s.tokens[s.num_tokens] = token
        s.token_times[s.num_output] = now
        s.num_tokens += 1
        if s.index == 0:
            request.prompt_cached = True
        if (not params.ignore_eos and token in self.stop_token_ids) or token in params.stop_token_ids:
            self.scheduler.finish(s, "stop")
        elif s.num_output == params.max_tokens:
            self.scheduler.finish(s, "length")
        if request.finished:
            self.requests.pop(request.request_id, None)

    def _account(self, plan: object, qo_lens: np.ndarray) -> None:
        st = self.stats
        st.steps += 1
        st.shared_levels += len(plan.levels) - 1
        decodes = int(np.count_nonzero(qo_lens == 1))
        st.decode_tokens += decodes
        st.prefill_tokens += int(qo_lens.sum()) - decodes
        in_use = self.cache.num_pages - self.cache.num_free_pages - self.cache.num_evictable_pages
        st.peak_pages_in_use = max(st.peak_pages_in_use, in_use)
        st.peak_running = max(st.peak_running, len(self.scheduler.running))

    # ------------------------------------------------------------------ convenience

    def generate(self, prompts: list[object], params: SamplingParams) -> list[list[np.ndarray]]:
        """Run ``prompts`` to completion; per prompt, the output ids of each of its samples."""
        requests = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return [[s.output.copy() for s in r.samples] for r in requests]

    def close(self) -> None:
        """Stop the runner's other processes, if any (tensor parallelism); the engine is done."""
        self.runner.close()

    def check_invariants(self) -> None:
        """The cache's own invariants, and that exactly the running samples hold sequences."""
        self.cache.check_invariants()
        running = set(self.scheduler.running)
        assert self.cache.num_live_sequences == len(running)
        for s in running:
            assert s.status is Status.RUNNING and s.seq is not None and s.seq.num_tokens == s.num_computed
        for s in self.scheduler.waiting:
            assert s.status is Status.WAITING and s.seq is None
