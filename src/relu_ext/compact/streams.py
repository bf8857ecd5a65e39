"""The CUDA streams ``save_compact()``'s forms are made, filled and read on, in one place.

A form is made in the pack hook, on the stream the forward runs on there (its *stream*). Work that
fills it later (a compaction once its count is back, an integer tensor narrowed after the exit) runs
on that stream too, whichever thread or stream resolves it (:meth:`Streams.on`). A read of the form on
another stream (a backward or a poll on a side stream) first makes that stream wait for the form's,
and tells the caching allocator that the form's tensors are in use there (:meth:`Streams.after`), so
that their memory is not given to other work on the form's stream while the reader still reads it.

Off CUDA a form has no stream and all of this does nothing. Tests put a stand-in in
``streams.STREAMS`` that names streams on the CPU and records what ran where
(tests/compact/test_pending.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable

import torch
from torch import Tensor


class Streams:
    """Where a form's work runs, and what orders its reads (see the module's documentation)."""

    def of(self, t: Tensor) -> Any:
        """The stream work on `t`'s device runs on now (the forward's, in a pack hook); None off CUDA."""
        return torch.cuda.current_stream(t.device) if t.is_cuda else None

    def on(self, stream: Any) -> ContextManager[Any]:
        """Run what follows on `stream` (on its device), where it is a stream."""
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def after(self, stream: Any, tensors: Iterable[Tensor]) -> None:
        """Before reading `tensors` (made and filled on `stream`) on the current stream of `stream`'s
        device: order that stream after what `stream` has queued, and keep their memory from other
        work on `stream` until the reader is done with it. Nothing where the two are the same."""
        if stream is None:
            return
        here = torch.cuda.current_stream(stream.device)
        if here == stream:
            return
        here.wait_stream(stream)
        for t in tensors:
            t.record_stream(here)


STREAMS = Streams()
