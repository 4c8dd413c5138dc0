"""HuggingFace model directories out of a trained ``HFCausalLM``: from the module (during or after fit, one
unit at a time under greedysnake) or from a checkpoint directory whose run is gone."""
from __future__ import annotations

import copy
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from snake_strategy.checkpoint.consolidate import CheckpointWeights
from snake_strategy.engine.view import running_engine
from snake_strategy.hf.model import HFCausalLM, resolve_config
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.sources.safetensors_io import ShardedSafetensorsWriter

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def export_hf_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, config: Any = None,
                         dtype: torch.dtype | None = None, progress: Progress | None = None,
                         base: Any = None) -> list[str]:
    """Write a HF model directory from a checkpoint directory of an ``HFCausalLM``, streamed unit by unit.

    ``config``: a HF model directory, a ``config.json`` path, a dict or a ``PretrainedConfig``; by default
    the one the module saved in its hyper-parameters. ``dtype``: of the files (default: the master dtype).
    ``base``: the frozen weights of a fine-tuning checkpoint (a HF directory, a state-dict file, ...).
    """
    weights = CheckpointWeights(path, progress, base=base)
    try:
        if config is None:
            config = weights.meta().get("hyper_parameters", {}).get("config")
            if not isinstance(config, dict) or "model_type" not in config:
                raise ValueError(f"{weights.root} holds no HF config in its hyper-parameters (not an HFCausalLM "
                                 "checkpoint?); pass the model's config: --config HF_DIR_OR_CONFIG_JSON")
        elif isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
            config = json.loads(Path(config).read_text())
        return export_hf(weights.named_tensors(), out_dir, config=config, dtype=dtype or weights.dtype,
                         progress=progress)
    finally:
        weights.close()


def module_weights(module: HFCausalLM) -> Iterator[tuple[str, Tensor]]:
    """The module's trained weights by HF name, one unit at a time under greedysnake (master copies)."""
    engine = running_engine(module)
    if engine is None:
        for name, p in module.named_parameters():
            yield name, p.detach()
        return
    yield from engine.named_weights()


def master_dtype(module: HFCausalLM) -> torch.dtype:
    """The dtype of the module's trained weights: the engine's master dtype while greedysnake holds them,
    else the widest floating dtype among the module's parameters (a bf16 frozen base with fp32 adapters
    is fp32)."""
    engine = running_engine(module)
    if engine is not None:
        return engine.master_dtype
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return max(floating, key=lambda dt: dt.itemsize) if floating else torch.float32


def _with_dtype(weights: Iterable[tuple[str, Tensor]]) -> tuple[Iterable[tuple[str, Tensor]], torch.dtype]:
    """(the same pairs, the dtype to write): the widest floating dtype of a sized collection, or the
    first floating tensor's dtype of a stream (read ahead up to it, then handed on in order)."""
    if hasattr(weights, "__len__"):
        floating = [t.dtype for _, t in weights if t.is_floating_point()]
        return weights, max(floating, key=lambda dt: dt.itemsize) if floating else torch.float32
    stream, ahead = iter(weights), []
    for pair in stream:
        ahead.append(pair)
        if pair[1].is_floating_point():
            return itertools.chain(ahead, stream), pair[1].dtype
    return ahead, torch.float32


def export_hf(source: HFCausalLM | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], out_dir: str | os.PathLike,
              config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              progress: Progress | None = None) -> list[str]:
    """Write ``config.json`` + (sharded) safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``source``: an ``HFCausalLM`` (inside or after ``Trainer.fit``; under greedysnake its units are read
    one at a time), a state dict (e.g. a consolidated checkpoint's ``state_dict``) or an iterable of
    ``(name, tensor)`` pairs; the latter two need ``config``. Names are HF names; tied output weights
    (``lm_head.weight`` of GPT-2) are written once, as HF does. Returns the weight files written.
    ``progress`` reports tensors written (phase "export"; silent by default).

    ``dtype``: of the floating-point tensors in the files. None (the default) keeps the master dtype, as
    the checkpoint CLI does, so ``from_pretrained(dir, dtype=<that dtype>)`` gives back identical tensors:
    the engine's master dtype during fit, else the widest floating dtype of the module's parameters, of
    the state dict's tensors, or of the first floating tensor an iterable yields. ``torch.bfloat16``,
    ``torch.float16`` or ``torch.float32`` round to a smaller file.
    """
    if isinstance(source, HFCausalLM):
        cfg = source.hf_config if config is None else resolve_config(config)[0]
        weights: Iterable[tuple[str, Tensor]] = module_weights(source)
        if dtype is None:
            dtype = master_dtype(source)
    else:
        if config is None:
            raise ValueError("export_hf(state, out_dir) needs config=<PretrainedConfig, dict or model directory> "
                             "when the source is not an HFCausalLM")
        cfg = resolve_config(config)[0]
        weights = source.items() if isinstance(source, Mapping) else source
        if dtype is None:
            weights, dtype = _with_dtype(weights)
    # The plan (names, shapes) comes from the model built on meta: headers can then be written first.
    planner = HFCausalLM(cfg)
    with torch.device("meta"):
        planner.configure_model()
    params = dict(planner.named_parameters())
    aliases = set(planner.state_dict()) - set(params)  # tied duplicates such as lm_head.weight
    plan = [(name, dtype if p.is_floating_point() else p.dtype, p.shape) for name, p in params.items()]
    writer = ShardedSafetensorsWriter(out_dir, plan, max_shard_bytes)
    file_bytes = {name: shape.numel() * dt.itemsize for name, dt, shape in plan}
    tracker = or_quiet(progress).phase("export", len(plan), what="tensors", total_bytes=sum(file_bytes.values()))
    try:
        for name, tensor in weights:
            if name not in aliases:
                writer.write(name, tensor)
                tracker.advance(1, file_bytes.get(name, 0))
    except BaseException:
        writer.abort()
        raise
    files = writer.close()
    tracker.finish()
    saved = copy.deepcopy(planner.hf_config)
    saved.dtype = dtype  # the files' dtype, so from_pretrained(dtype="auto") agrees with them
    saved.save_pretrained(out_dir)
    return files
