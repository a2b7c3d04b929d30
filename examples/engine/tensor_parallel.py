"""Tensor parallelism: one scheduler, one ``PrefixCache`` and one plan per step, attention over each
rank's heads.

Rank 0 is the engine's own process: it schedules, plans each step once and sends the step's arrays
(token ids, positions, KV slots, sampled rows, the plan's levels and permutations) to the other
ranks with ``torch.distributed.broadcast``; every rank then plans its attention backend from the
same arrays and runs the forward of its shard of the model (``shard_model``: Megatron-style, query
heads and MLP columns split, one all-reduce after the attention's output projection and one after
the MLP's down projection). Each rank's KV pool holds its own KV heads of every page: page ids and
plans are the same on every rank, only the pools differ. The other ranks are processes started by
``torch.multiprocessing`` (spawn); the process group is gloo on the CPU and NCCL on CUDA, the only
difference between the two.
"""

from __future__ import annotations

import datetime
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prefix_cache import CascadePlan
from prefix_cache.planner.plan import CascadeLevel

from .config import ModelConfig
from .engine import EngineConfig, LLMEngine, engine_planner
from .model import LlamaModel
from .runner import ModelRunner

#: How long a collective may wait: the other ranks wait in a broadcast while the server is idle.
TIMEOUT = datetime.timedelta(days=7)
#: Ints before the arrays of a packed step, and per level.
_HEAD, _LEVEL_HEAD = 5, 5


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raises ValueError (one line) unless ``config`` splits over ``size`` ranks: size >= 1 dividing
    the query heads and the MLP's width, and the KV heads divisible by size or size by them (each
    rank then holds one KV head, replicated over size / num_kv_heads ranks)."""
    hq, hkv = config.num_qo_heads, config.num_kv_heads
    if size < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {size}")
    if hq % size:
        raise ValueError(f"the tensor-parallel size must divide {config.name}'s {hq} query heads, got {size}")
    if config.intermediate_size % size:
        raise ValueError(
            f"the tensor-parallel size must divide {config.name}'s MLP width {config.intermediate_size}, "
            f"got {size}"
        )
    if hkv % size and size % hkv:
        raise ValueError(
            f"the tensor-parallel size must divide {config.name}'s {hkv} KV heads or be a multiple of "
            f"them, got {size}"
        )


def rank_heads(config: ModelConfig, size: int, rank: int) -> tuple[range, range]:
    """The query heads and the KV heads of ``rank`` out of ``size``: contiguous query heads, and the
    KV heads they attend to (one KV head shared by size / num_kv_heads ranks when size exceeds them)."""
    check_tensor_parallel_size(config, size)
    hq, hkv = config.num_qo_heads, config.num_kv_heads
    q = hq // size
    if size <= hkv:
        kv = hkv // size
        return range(rank * q, (rank + 1) * q), range(rank * kv, (rank + 1) * kv)
    kv_head = rank // (size // hkv)
    return range(rank * q, (rank + 1) * q), range(kv_head, kv_head + 1)


def shard_model(model: LlamaModel, size: int, rank: int, group: dist.ProcessGroup | None) -> LlamaModel:
    """``rank``'s shard of ``model``: its query and KV heads' rows of the QKV projection, their
    columns of the output projection, its slice of the MLP's gate/up rows and down columns (copies);
    the embedding, norms and LM head are shared with ``model`` (every rank holds all of them).
    ``group``: the process group of the all-reduces (None: no all-reduce, for tests of one shard)."""
    c = model.config
    hq, hkv, hd, width = c.num_qo_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    q_heads, kv_heads = rank_heads(c, size, rank)
    q_rows = slice(q_heads.start * hd, q_heads.stop * hd)
    k_rows = slice((hq + kv_heads.start) * hd, (hq + kv_heads.stop) * hd)
    v_rows = slice((hq + hkv + kv_heads.start) * hd, (hq + hkv + kv_heads.stop) * hd)
    part = width // size
    mlp = slice(rank * part, (rank + 1) * part)
    layers = []
    for layer in model.layers:
        wqkv, gate_up = layer["wqkv"], layer["w_gate_up"]
        layers.append(
            {
                "attn_norm": layer["attn_norm"],
                "wqkv": torch.cat([wqkv[q_rows], wqkv[k_rows], wqkv[v_rows]]),
                "wo": layer["wo"][:, q_rows].contiguous(),
                "ffn_norm": layer["ffn_norm"],
                "w_gate_up": torch.cat([gate_up[:width][mlp], gate_up[width:][mlp]]),
                "w_down": layer["w_down"][:, mlp].contiguous(),
            }
        )
    shard = LlamaModel(
        c, layers, model.embed, model.final_norm, model.lm_head, (len(q_heads), len(kv_heads)), group
    )
    shard.kv_scales = list(model.kv_scales)
    return shard


# ---------------------------------------------------------------------- a step as one int64 array


def pack_step(
    plan: CascadePlan, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """The step as one int64 array: counts first, then every array (``unpack_step`` inverts it)."""
    head = [len(tokens), len(rows), len(plan.request_order), len(plan.levels), plan.page_size]
    parts = [tokens, positions, slots, rows, plan.request_order, plan.request_inverse, plan.query_order]
    for level in plan.levels:
        arrays = (level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len)
        head += [int(level.causal), *(len(a) for a in arrays)]
        parts += arrays
    return np.concatenate([np.array(head, dtype=np.int64), *(a.astype(np.int64) for a in parts)])


def unpack_step(data: np.ndarray) -> tuple[CascadePlan, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(plan, tokens, positions, slots, rows) of a ``pack_step`` array, with the planner's dtypes."""
    num_tokens, num_rows, batch, num_levels, page_size = (int(n) for n in data[:_HEAD])
    heads = data[_HEAD : _HEAD + _LEVEL_HEAD * num_levels].reshape(num_levels, _LEVEL_HEAD)
    at = _HEAD + _LEVEL_HEAD * num_levels

    def take(n: int, dtype: type) -> np.ndarray:
        nonlocal at
        at += n
        return data[at - n : at].astype(dtype)

    tokens, positions, slots = (take(num_tokens, np.int64) for _ in range(3))
    rows = take(num_rows, np.int64)
    order, inverse = take(batch, np.int32), take(batch, np.int32)
    query_order = take(num_tokens, np.int64)
    levels = tuple(
        CascadeLevel(*(take(int(n), np.int32) for n in head[1:]), causal=bool(head[0])) for head in heads
    )
    return CascadePlan(levels, order, inverse, query_order, page_size), tokens, positions, slots, rows


