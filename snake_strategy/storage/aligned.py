"""Page-aligned host buffers: O_DIRECT needs the buffer address, the file offset and the length to be
multiples of the logical block size; we use the 4 KiB page for all three."""
from __future__ import annotations

import torch

PAGE_BYTES = 4096


def round_up(num_bytes: int, multiple: int = PAGE_BYTES) -> int:
    return -(-num_bytes // multiple) * multiple


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements whose data starts on a page boundary.

    Its storage extends to a whole number of pages past the start, so an O_DIRECT read of the
    rounded-up length may land in it (see ``padded_bytes``). Costs one over-allocation of < 2 pages.
    """
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    payload_bytes = round_up(max(numel * elem_bytes, 1))
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
