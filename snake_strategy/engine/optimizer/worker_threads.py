"""The engine's helper threads (the optimizer worker, the weight prefetcher) compute with one intra-op
thread each, without touching the process-wide setting.

Why: on a machine with few cores the main thread's matmuls use every core through OpenMP. A helper thread
that starts its own OpenMP team for an elementwise AdamW chunk or a large copy oversubscribes the cores,
and OpenMP's spinning idle threads make it worse. ``torch.set_num_threads(1)`` cannot be used from a
helper: it is process-wide (MKL's count, and the default each thread adopts at its first parallel op),
which made the main thread's thread count, and with it its matmul results, depend on a start-up race.
OpenMP's ``omp_set_num_threads`` is per thread: it sets the calling thread's
``nthreads-var``, which is what torch's OpenMP ``parallel_for`` consults in that thread.

Results do not change with this: the helpers' ops are elementwise (AdamW) or copies.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch is linked with (GNU's or Intel's), as already loaded in this process."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1"))}
    except OSError:  # not Linux: leave the helpers as they are
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp")):
            return ctypes.CDLL(path)  # the loaded copy: dlopen returns its handle
    return None


def single_threaded_ops() -> bool:
    """Make this thread's own torch ops run on one intra-op thread; other threads are unaffected.
    Returns whether it took effect (torch built with OpenMP and its runtime found)."""
    torch.get_num_threads()  # torch sets this thread's OpenMP count once, lazily: let it happen first
    runtime = _openmp()
    if runtime is None:
        return False
    runtime.omp_set_num_threads(1)
    ok = torch.get_num_threads() == 1
    if not ok:
        log.debug("omp_set_num_threads(1) did not reach torch's thread count in this thread")
    return ok
