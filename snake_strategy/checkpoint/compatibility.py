"""Whether a checkpoint belongs to this run: its optimizer state and its frozen base weights.

The manifest's ``optimizer`` record names the class, its kind and the state's slots with their dtypes; the
optimizer's spec decides whether it continues this run (``OptimizerSpec.accepts``); a unit's slots kept per tensor have their own lengths (``state_numel``),
since their indices are not the unit's elements. A checkpoint without the record holds Adam's two moments.
A fine-tuning checkpoint holds CRC-32s of the frozen weights instead of a copy: resuming it on other base
weights is refused.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from snake_strategy.optimizers.spec import legacy_record

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import CheckpointedEngine


def own_lengths(engine: CheckpointedEngine, u: int) -> dict:
    """The lengths of unit ``u``'s slots kept per tensor (their indices are not the unit's elements)."""
    own = engine.unit_own_lengths(u)
    return {"state_numel": own} if own else {}


def check_optimizer_record(root: Path, manifest: dict, engine: CheckpointedEngine) -> None:
    """Refuse a checkpoint whose optimizer state is another class's or another layout's, naming both."""
    saved = manifest.get("optimizer") or legacy_record(manifest["master_dtype"])
    if not engine.accepts_optimizer_record(saved):
        mine = engine.optimizer_record()
        raise ValueError(f"{root} holds the state of {saved['class']} ({', '.join(saved['slots']) or 'no state'}); this "
                         f"run's configure_optimizers returns {mine['class']} ({', '.join(mine['slots']) or 'no state'}). "
                         "Resume with the optimizer the checkpoint was trained with, or load only the weights "
                         "(snake_strategy.checkpoint.load / consolidate) and start a new run")


def check_frozen(root: Path, manifest: dict, current: dict) -> None:
    """Refuse to resume a fine-tuning checkpoint on top of other base weights than it was trained on."""
    saved_nonlayer = manifest.get("frozen_nonlayer", {})
    if set(saved_nonlayer) != set(current["nonlayer"]):
        raise ValueError(f"{root} was saved with frozen non-layer parameters {sorted(saved_nonlayer)}, this model "
                         f"freezes {sorted(current['nonlayer'])}; freeze the same parameters to resume it")
    changed = [name for name, crc in saved_nonlayer.items() if current["nonlayer"][name] != crc]
    for u, unit in enumerate(manifest["units"]):
        saved = unit.get("frozen", {"names": [], "crc32": zlib.crc32(b"")})
        if saved["crc32"] != current["units"][u]:
            changed += saved["names"] or [f"unit {u}"]
    if changed:
        raise ValueError(f"{root} does not hold the frozen (base) weights, and those of this model differ from the "
                         f"ones it was trained on ({changed[:3]}{' ...' if len(changed) > 3 else ''} have another "
                         "CRC-32): resume with the same base model (the same pretrained weights, seed and init)")
