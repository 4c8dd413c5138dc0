"""Small, validated configuration objects, one per component.

Plain dataclasses so the library works from a notebook; the Hydra app builds them from YAML.
Every user error raises ValueError naming the field and the fix.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from snake_strategy.moved import renamed

TIERS = ("device", "host", "ssd")
# The offloadable training states. "master" only has its own storage when the compute weights are
# not fp32/fp64 (bf16-true); otherwise the compute weights are the master copy and are stored once.
STATES = ("weights", "master", "optimizer", "gradients", "checkpoints")
PLACEMENTS = ("manual", "auto")
# Where the speculative optimizer step keeps its rollback state (engine/optimizer/rollback.py): all of it on one tier.
ROLLBACK_TIERS = ("host", "ssd")


@dataclass(frozen=True)
class TierShares:
    """Fractions of one state's bytes on each tier; they must add up to 1."""

    device: float = 0.0
    host: float = 1.0
    ssd: float = 0.0

    def __post_init__(self) -> None:
        for tier in TIERS:
            value = getattr(self, tier)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"tier fraction {tier}={value} must lie in [0, 1]")
        total = self.device + self.host + self.ssd
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"tier fractions device={self.device}, host={self.host}, ssd={self.ssd} add up to {total}, not 1"
            )

    @classmethod
    def coerce(cls, value: Any, name: str) -> TierShares:
        if isinstance(value, TierShares):
            return value
        if isinstance(value, str):
            if value not in TIERS:
                raise ValueError(f"storage.{name}='{value}' is not a tier; use one of {TIERS} or a mapping")
            return cls(**{t: float(t == value) for t in TIERS})
        if isinstance(value, Mapping):
            unknown = set(value) - set(TIERS)
            if unknown:
                raise ValueError(f"storage.{name} has unknown tiers {sorted(unknown)}; known: {TIERS}")
            given = {k: float(v) for k, v in value.items()}
            # Unspecified tiers default to 0, except host takes whatever is left.
            given.setdefault("device", 0.0)
            given.setdefault("ssd", 0.0)
            given.setdefault("host", 1.0 - given["device"] - given["ssd"])
            try:
                return cls(**given)
            except ValueError as err:
                raise ValueError(f"storage.{name}: {err}") from None
        raise ValueError(f"storage.{name} must be a tier name or a mapping of tier fractions, got {value!r}")


