"""Cascade attention with the Triton kernels of ``prefix_cache.kernels``.

``plan`` cuts every level into work items (``prefix_cache.kernels.work``), groups the items of all
levels by tile shape into one launch per shape (``triton_schedule``), and uploads everything (work
lists, page ids, row tables) into one int32 device buffer with a single copy. ``run`` then only
checks the layer's tensors and launches: one attention launch per tile shape (one or two), then one
merge launch. A query token with one partial state in all (one level's KV, unsplit) writes its output
straight to its engine-order row. Every (level, split) of any other token writes a partial (out,
lse) row into one float32 buffer, the token's rows contiguous; the merge combines them and writes
the token's output to its engine-order row. The attention kernel reads q through the same
permutation, so q is never copied. A plan without tokens to merge launches no merge. On Hopper the
merge after a plan's one attention launch is a programmatic dependent launch: its programs start
while that launch ends and wait for its partial rows in the kernel.

With a ``GraphCapacity`` the backend keeps fixed-size buffers and a fixed set of launches (a narrow,
a middle and a wide tile, and for decode shapes the lone level's tile, each over a fixed persistent
grid, then the merge over one program per token of the capacity): ``run`` can be captured in a CUDA
graph once and replayed after any later ``plan`` that fits the capacity and has the same
``graph_key``, because ``plan`` only rewrites the contents of the same device buffers. A plan runs
the narrow launch and at most one other (or the lone level's launch alone, below): with no work off
the narrow tile (decode batches whose shared levels are small) it has the key ``"triton-narrow"``;
with levels that fit the middle tile and none that needs the wide one, ``"triton-mid"``; otherwise
``"triton"`` (its levels off the narrow tile all on the wide one). A plan of one level of decodes
that fills about one wave runs the lone level's launch alone instead (``"triton-decode"``, see
``lone_decode_tile``). In a captured graph the two attention launches are parallel branches
(``launch_levels``).

On Hopper the auto backend also gives the backend a ``SharedLevelsOnFlashInfer``
(``flashinfer_levels``): a long shared level with many query rows then runs on FlashInfer's FA3
before the launches, and the merge folds its states in (``graph_key`` ``"triton+fa3"`` under a
capacity). A plan the backend refuses writes none of the buffers a captured graph reads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend, check_pool, reused_buffer
from prefix_cache.attention.capacity import GraphCapacity
from prefix_cache.attention.kv_layout import flashinfer_paged
from prefix_cache.attention.plan_image import Sections, Upload, fill_image, output_states
from prefix_cache.attention.triton_schedule import schedule
from prefix_cache.kernels._common import LOG2E, dependent_launches, interpreting, num_sms
from prefix_cache.kernels.attention import AttentionLaunch
from prefix_cache.kernels.merge_state import MergeLaunch
from prefix_cache.kernels.work import (
    MAX_SPLITS,
    WORK_COLS,
    LevelArrays,
    TileConfig,
    check_levels,
    fixed_tile_configs,
)
from prefix_cache.planner.kv_split import DECODE_TILE_ROWS
from prefix_cache.planner.plan import CascadePlan


def persistent_waves(tile: TileConfig) -> int:
    """Waves of the device's resident programs a fixed-capacity launch of ``tile`` runs (and an exact
    plan's padded d256 decode launch, ``_bind``); they loop over whatever (item, KV head) pairs the
    current plan wrote. Wide tiles (one program per SM) run more waves: long causal items balance
    better over them, which shortens prefill; narrow ones keep fewer, since every extra wave of idle
    decode programs adds to a small decode's time (benchmarks/NOTES.md, "more waves for the
    fixed-capacity wide tile")."""
    return 4 if tile.resident_per_sm() >= 4 else 8


@dataclass(frozen=True)
class _Launch:
    """One attention launch: a tile shape, its work list (a view of the int buffer) and its grid."""

    tile: TileConfig
    work: torch.Tensor
    num_work: torch.Tensor
    num_programs: int


