"""A HF directory's tensors under the model's own parameter names, through transformers' conversion mapping.

transformers 5 keeps some layers in a different layout in memory than in its files: a mixture-of-experts
layer holds its experts as 3-D parameters (``mlp.experts.gate_up_proj``: experts x 2·rows x columns) while
``save_pretrained`` and the Hub's checkpoints store one matrix per expert and projection
(``block_sparse_moe.experts.3.w1.weight``). ``from_pretrained`` converts with the model class's conversion
mapping (renamings, and converters that stack and concatenate). The streaming source reads a unit's
tensors by parameter name, so this module gives it, for each parameter name the conversion produces, the
file keys it is made of and how to combine them, using transformers' own mapping and operations:
``rename_source_key`` names each file key's target, the converter's ``operations`` combine the tensors.

Keys the mapping leaves alone are not listed (the source reads them directly).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key


@dataclass(frozen=True)
class Converted:
    """One parameter built from file tensors: ``combine([tensor of each key in sources])``."""

    sources: tuple[str, ...]
    combine: Callable[[list[Tensor]], Tensor]


class CheckpointKeys:
    """The conversion mapping of one HF model class (taken from the meta-built model at construction)."""

    def __init__(self, hf_model: nn.Module) -> None:
        transforms = get_model_conversion_mapping(hf_model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def convert(self, file_keys: Sequence[str]) -> dict[str, Converted]:
        """{parameter name: how to build it} for every parameter whose file keys the mapping renames or
        converts. The experts of a converted parameter are stacked in their index order."""
        renamed: dict[str, str] = {}
        groups: dict[str, tuple[WeightConverter, dict[str, list[str]]]] = {}
        for key in sorted(file_keys, key=dot_natural_key):
            target, pattern = rename_source_key(key, self.renamings, self.converters)
            if pattern is None:
                if target != key:
                    renamed[target] = key
                continue
            converter = next(c for c in self.converters if pattern in c.source_patterns)
            groups.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
        out = {target: Converted((key,), _only) for target, key in renamed.items()}
        for target, (converter, by_pattern) in groups.items():
            patterns = [p for p in converter.source_patterns if p in by_pattern]
            sources = tuple(key for p in patterns for key in by_pattern[p])
            counts = [len(by_pattern[p]) for p in patterns]
            out[target] = Converted(sources, _combiner(converter, patterns, counts))
        return out


def _only(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _combiner(converter: WeightConverter, patterns: list[str], counts: list[int]) -> Callable[[list[Tensor]], Tensor]:
    def combine(tensors: list[Tensor]) -> Tensor:
        collected, start = {}, 0
        for pattern, count in zip(patterns, counts):
            collected[pattern] = list(tensors[start:start + count])
            start += count
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=converter.source_patterns,
                                   target_patterns=converter.target_patterns)
        assert len(collected) == 1, f"a conversion to one parameter gave {sorted(collected)}"
        return next(iter(collected.values()))
    return combine