def whole_number(value: Any, name: str) -> int:
    """``value`` as an int: YAML, JSON and arithmetic (``total / micro_size``) give ``2.0`` for 2; a
    fraction, a bool or a string is a mistake worth naming rather than a TypeError deep in the engine."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a whole number, not {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if not float(value).is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number")
    return int(value)


@dataclass
class StorageConfig:
    """Where each training state lives.

    ``placement="manual"``: every state left unset lives on the host. ``placement="auto"`` (what
    ``GreedySnakeStrategy()`` uses when given no storage): the planner places every state left unset
    (None) within ``host_budget_bytes`` (``planning.run_plan.resolve``); the ones given stay as given.
    ``ssd_dir=None`` puts the SSD tier in a fresh temporary directory that teardown removes.
    ``checkpoint_host_ends`` keeps the activation checkpoints of the first and last that many
    micro-batches of each unit on the host: they sit at the schedule's turning points, where an
    SSD round trip would stall the next task.
    """

    ssd_dir: str | None = None
    weights: TierShares | None = None
    master: TierShares | None = None
    optimizer: TierShares | None = None
    gradients: TierShares | None = None
    checkpoints: TierShares | None = None
    checkpoint_host_ends: int = 2
    use_o_direct: bool = True
    num_io_threads: int = 2
    keep_ssd_files: bool = False
    # Hard cap on the host memory the plan may use (persistent host shares + working buffers +
    # checkpoints kept in memory); None = no cap. Checked at setup and before the first step.
    host_budget_bytes: int | None = None
    # The optimizer worker steps a unit in chunks of this many elements (a multiple of 4096): its
    # scratch memory is ~5 chunks whatever the unit size; larger chunks mean fewer, larger transfers.
    optimizer_chunk_elems: int = 8192 * 4096
    placement: str = "manual"
    # The speculative optimizer step's rollback state (pre-step master weights, moments and the raw
    # gradient of each unit's backward part; only under norm clipping or fp16 loss scaling): "host" or
    # "ssd". None: the planner puts it on the host when the budget allows (placement "auto"), else the
    # host (placement "manual").
    rollback: str | None = None
    # Where the trained weights go after fit when they do not fit the host budget (a safetensors file the
    # module's parameters then map), to keep the file there after the process ends. None: the file is
    # written where the SSD tier lives (ssd_dir, else its temporary directory) and its name is removed once
    # mapped, so it goes away with the process (the checkpoints hold the state to keep).
    export_dir: str | None = None
    # The SSD's rated endurance in terabytes written (its datasheet's TBW): the dry run and the fit's log say
    # how many days of this run's writes use it up. 600: a typical 1 TB TLC NVMe drive.
    ssd_endurance_tbw: float = 600.0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"storage.placement='{self.placement}' is not one of {PLACEMENTS}")
        for name in ("checkpoint_host_ends", "num_io_threads", "optimizer_chunk_elems"):
            setattr(self, name, whole_number(getattr(self, name), f"storage.{name}"))
        if self.host_budget_bytes is not None:
            self.host_budget_bytes = whole_number(self.host_budget_bytes, "storage.host_budget_bytes")
        if self.host_budget_bytes is not None and self.host_budget_bytes <= 0:
            raise ValueError(f"storage.host_budget_bytes={self.host_budget_bytes} must be positive (or null)")
        for state in STATES:
            value = getattr(self, state)
            if value is None and self.placement == "manual":
                value = TierShares()  # on the host
            if value is not None:
                setattr(self, state, TierShares.coerce(value, state))
        if self.rollback is None and self.placement == "manual":
            self.rollback = "host"
        if self.rollback is not None and self.rollback not in ROLLBACK_TIERS:
            raise ValueError(f"storage.rollback='{self.rollback}' is not one of {ROLLBACK_TIERS}")
        if self.checkpoint_host_ends < 0:
            raise ValueError(f"storage.checkpoint_host_ends={self.checkpoint_host_ends} must be >= 0")
        if self.optimizer_chunk_elems < 4096 or self.optimizer_chunk_elems % 4096:
            raise ValueError(f"storage.optimizer_chunk_elems={self.optimizer_chunk_elems} must be a positive multiple "
                             "of 4096 (whole pages of the SSD tier)")
        if not isinstance(self.ssd_endurance_tbw, (int, float)) or not self.ssd_endurance_tbw > 0:
            raise ValueError(f"storage.ssd_endurance_tbw={self.ssd_endurance_tbw!r} must be the drive's rated endurance "
                             "in terabytes written (its datasheet's TBW, e.g. 600 for a typical 1 TB NVMe drive)")
        if self.num_io_threads < 1:
            raise ValueError(f"storage.num_io_threads={self.num_io_threads} must be >= 1")
        if self.ssd_dir is not None:
            # "~/ssd" or "$SCRATCH/run1" as a shell would read it, not a directory literally named "~".
            self.ssd_dir = os.path.expandvars(os.path.expanduser(os.fspath(self.ssd_dir)))
        if self.export_dir is not None:
            if not isinstance(self.export_dir, (str, os.PathLike)) or not os.fspath(self.export_dir):
                raise ValueError(f"storage.export_dir={self.export_dir!r} must be a directory path (where the trained "
                                 "weights file is kept after fit), or null to let it go away with the process")
            self.export_dir = os.path.expandvars(os.path.expanduser(os.fspath(self.export_dir)))
            if os.path.exists(self.export_dir) and not os.path.isdir(self.export_dir):
                raise ValueError(f"storage.export_dir='{self.export_dir}' is a file, not a directory: name a directory "
                                 "to keep the trained weights file in (it is created if missing), or null")

    def uses_ssd(self) -> bool:
        return any(getattr(self, state).ssd > 0 for state in STATES) or self.rollback == "ssd"

    def unset(self) -> list[str]:
        """The states the planner still has to place (empty once resolved)."""
        return [state for state in STATES if getattr(self, state) is None]


SCHEDULES = ("auto", "vertical", "horizontal")
# What an explicit ``kind`` gives the fields left unset (None): fixed values, so that a run that names its
# schedule does not change with the planner.
SCHEDULE_DEFAULTS = {"alpha": 0.25, "batched_backward": False, "batched_forward": False, "split_backward": False,
                     "prefetch_depth": 1, "speculation": "on"}
SPECULATION = ("on", "off")


@dataclass
class ScheduleConfig:
    """How one optimizer step is ordered.

    ``kind="vertical"`` is the GreedySnake order (all micro-batches of a unit before the next unit);
    ``"horizontal"`` is ZeRO-Infinity-style gradient accumulation (one micro-batch through all units);
    ``"auto"`` (the default) lets the planner choose the order and every field left None (alpha,
    batching, split backward, prefetch depth: ``planning.run_plan.resolve``) at setup. With an explicit
    kind, fields left None take ``SCHEDULE_DEFAULTS``. A unit is ``blocks_per_unit`` consecutive blocks:
    the grain of every transfer and optimizer step.
    """

    kind: str = "auto"
    num_micro_batches: int = 4
    blocks_per_unit: int = 1
    # Fraction of each unit's parameters whose optimizer step is deferred to the next iteration's
    # forward (docs/design.md, "Optimizer overlap"); the rest is stepped during this iteration's backward.
    alpha: float | None = None
    # Backward of a unit as one batched pass over all its micro-batches (one weight-gradient product
    # per Linear; vertical schedule only; blocks must treat samples independently).
    batched_backward: bool | None = None
    # Forward of a unit as one batched pass over all its micro-batches (vertical only; the
    # checkpoints are still kept per micro-batch). Larger matmuls run faster on CPUs.
    batched_forward: bool | None = None
    # LayerPipe's split backward (vertical only): per micro-batch the input gradient first, then every
    # Linear weight gradient of the unit over all micro-batches as one product (engine/step/split_backward.py). Exact for
    # any block (no sample-independence needed).
    split_backward: bool | None = None
    # How many upcoming units' weights are fetched ahead of use (0 = fetch on demand, no overlap).
    prefetch_depth: int | None = None
    # Units (counted down from the top) whose forward autograd graph is kept in memory until their
    # backward instead of being recomputed from the checkpoint (engine/step/kept_graphs.py): saves a forward per unit,
    # costs the saved activations. "auto": as many as the host budget holds, measured at the first step.
    # None: "auto" with kind "auto", else 0 (recompute every unit, the classic schedule).
    keep_activations: int | str | None = None
    # Under norm clipping and fp16 loss scaling: "on" steps each unit's backward part as if the clip factor
    # were 1 and nothing overflowed, and rolls back the steps when that was wrong (engine/optimizer/rollback.py);
    # "off" defers every unit's whole update to the next forward (alpha 1). No effect otherwise.
    speculation: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_micro_batches", "blocks_per_unit"):
            setattr(self, name, whole_number(getattr(self, name), f"schedule.{name}"))
        if self.prefetch_depth is not None:
            self.prefetch_depth = whole_number(self.prefetch_depth, "schedule.prefetch_depth")
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule.kind='{self.kind}' is not one of {SCHEDULES}")
        if self.kind != "auto":
            for name, value in SCHEDULE_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
        # 1: every unit's whole update deferred to the next forward (what speculation="off" runs under
        # norm clipping or fp16 loss scaling).
        if self.alpha is not None and not (0.0 <= self.alpha <= 0.5 or self.alpha == 1.0):
            raise ValueError(f"schedule.alpha={self.alpha} must lie in [0, 0.5], or be 1 (whole updates deferred)")
        if self.speculation is not None and self.speculation not in SPECULATION:
            raise ValueError(f"schedule.speculation='{self.speculation}' must be one of {SPECULATION}")
        for name in ("batched_backward", "batched_forward", "split_backward"):
            if getattr(self, name) and self.kind == "horizontal":
                raise ValueError(f"schedule.{name}=true needs schedule.kind='vertical' (it works on all micro-batches "
                                 "of a unit, which only the vertical order has at hand)")
        if self.split_backward and self.batched_backward:
            raise ValueError("schedule.split_backward=true and schedule.batched_backward=true are two ways to run a "
                             "unit's backward: set one of them")
        self._check_keep_activations()
        if self.prefetch_depth is not None and self.prefetch_depth < 0:
            raise ValueError(f"schedule.prefetch_depth={self.prefetch_depth} must be >= 0")
        if self.num_micro_batches < 1:
            raise ValueError(f"schedule.num_micro_batches={self.num_micro_batches} must be >= 1")
        if self.blocks_per_unit < 1:
            raise ValueError(f"schedule.blocks_per_unit={self.blocks_per_unit} must be >= 1")

    def _check_keep_activations(self) -> None:
        keep = self.keep_activations
        if keep is None:
            keep = self.keep_activations = "auto" if self.kind == "auto" else 0
        if isinstance(keep, str):
            if keep != "auto":
                raise ValueError(f"schedule.keep_activations='{keep}' must be 'auto' or a number of units")
            return
        keep = self.keep_activations = whole_number(keep, "schedule.keep_activations")
        if keep < 0:
            raise ValueError(f"schedule.keep_activations={keep} must be >= 0 (a number of units) or 'auto'")
        if keep and self.split_backward:
            raise ValueError("schedule.keep_activations>0 and schedule.split_backward=true: the split backward "
                             "defers the weight gradients of a recompute; set keep_activations=0 or "
                             "split_backward=false")
        if keep and self.kind == "vertical" and self.batched_forward is not None \
                and self.batched_backward is not None and self.batched_forward != self.batched_backward:
            raise ValueError(f"schedule.keep_activations={keep} needs the forward and the backward to group "
                             f"micro-batches alike, but batched_forward={self.batched_forward} and "
                             f"batched_backward={self.batched_backward}: set both flags to the same value")

    def unset(self) -> list[str]:
        """The fields the planner still has to choose (empty once resolved)."""
        return [name for name in ("kind", *SCHEDULE_DEFAULTS) if getattr(self, name) in (None, "auto")]


def coerce_config(cls: type, value: Any, name: str) -> Any:
    """Accept an instance, a mapping (e.g. an OmegaConf DictConfig) or None (defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known - {"_target_"}
        if unknown:
            raise ValueError(f"{name} has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: v for k, v in value.items() if k != "_target_"})
    raise ValueError(f"{name} must be a {cls.__name__} or a mapping, got {type(value).__name__}")


def requested_storage(value: Any) -> StorageConfig:
    """The storage a strategy is given: None, "auto", or a mapping that names no state and sets no
    ``placement`` (e.g. ``{"ssd_dir": "/nvme/run"}``) is placed by the planner (``placement="auto"``); a
    mapping that names a state keeps the manual default (the states it does not name on the host) unless
    it says ``placement: auto``; a ``StorageConfig`` is taken as built."""
    if value is None or (isinstance(value, str) and value == "auto"):
        value = {"placement": "auto"}
    elif isinstance(value, Mapping) and "placement" not in value and not set(value) & {*STATES, "rollback"}:
        value = {**value, "placement": "auto"}
    return coerce_config(StorageConfig, value, "storage")


__getattr__ = renamed(__name__)  # TierSplit, the old name of TierShares (snake_strategy/moved.py)