def _is_permutation(order: np.ndarray) -> bool:
    """Whether int64 ``order`` [n] holds each of 0..n-1 once: in range (a negative entry reads as
    2**63 or more unsigned) and every position hit (fewer numpy calls than a sort and a compare)."""
    n = order.shape[0]
    if n == 0:
        return True
    if int(order.view(np.uint64).max()) >= n:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[order] = True
    return bool(seen.all())


def checked_levels(plan: CascadePlan) -> list[LevelArrays]:
    """The plan's levels as checked index arrays (``check_levels``), in order."""
    indices = [(lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len) for lv in plan.levels]
    return check_levels(indices, plan.page_size)


class TritonBackend(AttentionBackend):
    """Cascade attention on the GPU (or in Triton's interpreter for CPU tensors).

    device: where plans are uploaded and ``run`` expects its tensors; default CUDA when available.
    kv_chunk_size: force a split-KV chunk length in tokens for every level (tests); None lets each
        level choose from its KV lengths and the SM count.
    capacity: fixed sizes for CUDA-graph replay across plans (see ``GraphCapacity``); None sizes
        every plan exactly.
    """

    name = "triton"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        kv_chunk_size: int | None = None,
        capacity: GraphCapacity | None = None,
    ):
        super().__init__()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report their index ("cuda:0"); compare against the same spelling.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kv_chunk_size = kv_chunk_size
        self.capacity = capacity
        self._max_query_rows = None if capacity is None else capacity.max_query_tokens
        # Merge programs: an exact plan's tokens with 0 or several partial states; a fixed-capacity
        # backend's max_query_tokens (those past the plan's merged tokens write nothing).
        self._merges = 0
        self._max_page = -1
        self._launches: list[_Launch] = []
        self._ints: torch.Tensor | None = None  # the plan's int32 device buffer
        self._upload = Upload(self.device)
        self._sections: Sections | None = None
        self._q_rows = self._o_rows = self._kv_indices = None
        self._merge_rows = self._starts = self._counts = None
        self._part_o: torch.Tensor | None = None
        self._part_lse: torch.Tensor | None = None
        self._fixed_shape: tuple | None = None  # (heads, head_dim, page_size, sm_scale) of the buffers
        # The launches bound to one dtype (made by plan when it is given the dtype, else by run).
        self._bound_dtype: torch.dtype | None = None
        self._attention_launches: list[AttentionLaunch] = []
        self._merge_launch: MergeLaunch | None = None
        self._merge_narrow: MergeLaunch | None = None  # under a capacity, after the narrow launch alone
        self._launch_key: tuple | None = None  # what the launches above were made for
        self._qk_scale = 0.0
        self._runnable = True  # False for CPU tensors outside Triton's interpreter
        self._stores: dict[str, torch.Tensor] = {}  # device buffers of exact plans (see _reuse)
        # A shared level run outside the Triton launches (the auto backend sets a
        # ``SharedLevelsOnFlashInfer`` on Hopper); _external: the current plan has one.
        self._shared_levels = None
        self._external = False
        self._ext_rows = None
        # Under a capacity: the indices in _launches of the launches the current plan runs (the narrow
        # one, and the middle or the wide one where it has work there; or the lone level's alone).
        self._fixed_run: tuple[int, ...] = (0,)
        self._wide_launch = 0  # the index in _launches of the widest fixed tile's launch
        self._lone_launch: int | None = None  # and of the lone decode level's (``lone_decode_tile``)
        # Captured in a CUDA graph, the second attention launch runs on this stream (see launch_levels).
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ------------------------------------------------------------------------------------------
    # plan

    @property
    def graph_key(self) -> str | None:
        """Under a capacity, the plan's fixed sequence of launches (one graph each): ``"triton+fa3"``
        when one of its shared levels runs on FlashInfer's FA3 (``_shared_levels``, set by the auto
        backend), with the narrow and the wide launch; else ``"triton-decode"`` for a lone level of
        decodes on its own tile (``lone_decode_tile``), ``"triton-narrow"`` when every level runs
        on the narrow tile, ``"triton-mid"`` when the others run on the middle tile, ``"triton"`` on
        the wide one. A graph of two launches also replays a plan of the narrow one, whose empty
        launch still costs part of a small replayed step (benchmarks/NOTES.md, "the two attention
        launches as parallel branches of a CUDA graph" and "a graph key without the wide launch")."""
        if self.capacity is None:
            return None
        if self._external:
            return "triton+fa3"
        if len(self._fixed_run) == 1:
            return "triton-decode" if self._fixed_run[0] == self._lone_launch else "triton-narrow"
        return "triton" if self._fixed_run[-1] == self._wide_launch else "triton-mid"

    def _prepare(self, plan: CascadePlan) -> None:
        if not plan.levels:
            raise ValueError("a cascade plan needs at least one level")
        nq = plan.num_query_tokens
        levels = checked_levels(plan)
        for i, level in enumerate(levels):
            if level.num_query_tokens != nq:
                raise ValueError(f"level {i} covers {level.num_query_tokens} query tokens, the plan has {nq}")
        order = np.asarray(plan.query_order, dtype=np.int64)
        if order.shape != (nq,) or not _is_permutation(order):
            raise ValueError("plan.query_order must be a permutation of the query tokens")
        if self.capacity is None:
            self._prepare_exact(plan, levels, order)
        else:
            self._prepare_fixed(plan, levels, order)
        self._max_page = max((level.max_page for level in levels), default=-1)
        self._bound_dtype = None
        self._runnable = self.device.type != "cpu" or interpreting()
        if self.dtype is not None:
            self._bind_launches(self.dtype, plan.page_size)

    def _schedule(self, plan, levels, causal, tiles, kv_chunk_size, max_splits=MAX_SPLITS, widest=False):
        """``triton_schedule.schedule`` of ``levels`` for this backend's heads and device."""
        return schedule(
            levels, causal, tiles, plan_levels=len(plan.levels), group=self.num_qo_heads // self.num_kv_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=plan.page_size,
            sms=num_sms(self.device), kv_chunk_size=kv_chunk_size, max_splits=max_splits, widest=widest,
            row_stride=plan.num_query_tokens if self.capacity is None else self._tokens_cap,
        )  # fmt: skip

    def _plan_external(self, plan: CascadePlan, levels, order: np.ndarray):
        """(levels, causal, ext): the plan's checked levels and their causal flags without the one
        ``_shared_levels`` runs, and its ``ext`` table (see ``fill_image``); or all levels and None. On
        the host only: ``_commit_external`` hands the level to FlashInfer once the plan is accepted."""
        causal = [level.causal for level in plan.levels]
        external, ext = self._shared_levels, None
        heads = (self.num_qo_heads, self.num_kv_heads)
        # The KV's dtype: FA3 takes no fp8 cache beside a q of 16 bits.
        taken = (
            None if external is None else external.take(levels, causal, heads, self.head_dim, self.kv_dtype)
        )
        if taken is not None:
            ext = external.plan(
                levels[taken], plan.levels[taken].kv_last_page_len, order, plan.page_size,
                (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.sm_scale), self.dtype,
            )  # fmt: skip
        if ext is None:
            return levels, causal, None
        return levels[:taken] + levels[taken + 1 :], causal[:taken] + causal[taken + 1 :], ext

    def _commit_external(self, ext: np.ndarray | None) -> None:
        """After the plan's last check: its FlashInfer level planned and uploaded (or none)."""
        self._external = False
        if ext is not None:
            self._shared_levels.commit()
            self._external = True

    def _prepare_exact(self, plan: CascadePlan, levels, order: np.ndarray) -> None:
        nq = plan.num_query_tokens
        levels, causal, ext = self._plan_external(plan, levels, order)
        tiles, works, splits = self._schedule(plan, levels, causal, None, self.kv_chunk_size)
        self._commit_external(ext)
        pages = sum(level.kv_indices.shape[0] for level in levels)
        sec = Sections([w.shape[0] for w in works], pages, len(levels), nq)
        host = self._upload.image(sec.size)
        merges, num_rows = fill_image(host, sec, works, levels, splits, order, nq, ext)
        self._ints = self._reuse("ints", sec.size, torch.int32)
        self._upload.copy(self._ints, sec.size)
        self._bind(sec, tiles, exact=True, merges=merges)
        # One row at least: the kernel takes the buffers' addresses even when it stores nothing.
        num_rows = max(num_rows, 1)
        heads, dim = self.num_qo_heads, self.head_dim
        self._part_o = self._reuse("o", num_rows * heads * dim).view(num_rows, heads, dim)
        self._part_lse = self._reuse("lse", num_rows * heads).view(num_rows, heads)

    def _reuse(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An exact plan's device buffer (``reused_buffer``)."""
        return reused_buffer(self._stores, name, numel, dtype, self.device)

    def _float_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    @property
    def _tokens_cap(self) -> int:
        assert self.capacity is not None
        return self.capacity.max_query_tokens

    def _prepare_fixed(self, plan: CascadePlan, levels, order: np.ndarray) -> None:
        cap = self.capacity
        assert cap is not None
        nq = plan.num_query_tokens
        group = self.num_qo_heads // self.num_kv_heads
        shape = (self.num_qo_heads, self.num_kv_heads, self.head_dim, plan.page_size, self.sm_scale)
        if self._fixed_shape is not None and shape != self._fixed_shape:
            raise ValueError(
                f"a fixed-capacity backend keeps its heads, head_dim, page_size and sm_scale "
                f"{self._fixed_shape}; got {shape}: make a new backend"
            )
        pages = sum(level.kv_indices.shape[0] for level in levels)
        for what, need, have in (
            ("query tokens", nq, cap.max_query_tokens),
            ("levels", len(levels), cap.max_levels),
            ("pages", pages, cap.max_pages),
        ):
            if need > have:
                raise ValueError(f"the plan has {need} {what}, over the backend's capacity of {have}")
        levels, causal, ext = self._plan_external(plan, levels, order)
        tiles = fixed_tile_configs(group, self.head_dim, plan.page_size)
        # Splits that do not fit the fixed buffers are cut down, not dropped: fewer, longer splits.
        for max_splits in (MAX_SPLITS, 16, 8, 4, 2, 1):
            # The FA3 level's graph keeps the narrow and the wide launch.
            used, works, splits = self._schedule(
                plan, levels, causal, tiles, self.kv_chunk_size, max_splits, widest=ext is not None
            )
            items = [w.shape[0] for w in works]
            rows_per_token = splits.sum(axis=0)
            rows = int(rows_per_token.sum() - np.count_nonzero(output_states(rows_per_token, ext)))
            if max(items) <= cap.work_items and rows <= cap.partial_rows:
                break
        else:
            raise ValueError(
                f"the plan needs {max(items)} work items and {rows} partial rows, over the backend's "
                f"capacity of {cap.work_items} and {cap.partial_rows}"
            )
        self._commit_external(ext)
        # Launches: the fixed tiles (the wide one last), then the lone level's, where the shape has one.
        self._wide_launch = len(tiles) - 1
        self._lone_launch = len(tiles) if len(used) > len(tiles) else None
        if ext is not None:
            self._fixed_run = (0, self._wide_launch) if self._wide_launch else (0,)
        elif self._lone_launch is not None and works[self._lone_launch].shape[0]:
            self._fixed_run = (self._lone_launch,)
        else:
            self._fixed_run = (0, *(i for i in range(1, len(tiles)) if works[i].shape[0]))
        sec = Sections([cap.work_items] * len(used), cap.max_pages, cap.max_levels, cap.max_query_tokens)
        if self._fixed_shape is None:
            self._ints = torch.zeros(sec.size, dtype=torch.int32, device=self.device)
            self._bind(sec, used, exact=False, merges=cap.max_query_tokens)
            self._part_o = self._float_buffer((cap.partial_rows, self.num_qo_heads, self.head_dim))
            self._part_lse = self._float_buffer((cap.partial_rows, self.num_qo_heads))
            self._fixed_shape = shape
        assert self._ints is not None
        host = self._upload.image(sec.size)
        # The row tables are cleared; the work lists past each launch's item count are never read.
        host[: sec.work[0]] = 0
        # Merge programs past the plan's merged tokens have no rows and write nothing.
        host[sec.merge_rows : sec.merge_rows + sec.tokens] = -1
        fill_image(host, sec, works, levels, splits, order, cap.max_query_tokens, ext, cap.max_query_tokens)
        # Stale page ids past this plan's are never read: the copy stops at the last one used (of the
        # levels left to the Triton launches).
        self._upload.copy(self._ints, sec.kv_indices + sum(level.kv_indices.shape[0] for level in levels))

    def _bind(self, sec: Sections, tiles: list[TileConfig], *, exact: bool, merges: int) -> None:
        """Views of the int buffer, and the launches with their grids (``merges`` merge programs)."""
        ints = self._ints
        assert ints is not None
        self._sections = sec
        self._merges = merges
        self._kv_indices = ints[sec.kv_indices : sec.kv_indices + sec.pages]
        self._o_rows = ints[sec.o_rows : sec.o_rows + sec.levels * sec.tokens]
        self._q_rows = ints[sec.q_rows : sec.q_rows + sec.tokens]
        self._merge_rows = ints[sec.merge_rows : sec.merge_rows + merges]
        self._starts = ints[sec.starts : sec.starts + merges]
        self._counts = ints[sec.counts : sec.counts + merges]
        self._ext_rows = ints[sec.ext : sec.ext + 3 * merges]
        sms = num_sms(self.device)
        # An exact plan's only launch, on a decode tile at head dims over 128 (2 programs per SM, not
        # the nominal 4 of ``resident_per_sm``), takes the fixed plans' grid, its extra programs
        # idle: d256 decodes and cascades ran faster so (as fast as their fixed-capacity plan),
        # while the same padding slowed plans of two launches and head dim 128, which keep their
        # exact grid (benchmarks/NOTES.md, "an exact d256 launch on the fixed grid"; the 4-warp
        # d256 decode tile was measured with it too). Prefill tiles were not measured.
        padded = (
            exact and self.head_dim > 128 and not interpreting() and sum(n > 0 for n in sec.work_items) == 1
        )
        self._launches = []
        for i, (tile, items) in enumerate(zip(tiles, sec.work_items, strict=True)):
            pairs = items * self.num_kv_heads
            # Exact plans: one program per (item, KV head), but the padded launch above. Fixed plans:
            # a persistent grid sized to the device, looping over whatever number of items the
            # current plan wrote.
            grid = sms * tile.resident_per_sm() * persistent_waves(tile)
            programs = pairs if exact else min(pairs, grid)
            if padded and pairs and tile.block_m <= DECODE_TILE_ROWS:
                programs = max(pairs, grid)
            if programs == 0:
                continue
            work = ints[sec.work[i] : sec.work[i] + items * WORK_COLS].view(items, WORK_COLS)
            self._launches.append(
                _Launch(tile, work, ints[sec.num_work + i : sec.num_work + i + 1], programs)
            )

    # ------------------------------------------------------------------------------------------
    # run

    def _bind_launches(self, dtype: torch.dtype, page_size: int) -> None:
        """Fix the grids and compile-time constants of the plan's launches for ``dtype``: a run then
        only reads strides and launches."""
        self._qk_scale = self.sm_scale * LOG2E
        self._bound_dtype = dtype
        group = self.num_qo_heads // self.num_kv_heads
        assert self._starts is not None
        # Launches are kept while the next plan's are the same (a fixed-capacity backend's always
        # are): making one is host work that a step with the same launches need not repeat.
        key = (
            tuple((launch.num_programs, launch.tile) for launch in self._launches),
            self._starts.shape[0], self._external, group, self.num_kv_heads, self.num_qo_heads, page_size,
            self.head_dim, dtype, interpreting(),
        )  # fmt: skip
        if key == self._launch_key:
            return
        # The merge after a single attention launch starts while that launch ends (programmatic
        # dependent launch): it shortened replayed steps of small decode batches and lengthened
        # d256's exact plan (benchmarks/NOTES.md, "the merge launched as a dependent of its
        # attention launch"). The dependency is on the
        # one kernel before the merge in the stream, so it is used only where that kernel is the
        # plan's one attention launch: under a capacity the narrow launch of a "triton-narrow" plan
        # and the lone level's of a "triton-decode" plan.
        pdl = self._merges > 0 and dependent_launches(self.device)
        one_launch = len(self._launches) == 1
        alone = (0, self._lone_launch)  # the launches that may run alone before the merge
        self._attention_launches = [
            AttentionLaunch(
                num_programs=launch.num_programs,
                group_size=group,
                tile=launch.tile,
                num_kv_heads=self.num_kv_heads,
                page_size=page_size,
                head_dim=self.head_dim,
                dtype=dtype,
                before_merge=pdl and (one_launch or self.capacity is not None) and i in alone,
            )
            for i, launch in enumerate(self._launches)
        ]
        self._merge_launch = self._merge_narrow = None
        if self._merges:
            merge = functools.partial(
                MergeLaunch, self._merges, self.num_qo_heads, self.head_dim, sms=num_sms(self.device),
                extra=self._external,
            )  # fmt: skip
            self._merge_launch = merge(after_attention=pdl and one_launch)
            if self.capacity is not None:
                self._merge_narrow = merge(after_attention=True) if pdl else self._merge_launch
        self._launch_key = key

    def _run(self, plan, q, kv_cache, k, v, out, scales=(1.0, 1.0)) -> None:
        check_pool(self.device, self._max_page, q, k)
        if plan.num_query_tokens == 0 and self.capacity is None:
            return
        if not self._runnable:
            raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        if q.dtype != self._bound_dtype:
            if self._external and q.dtype != self.dtype:
                raise ValueError(f"the plan's FlashInfer levels are planned for {self.dtype}, q is {q.dtype}")
            self._bind_launches(q.dtype, plan.page_size)
        if self._external:
            self._shared_levels.run(q, flashinfer_paged(kv_cache, k, v))
        self.launch_levels(q, k, v, out, scales)
        if self._merges:
            self.merge(out)

    def launch_levels(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """The attention launches of the plan (arguments checked by ``run``, launches bound to q's
        dtype; ``scales``: an fp8 cache's (k_scale, v_scale), folded into the softmax scale and the
        output).

        While a CUDA graph is captured, the second launch (the middle or the wide tile's) goes to a
        side stream, joined before the merge: the two write disjoint rows, and as parallel branches
        of the graph they overlap. That shortened every replayed decode batch of the attention
        benchmark, also where both launches have work, and left prefill as it was; a
        fixed-capacity launch with no work in the plan then costs little (benchmarks/NOTES.md, "the
        two attention launches as parallel branches of a CUDA graph"). Eager runs stay on one
        stream: there the switch between streams cost more host time than the overlap saved.
        """
        launches = list(zip(self._launches, self._attention_launches, strict=True))
        if self.capacity is not None:
            launches = [launches[i] for i in self._fixed_run]
        side = None
        if self._side_stream is not None and len(launches) > 1 and torch.cuda.is_current_stream_capturing():
            side = self._side_stream
        if side is not None:
            main = torch.cuda.current_stream(self.device)
            side.wait_stream(main)
        k_scale, v_scale = scales
        qk_scale = self._qk_scale * k_scale
        for i, (launch, bound) in enumerate(launches):
            args = (
                q, self._q_rows, k, v, self._kv_indices, launch.work, launch.num_work, self._o_rows,
                self._part_o, self._part_lse, out, qk_scale, v_scale,
            )  # fmt: skip
            if side is not None and i == len(launches) - 1:
                with torch.cuda.stream(side):
                    bound(*args)
                main.wait_stream(side)
            else:
                bound(*args)

    def merge(self, out: torch.Tensor) -> None:
        """Merge the partial states into ``out``'s engine-order rows."""
        assert self._merge_launch is not None
        narrow_only = self.capacity is not None and len(self._fixed_run) == 1
        launch = self._merge_narrow if narrow_only else self._merge_launch
        ext = None
        if self._external:
            ext = (self._shared_levels.o, self._shared_levels.lse, self._ext_rows)
        launch(self._part_o, self._part_lse, self._starts, self._counts, out, self._merge_rows, ext)
