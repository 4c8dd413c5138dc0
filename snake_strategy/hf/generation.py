"""Greedy generation for ``HFCausalLM`` with a per-unit KV cache kept in host memory.

The prompt runs once (prefill); after that every pass runs only the newest token, its layers attending
to the keys and values cached for the earlier positions. A pass runs every unit once, so under
greedysnake each generated token streams each unit's weights in exactly once (read-only, from whatever
tier holds them: ``strategy.eval_traffic`` counts them), and between passes a unit's cache lives in
host memory with the keys/values of its own layers (``HostKVCache``), never in the device's. Under a
plain strategy the blocks run from the module itself.

Semantics are those of transformers' ``generate(do_sample=False)``: prompts left-padded with their
``attention_mask`` (positions count real tokens only, the cumulative sum of the mask minus one; padding
is masked out of every attention), a sequence that emits an EOS token is finished and gets
``pad_token_id`` from then on, and generation stops when every sequence is finished or after
``max_new_tokens`` passes. ``tests/hf/test_generation.py`` checks the tokens against ``model.generate``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from snake_strategy.contract import check_block_output, reads_block_outputs
from snake_strategy.engine.view import running_engine


class HostKVCache(DynamicCache):
    """transformers' ``DynamicCache`` (sliding-window layers included) whose tensors stay in host memory.

    A layer's new keys/values are appended on the host; its whole cache goes to the compute device for
    the attention. On a CPU device nothing is copied; on a GPU that is one host-to-device copy of the
    layer's cache per token (and a sync for the device-to-host copy of the new entries): the price of
    keeping the cache off the device, which is the point when the weights are streamed."""

    def __init__(self, config: Any, device: torch.device) -> None:
        super().__init__(config=config)
        self.device = torch.device(device)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states.to("cpu"), value_states.to("cpu"), layer_idx, *args, **kwargs)
        return keys.to(self.device), values.to(self.device)


def _block_runner(module: Any) -> tuple[Callable[[Tensor, dict[str, Any]], Tensor], torch.dtype | None]:
    """How one pass runs the blocks: the greedysnake engine's ``stream_blocks`` (every unit fetched once,
    read-only) when one is set up, else the module's own blocks; and the autocast dtype to run under."""
    engine = running_engine(module)
    if engine is not None:
        return (lambda hidden, side: engine.stream_blocks([hidden], [side])[0]), engine.autocast_dtype

    def run(hidden: Tensor, side: dict[str, Any]) -> Tensor:
        with_output = reads_block_outputs(module)  # the router logits of an MoE's balancing loss: not needed here
        for i, block in enumerate(module.blocks):
            out = check_block_output(block(hidden, **side), i, with_output)
            hidden = out[0] if with_output else out
        return hidden

    return run, None


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


@torch.no_grad()
def greedy_generate(module: Any, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None,
                    eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> Tensor:
    """``input_ids`` (batch, prompt length; left padding) followed by up to ``max_new_tokens`` greedy
    tokens. ``eos_token_id``/``pad_token_id`` default to the module's config (``eos_token_id=[]``: no EOS
    stop; the pad defaults to the first EOS id, as transformers does)."""
    config = module.hf_config
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, prompt length), got shape {tuple(input_ids.shape)}")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the "
                         f"model's max_position_embeddings={limit}; generate fewer tokens")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate needs left-padded prompts (a prompt's last position is padding here): pad on "
                         "the left (tokenizer.padding_side='left') so every prompt ends at its last token")
    eos = _token_ids(config.eos_token_id if eos_token_id is None else eos_token_id)
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else None)
    device = input_ids.device
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    run_blocks, autocast_dtype = _block_runner(module)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    cache = HostKVCache(config, device)
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype, device=device)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=device)
    tokens, step_ids, step_positions = input_ids, input_ids, positions
    was_training = module.training
    module.eval()
    try:
        for _ in range(max_new_tokens):
            with autocast:
                hidden, side = module.embed_stage(step_ids, step_positions, mask, cache)
                hidden = run_blocks(hidden, side)
                logits = module.post_stage(hidden[:, -1:])[:, -1]  # the head for the last position only
            next_ids = logits.argmax(dim=-1).to(input_ids.dtype)
            if eos:
                next_ids = torch.where(unfinished, next_ids, torch.full_like(next_ids, pad))
                unfinished &= ~torch.isin(next_ids, eos_ids)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            step_ids, step_positions = next_ids[:, None], step_positions[:, -1:] + 1
            if eos and not bool(unfinished.any()):
                break
    finally:
        module.train(was_training)
    return tokens
