"""Page-aligned host buffers: O_DIRECT needs the buffer address, the file offset and the length to be
multiples of the logical block size; we use the 4 KiB page for all three."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

PAGE_BYTES = 4096
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@functools.cache
def return_large_frees_to_os(threshold_bytes: int = 2**20) -> bool:
    """Make glibc serve every allocation >= ``threshold_bytes`` with its own mmap (once per process).

    The engine allocates and frees unit-sized buffers all the time. glibc's default *dynamic* mmap
    threshold rises to the size of the last freed mmapped block, after which such buffers come from
    the heap and stay there after free: peak RSS then grows with the number of units (measured: +290 MB
    for 28 extra layers of d=256). A fixed threshold returns each buffer to the OS.
    Returns False where glibc is not the allocator (nothing to do).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False


def round_up(num_bytes: int, multiple: int = PAGE_BYTES) -> int:
    return -(-num_bytes // multiple) * multiple


def pinned_allocation_bytes(num_bytes: int) -> int:
    """The host memory a pinned allocation of ``num_bytes`` really takes.

    The rule implemented (torch's CUDA caching host allocator, ``ATen/core/CachingHostAllocator.h``,
    default settings): a request is rounded up to the next power of two (``PowerOf2Ceil``; 0 stays 0),
    so that freed blocks are reusable by size class. The block stays cached by the allocator after the
    tensor dies, so a pinned buffer costs its rounded size for the life of the process: a 65 MiB unit
    takes 128 MiB. (``PYTORCH_CUDA_ALLOC_CONF=pinned_max_round_threshold:...`` can lower the threshold
    above which requests are not rounded; the engine assumes the default, which rounds everything.)
    """
    if num_bytes <= 0:
        return 0
    return 1 << (num_bytes - 1).bit_length()


def aligned_allocation_bytes(numel: int, elem_bytes: int, pin_memory: bool = False) -> int:
    """The bytes ``aligned_empty(numel, ..., pin_memory)`` allocates: the page-rounded payload plus one
    page of alignment slack; pinned, the payload alone (already page-aligned) at its rounded size."""
    payload = round_up(max(numel * elem_bytes, 1))
    return pinned_allocation_bytes(payload) if pin_memory else payload + PAGE_BYTES


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements whose data starts on a page boundary.

    Its storage extends to a whole number of pages past the start, so an O_DIRECT read of the
    rounded-up length may land in it (see ``padded_bytes``). Costs one over-allocation of < 2 pages.
    """
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    payload_bytes = round_up(max(numel * elem_bytes, 1))
    if pin_memory:
        # Pinned blocks are page-aligned already (whole cudaHostAlloc allocations, or 4 KiB-rounded
        # slices of a reserved segment): no slack page, which would double a power-of-two payload.
        raw = torch.empty(payload_bytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % PAGE_BYTES == 0:
            return raw.view(dtype)[:numel]
    raw = torch.empty(payload_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin_memory)
    shift = (-raw.data_ptr()) % PAGE_BYTES
    page_view = raw[shift:shift + payload_bytes]
    return page_view.view(dtype)[:numel]


def padded_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The page-rounded uint8 view over ``tensor``'s bytes (tensor must come from ``aligned_empty``,
    or be a page-aligned slice of one whose storage reaches the rounded end)."""
    num_bytes = round_up(tensor.numel() * tensor.element_size())
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.data_ptr() % PAGE_BYTES or start + num_bytes > storage.nbytes():
        raise AssertionError("padded_bytes needs a page-aligned tensor with page-rounded storage")
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return whole[start:start + num_bytes]