class StepChannel:
    """Rank 0 broadcasts each packed step to the others: its length, then the array (on ``device``:
    NCCL moves CUDA tensors only); a length of 0 tells them to stop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._length = torch.zeros(1, dtype=torch.int64, device=device)

    def send(self, data: np.ndarray | None) -> None:
        self._length.fill_(0 if data is None else len(data))
        dist.broadcast(self._length, src=0)
        if data is not None:
            dist.broadcast(torch.from_numpy(data).to(self.device), src=0)

    def receive(self) -> np.ndarray | None:
        dist.broadcast(self._length, src=0)
        length = int(self._length.item())
        if length == 0:
            return None
        data = torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(data, src=0)
        return data.cpu().numpy()


# ---------------------------------------------------------------------- processes


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the other ranks, then runs its own shard of it."""

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        max_levels: int,
        channel: StepChannel,
        processes: list[mp.Process],
    ) -> None:
        super().__init__(model, config, max_levels)
        self.channel, self.processes = channel, processes

    def execute(
        self,
        plan: CascadePlan,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
    ) -> tuple[torch.Tensor, bool]:
        # A rank that has exited between steps fails the step here: a broadcast to it can wait
        # forever (gloo does not always notice a closed peer) rather than raise. This narrows the
        # window, it does not close it: a rank that dies during a step's collectives still leaves
        # the others waiting, up to the process group's timeout.
        for rank, process in enumerate(self.processes, 1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} has exited (code {process.exitcode})")
        self.channel.send(pack_step(plan, tokens, positions, slots, rows))
        return super().execute(plan, tokens, positions, slots, rows)

    def close(self) -> None:
        """Tells the other ranks to stop (unless one has died: the broadcast would fail), waits for
        them and leaves the process group; idempotent."""
        if not self.processes:
            return
        try:
            if all(process.is_alive() for process in self.processes):
                self.channel.send(None)
        finally:
            for process in self.processes:
                process.join()
            self.processes = []
            dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the CUDA device ``rank`` after rank 0's."""
    return device if device.type == "cpu" else torch.device("cuda", (device.index or 0) + rank)


