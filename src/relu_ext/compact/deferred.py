"""The deferred result: every read of a device value by ``save_compact()``'s host code, in one place.

A decision of the pack hook that needs a value computed on the tensor's device (whether a recipe
matched bit for bit, whether a mask could be shared, a tensor's range) reads it through
:class:`Deferred`. On CUDA the value is copied to pinned host memory without waiting, and an event
is recorded after the copy: :meth:`Deferred.done` asks the event, without blocking, whether the
value has arrived; :meth:`Deferred.get` waits for it (this one event, not the whole device). On the
CPU the value is there at once, so the CPU runs the same code as the GPU.

No other code of the package reads a device tensor on the host (``item``, ``bool``, ``int``,
``tolist``, ``nonzero``, ``torch.equal``): tests/compact/test_deferred.py patches these and runs
training steps through every form to check it.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Protocol

import torch
from torch import Tensor


class Event(Protocol):
    """What :class:`Deferred` asks of an event: ``torch.cuda.Event``'s two methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaCopies:
    """How :class:`Deferred` sends a CUDA value to the host: a copy to pinned memory and an event after
    it, both on the current stream of the value's own device. (``torch.cuda.Event().record()``
    records on the current *device's* stream: with the value on ``cuda:1`` while ``cuda:0`` is
    current, the event could complete before the copy, and a stale flag be read.) Tests put a
    stand-in in ``Deferred.cuda`` that records the device and stream of each call."""

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream work on `device` runs on now (the forward's, in a pack hook)."""
        return torch.cuda.current_stream(device)

    def copy(self, value: Tensor, stream: torch.cuda.Stream) -> Tensor:
        """`value` copied to pinned host memory on `stream`, without waiting."""
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(value, non_blocking=True)
        return host

    def event(self, stream: torch.cuda.Stream) -> Event:
        """An event recorded on `stream` now: complete once what `stream` has queued is done."""
        event = torch.cuda.Event()
        event.record(stream)
        return event


class Deferred:
    """A value on a tensor's device that the host reads later.

    Args:
        value: the tensor to read (small: a flag, a count, a range). It must not change afterwards:
            the copy runs when the device gets to it, in stream order.
    """

    __slots__ = ("_host", "_event")

    # Tests set this to make every Deferred wait on events of their own, on the CPU too, which
    # they complete when they choose (tests/compact/test_pending.py). None: CUDA events.
    stand_in: ClassVar[Callable[[], Event] | None] = None
    cuda: ClassVar[CudaCopies] = CudaCopies()

    def __init__(self, value: Tensor) -> None:
        self._event: Event | None = None
        if value.device.type == "cuda":
            stream = Deferred.cuda.stream(value.device)
            self._host = Deferred.cuda.copy(value, stream)
            self._event = Deferred.cuda.event(stream)
        else:
            self._host = value.detach()
        if Deferred.stand_in is not None:
            self._event = Deferred.stand_in()

    @staticmethod
    def at_once(t: Tensor) -> bool:
        """Whether a value on `t`'s device reaches the host as soon as it is made (on the CPU, unless a
        test stands in events): then a form may be made in one step where it needs a value read back."""
        return t.is_cpu and Deferred.stand_in is None

    def done(self) -> bool:
        """Whether the value has reached the host (never blocks)."""
        if self._event is not None and self._event.query():
            self._event = None
        return self._event is None

    def get(self) -> Tensor:
        """The value on the host, waiting for its copy (and what the device had queued before it)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def flag(self) -> bool:
        """The value as a bool (one element), waiting as :meth:`get`."""
        return bool(self.get())

    def now(self) -> bool | None:
        """The value as a bool where it has reached the host, else None (never blocks)."""
        return self.flag() if self.done() else None

    def ints(self) -> list[int]:
        """The value's elements as Python ints, waiting as :meth:`get`."""
        return [int(v) for v in self.get().tolist()]
