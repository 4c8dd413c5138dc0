"""The copy stream: host<->device copies on their own stream, ordered against compute with events.

On CUDA every copy that crosses PCIe (a unit's weights into its device buffer, an activation checkpoint
into a pinned host buffer and back) is issued on a dedicated ``torch.cuda.Stream``, so it runs while the
compute stream's kernels run. Ordering is explicit and local, never a device-wide synchronize:

- the copy stream waits for an event *recorded on the compute stream* before it writes a buffer that
  compute last read, or reads a tensor that compute just produced (``after=``);
- the compute stream waits for the event of a copy before it uses the copied data (``wait_event``);
- the host waits for an event (``Event.wait``) only where host code touches the bytes (an SSD write of
  a staged buffer, reuse of a pinned buffer for an SSD read): these are the sync points, marked at the
  call sites.

On a CPU device there is nothing to overlap: copies run inline and every event is already complete,
so the engine runs the very same schedule code on CPU and the exactness tests cover it.

Memory safety across streams: a CUDA tensor used by a copy is ``record_stream``-ed on the copy stream,
so the caching allocator does not hand its memory to compute before the copy has finished.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Event:
    """The point a stream had reached when the event was recorded. CPU events are complete at birth."""

    def __init__(self, cuda_event: "torch.cuda.Event | None" = None) -> None:
        self._event = cuda_event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block the calling host thread until the event has completed (a sync point of one stream)."""
        if self._event is not None:
            self._event.synchronize()


DONE = Event()


class CopyBatch:
    """What ``CopyStream.issuing`` yields: after the ``with`` block, ``event`` covers every copy issued in it."""

    event: Event = DONE


class CopyStream:
    """The CPU implementation: copies run inline on the calling thread; every event is ``DONE``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        """Copy ``src`` into ``dst`` on the copy stream once ``after`` (a compute event) has completed.
        The returned event completes with the copy; neither tensor may be touched before it has."""
        dst.copy_(src)
        return DONE

    @contextlib.contextmanager
    def issuing(self, after: Event | None = None) -> Iterator[CopyBatch]:
        """Every copy issued inside the block runs on the copy stream, after ``after``."""
        yield CopyBatch()

    def record(self) -> Event:
        """An event on the compute stream: "compute has issued everything up to here"."""
        return DONE

    def wait_event(self, event: Event) -> None:
        """Make the compute stream wait for ``event`` (a copy's completion); the host does not block."""

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has completed (close, tests: not the hot path)."""


class CudaCopyStream(CopyStream):
    """Copies on one dedicated CUDA stream; events are ``torch.cuda.Event``s."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=device)
        # The compute stream is the one current on the thread that builds the engine (the training
        # loop's): events are recorded on it from any thread (the prefetch thread included).
        self.compute = torch.cuda.current_stream(device)

    def _compute_stream(self) -> "torch.cuda.Stream":
        return self.compute

    def _record_on(self, stream: "torch.cuda.Stream") -> Event:
        event = torch.cuda.Event()
        event.record(stream)
        return Event(event)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        with self.issuing(after) as batch:
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.stream)  # the allocator keeps it until the copy stream is past here
            dst.copy_(src, non_blocking=True)  # asynchronous only with a pinned host side
        return batch.event

    @contextlib.contextmanager
    def issuing(self, after: Event | None = None) -> Iterator[CopyBatch]:
        if after is not None and after._event is not None:
            self.stream.wait_event(after._event)  # device-side wait: the host goes on
        batch = CopyBatch()
        with torch.cuda.stream(self.stream):
            yield batch
        batch.event = self._record_on(self.stream)

    def record(self) -> Event:
        return self._record_on(self._compute_stream())

    def wait_event(self, event: Event) -> None:
        if event._event is not None:
            self._compute_stream().wait_event(event._event)  # device-side wait: the host goes on

    def synchronize(self) -> None:
        self.stream.synchronize()  # this stream only, never the whole device


def copy_stream(device: torch.device) -> CopyStream:
    """The copy stream for ``device``: a CUDA stream on a CUDA device, the inline one elsewhere."""
    return CudaCopyStream(device) if device.type == "cuda" else CopyStream(device)