def model_loader(
    name: str, num_layers: int | None = None, dtype: torch.dtype | None = None
) -> Callable[[str], LlamaModel]:
    """A picklable ``device -> model`` for the other ranks: ``loading.load_weights_of``."""
    from .loading import load_weights_of

    return functools.partial(load_weights_of, name, dtype=dtype, num_layers=num_layers)


def _join(rank: int, size: int, store: dist.Store, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)


def _wait_for(store: dist.Store, key: str, processes: list[mp.Process]) -> None:
    """Until every other rank has set ``key<rank>`` in ``store``; raises RuntimeError naming a rank
    that exited first (it failed to start or to load the model: its error is on stderr)."""
    while not store.check([f"{key}{rank}" for rank in range(1, len(processes) + 1)]):
        for rank, process in enumerate(processes, 1):
            if not process.is_alive() and not store.check([f"{key}{rank}"]):
                raise RuntimeError(f"tensor-parallel rank {rank} exited at start (code {process.exitcode})")
        time.sleep(0.05)


def _follow(
    rank: int,
    size: int,
    rendezvous: str,
    device: torch.device,
    load: Callable[[str], LlamaModel],
    config: EngineConfig,
    num_threads: int,
) -> None:
    """A rank other than 0: loads the model, keeps its shard, runs every step rank 0 sends."""
    torch.set_num_threads(num_threads)
    store = dist.FileStore(rendezvous, size)
    store.set(f"joined{rank}", "1")
    _join(rank, size, store, device)
    try:
        model = shard_model(load(str(device)), size, rank, dist.group.WORLD)
        runner = ModelRunner(model, config, engine_planner(config).max_levels)
        channel = StepChannel(device)
        store.set(f"ready{rank}", "1")
        while (data := channel.receive()) is not None:
            runner.execute(*unpack_step(data))
    finally:
        dist.destroy_process_group()


def tensor_parallel_engine(
    model: LlamaModel,
    config: EngineConfig,
    stop_token_ids: frozenset[int],
    size: int,
    load: Callable[[str], LlamaModel],
) -> LLMEngine:
    """An engine over ``size`` ranks: this process is rank 0 with ``model``'s shard, and ``size - 1``
    processes are started, each loading the model with ``load(device)`` (picklable: see
    ``model_loader``) and keeping its shard; returns once every rank is ready. ``size`` 1: a plain
    ``LLMEngine`` of ``model``. On the CPU the ranks share this process's torch threads: each takes
    ``get_num_threads() // size`` (at least 1), this process included. ``engine.close()`` stops the
    other ranks. Raises ValueError when the model does not split, RuntimeError (the other ranks
    stopped) when one of them fails to start."""
    check_tensor_parallel_size(model.config, size)
    if size == 1:
        return LLMEngine(model, config, stop_token_ids)
    if model.device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    rendezvous = str(Path(tempfile.mkdtemp(prefix="tensor-parallel-")) / "store")
    store = dist.FileStore(rendezvous, size)
    context = mp.get_context("spawn")
    processes = []
    for rank in range(1, size):
        device = rank_device(model.device, rank)
        args = (rank, size, rendezvous, device, load, config, torch.get_num_threads())
        processes.append(context.Process(target=_follow, args=args, daemon=True))
        processes[-1].start()
    try:
        _wait_for(store, "joined", processes)
        _join(0, size, store, model.device)
        shard = shard_model(model, size, 0, dist.group.WORLD)
        max_levels = engine_planner(config).max_levels
        runner = TensorParallelRunner(shard, config, max_levels, StepChannel(model.device), processes)
        _wait_for(store, "ready", processes)  # the first step is not kept waiting for a rank to load
    except BaseException:
        for process in processes:
            process.kill()
            process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return LLMEngine(shard, config, stop_token_ids, runner=runner)
