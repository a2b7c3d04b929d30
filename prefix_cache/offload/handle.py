"""The handle of one batch of page copies: is it over, did it succeed, make a stream wait for it."""

from __future__ import annotations

import torch


class CopyHandle:
    """One ``save`` or ``load`` batch in flight.

    Two questions, kept apart: ``done()`` says the device no longer touches the batch's pages (the
    source and destination pages may be reused), ``ok`` says the destination pages hold the copied
    bytes (done, not failed, not cancelled). A failed or cancelled batch is still done only once its
    queued copies are over: its destination pages hold garbage and must be recomputed, never read.

    On CPU tensors the copies ran before the handle was returned: it is done at once.
    """

    __slots__ = ("_cancelled", "_device", "_done", "_event", "error", "num_pages")

    def __init__(
        self,
        num_pages: int,
        event: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        error: BaseException | None = None,
    ) -> None:
        """A handle for ``num_pages`` page copies that are over once ``event`` (recorded on
        ``device``'s copy stream) completes; no event: already over."""
        self.num_pages: int = num_pages
        #: The exception that stopped the batch (its copies were queued only in part), else None.
        self.error: BaseException | None = error
        self._event = event
        self._device = device
        self._done = event is None
        self._cancelled = False

    def done(self) -> bool:
        """True once the batch's copies are over (succeeded, failed or cancelled); never blocks. A
        CUDA error reported while asking marks the batch failed (and done: the context is lost)."""
        if not self._done:
            try:
                self._done = self._event.query()  # type: ignore[union-attr]
            except RuntimeError as error:
                self.error = self.error or error
                self._done = True
        return self._done

    def wait(self) -> None:
        """Blocks the calling thread until ``done()``."""
        if not self._done:
            try:
                self._event.synchronize()  # type: ignore[union-attr]
            except RuntimeError as error:
                self.error = self.error or error
            self._done = True

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` (default: the current stream of the batch's device) wait for the batch's
        copies without blocking the host: work queued on it afterwards (the forward that reads loaded
        pages, a kernel that overwrites a saved page) runs after them. No-op once done or on CPU."""
        if self._done or self._event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._event)

    def cancel(self) -> None:
        """The caller gives up on the result: ``ok`` stays False. Copies already queued still run;
        ``done()`` still says when they are over."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called."""
        return self._cancelled

    @property
    def ok(self) -> bool:
        """The destination pages hold the copied bytes: done, no error, not cancelled."""
        return self.done() and self.error is None and not self._cancelled

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        if self._cancelled or self.error is not None:
            state = "cancelled" if self._cancelled else "failed"
        return f"CopyHandle({self.num_pages} pages, {state})"
