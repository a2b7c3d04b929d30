"""A sequence's view of the cache: its tokens, its pages and the cached path it holds."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.hashing import Namespace
from prefix_cache.cache.tree_nodes import Node, Root

if TYPE_CHECKING:
    from prefix_cache.cache.prefix_cache import PrefixCache


class Sequence:
    """One request's pages, created by ``PrefixCache.open`` and released by ``PrefixCache.close``.

    Its pages are, in order: the pages of its cached path (the runs of the tree nodes it holds a
    reference on),
    then pages private to it (being filled, reserved, or full but not cacheable after a hash
    collision). A page of the cached path may be the sequence's own copy of a block that another
    sequence cached first (a duplicate): it stays private until ``close``, so a block table never
    changes under the engine. All attributes and the arrays it hands out are read-only; only the
    cache that opened it changes it. A sequence cannot be copied: a copy would release its pages
    twice.
    """

    __slots__ = (
        "_broken",
        "_cache",
        "_capacity",
        "_dirty",
        "_dups",
        "_extras",
        "_id",
        "_load_host",
        "_load_ticket",
        "_loading",
        "_namespace",
        "_node",
        "_num_allocated",
        "_num_cached_tokens",
        "_num_full_pages",
        "_num_held",
        "_num_pages",
        "_num_tokens",
        "_owner",
        "_pages",
        "_pages_int",
        "_pages_view",
        "_rollbacks",
        "_root",
        "_tokens",
        "_tokens_int",
        "_tokens_view",
    )

    def __init__(
        self,
        cache: PrefixCache,
        seq_id: int,
        namespace: Namespace,
        root: Root | None,
        capacity_pages: int,
        page_size: int,
    ) -> None:
        """capacity_pages: pages to reserve buffer room for (>= 1); page_size: the cache's."""
        self._cache = cache
        # The cache while the sequence is open, None once closed: one identity test guards the hot path.
        self._owner: PrefixCache | None = cache
        self._id = seq_id
        self._namespace = namespace
        self._root = root
        # Committed tokens; capacity is always a whole number of pages, at least the allocated ones.
        self._tokens = np.empty(capacity_pages * page_size, dtype=np.int32)
        self._pages = np.empty(capacity_pages, dtype=np.int32)
        # The same buffers as C ints, the format of the tree's ``array('i')`` runs: a run copies
        # into them in one memcpy, without numpy's conversion of the source (0.5 µs per run),
        # and one token or page id is read or written in half the time of a numpy index.
        self._tokens_int = int_view(self._tokens)
        self._pages_int = int_view(self._pages)
        # Read-only views of the buffers that ``tokens`` and ``block_table`` slice, made on first use.
        self._tokens_view: np.ndarray | None = None
        self._pages_view: np.ndarray | None = None
        self._num_pages = 0
        self._num_tokens = 0
        self._num_allocated = 0
        # Tokens the allocated pages can hold: ``_num_pages * page_size``.
        self._capacity = 0
        self._num_cached_tokens = 0
        # The deepest tree node it holds, its namespace's root while it holds none (None until
        # ``open`` and after ``close``): it holds that node and every node above it, whole, and
        # those runs are its first ``_num_held`` pages (where it has its own copy of a page, a
        # duplicate, the block table has the copy).
        self._node: Node | None = root
        self._num_held = 0
        # Private pages among the first ``_num_held``: this sequence's copies of blocks another
        # sequence cached first. Freed at close.
        self._dups: list[int] | tuple[()] = ()
        # Full pages already offered to the tree (cached, switched to a duplicate, or left private).
        self._num_full_pages = 0
        # Set after a hash collision: no later page can be cached under a page that is not.
        self._broken = False
        # Full pages committed wait in the cache's ``PageStore.pending`` (not yet offered).
        self._dirty = False
        # Extra identity bytes of prompt pages, by page index (None without extra keys).
        self._extras: dict[int, bytes] | None = None
        # Rollbacks that removed pages: block table entries written out before one are stale.
        self._rollbacks = 0
        # Tokens after the GPU prefix whose KV is loaded from the host tier (0: none), the
        # host pages those loads read (pinned), and the batch that makes them (0: not yet taken).
        # Until the loads are done none of the sequence's later pages is offered to the tree.
        self._loading = 0
        self._load_host: array | None = None
        self._load_ticket = 0

    def __copy__(self) -> Sequence:
        raise TypeError("a Sequence cannot be copied: its pages would be released twice")

    def __deepcopy__(self, memo: dict) -> Sequence:
        raise TypeError("a Sequence cannot be copied: its pages would be released twice")

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError("a Sequence cannot be pickled or copied: it is bound to its cache's pages")

    def _add_pages(self, pages: array, page_size: int) -> None:
        """Append page ids to the block table; the buffers must have room (``_grow`` first)."""
        end = self._num_pages + len(pages)
        self._pages_int[self._num_pages : end] = pages
        self._num_pages = end
        self._capacity = end * page_size

    def _grow(self, num_pages: int, page_size: int) -> None:
        """Reallocate the buffers for at least ``num_pages`` pages, at least doubling them. Called
        before any page is taken, so a MemoryError here leaves everything as it was."""
        size = max(num_pages, 2 * len(self._pages))
        grown_pages = np.empty(size, dtype=np.int32)
        grown_tokens = np.empty(size * page_size, dtype=np.int32)
        grown_pages[: self._num_pages] = self._pages[: self._num_pages]
        grown_tokens[: self._num_tokens] = self._tokens[: self._num_tokens]
        self._pages = grown_pages
        self._pages_int = int_view(grown_pages)
        self._tokens = grown_tokens
        self._tokens_int = int_view(grown_tokens)
        self._pages_view = None
        self._tokens_view = None

    @property
    def seq_id(self) -> int:
        """Unique among the sequences of its cache."""
        return self._id

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def closed(self) -> bool:
        return self._owner is None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV was already cached at ``open``, on the GPU or on the host tier
        (``num_loading_tokens``): whole pages, at most ``len(prompt) - 1``."""
        return self._num_cached_tokens

    @property
    def num_loading_tokens(self) -> int:
        """Of ``num_cached_tokens``, those found on the host tier whose KV is being loaded into
        the block table's pages: 0 once ``PrefixCache.transfers_done`` says the loads are made.
        No kernel may read those pages before (see ``Transfers``)."""
        return self._loading

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is written: the cached prefix plus everything committed since."""
        return self._num_tokens

    @property
    def num_allocated_tokens(self) -> int:
        """Tokens with a reserved slot (``>= num_tokens``)."""
        return self._num_allocated

    @property
    def block_table(self) -> np.ndarray:
        """int32 page ids ``[ceil(num_allocated_tokens / page_size)]``; token ``t`` lives in page
        ``block_table[t // page_size]`` at slot ``t % page_size``. A read-only view. Append-only:
        an entry, once there, never changes while the sequence is open (``allocate`` only appends
        and may move the buffer, so re-read the property for the new entries); empty once the
        sequence is closed."""
        view = self._pages_view
        if view is None:
            view = self._pages_view = _read_only(self._pages)
        return view[: self._num_pages]

    @property
    def tokens(self) -> np.ndarray:
        """The committed token ids, int32 ``[num_tokens]`` (a read-only view, like
        ``block_table``)."""
        view = self._tokens_view
        if view is None:
            view = self._tokens_view = _read_only(self._tokens)
        return view[: self._num_tokens]

    def __repr__(self) -> str:
        state = "closed" if self._owner is None else "open"
        return (
            f"Sequence(id={self._id}, {state}, namespace={self._namespace!r}, tokens={self._num_tokens}, "
            f"allocated={self._num_allocated}, pages={self._num_pages})"
        )


def _cast_int_view(buffer: np.ndarray) -> memoryview:
    """A writeable memoryview of the int32 array ``buffer`` in the format of ``array('i')``."""
    return memoryview(buffer).cast("B").cast("i")


#: A writeable memoryview of an int32 array in the format of ``array('i')``. numpy names int32
#: "i" where C int is 32 bits wide (and may name it "l" where long is too): there a plain
#: memoryview already is one, made without a Python call (decided once, at import).
int_view = memoryview if memoryview(np.empty(0, dtype=np.int32)).format == "i" else _cast_int_view


def _read_only(buffer: np.ndarray) -> np.ndarray:
    """A view of ``buffer`` that cannot be written through (nor can its slices)."""
    view = buffer.view()
    view.flags.writeable = False
    return view
