"""Per-step throughput and traffic telemetry for a Lightning run (no Hydra here).

``StepReport`` times every training batch (one batch is one optimizer step under greedysnake),
counts its tokens, records the bytes the engine moved during the step, and keeps the losses. Its
``summary()`` is a plain dict, ready for ``json.dump``::

    report = StepReport()
    trainer = lightning.Trainer(strategy=GreedySnakeStrategy(...), callbacks=[report], ...)
    trainer.fit(model, datamodule)
    report.summary()["tokens_per_s"]

The engine's cumulative counters are captured in ``on_train_end``: the strategy's teardown, which runs
right after, closes the engine.

``EvalTraffic`` is the strategy's own record of what a validate/test/predict loop moved
(``strategy.eval_traffic``).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch

from snake_strategy.engine.view import EngineView, StepStats, running_engine
from snake_strategy.storage.counters import traffic_delta
from snake_strategy.progress import format_bytes

log = logging.getLogger(__name__)

TIERS = ("device", "host", "ssd")


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its first tensor (the inputs of an (inputs, targets) pair)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = count_tokens(item)
            if found:
                return found
    return 0


def _merge(*traffic: dict[str, int] | None) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for part in traffic:
        for key, value in (part or {}).items():
            out[key] += int(value)
    return dict(out)


def bytes_per_tier(flat: dict[str, int]) -> dict[str, int]:
    """``{"ssd/weights/read": n, ...}`` -> ``{"device": n, "host": n, "ssd": n}`` (reads + writes)."""
    out = {tier: 0 for tier in TIERS}
    for key, value in flat.items():
        tier = key.split("/", 1)[0]
        out[tier] = out.get(tier, 0) + int(value)
    return out


def bytes_per_tier_state(flat: dict[str, int]) -> dict[str, int]:
    """``{"ssd/weights/read": n, "ssd/weights/write": m}`` -> ``{"ssd/weights": n + m}``."""
    out: dict[str, int] = defaultdict(int)
    for key, value in flat.items():
        out[key.rsplit("/", 1)[0]] += int(value)
    return dict(sorted(out.items()))


class EvalTraffic:
    """Bytes moved by the last validate/test/predict loop, per ``tier/state/direction`` (``last``).

    Counted from the loop's start hook to its end hook: what a forward pass moves, not the engine's
    materialization at setup (nor a fit's steps when validation runs inside fit)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self._start: dict | None = None

    def begin(self, engine: EngineView | None) -> None:
        self._start = engine.counters.snapshot() if engine is not None else None

    def end(self, engine: EngineView | None) -> None:
        if engine is not None and self._start is not None:
            self.last = traffic_delta(self._start, engine.counters.snapshot())


class StepReport(pl.Callback):
    """Times each training step and records its tokens, loss and tier traffic.

    Args:
        log_every_n_steps: also write a one-line progress message through ``logging`` every this many
            steps (0 disables it). The per-step numbers are always logged to the Lightning loggers as
            ``perf/s_per_step``, ``perf/tokens_per_s``, ``io/ssd_bytes`` and ``io/host_bytes``.
        warmup_steps: steps left out of the throughput figures (the first step pays one-off costs),
            as long as at least one step remains.
    """

    def __init__(self, log_every_n_steps: int = 10, warmup_steps: int = 1) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.reset()

    def reset(self) -> None:
        self.step_seconds: list[float] = []
        self.step_tokens: list[int] = []
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.step_traffic: list[dict[str, int]] = []
        # Seconds of each step that compute waited on transfers (weights, checkpoints) and on the optimizer
        # worker: the I/O the overlap did not hide.
        self.step_io_wait_s: list[float] = []
        self.step_optimizer_wait_s: list[float] = []
        self.total_traffic: dict[str, int] | None = None
        self.predicted_s: float | None = None
        self.predicted_before_step_1_s: float | None = None  # the plan's prediction made before step 1 ran
        self.setup_timing_s: float | None = None  # what the timing behind it took (None: not timed)
        self._start: float | None = None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.reset()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is None:
            return
        seconds = time.perf_counter() - self._start
        self._start = None
        tokens = count_tokens(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        engine = running_engine(trainer)
        stats = engine.last_step if engine is not None else StepStats()
        traffic = stats.step_traffic()
        self.step_seconds.append(seconds)
        self.step_tokens.append(tokens)
        self.step_traffic.append(traffic)
        self.step_io_wait_s.append(stats.io_wait_s)
        self.step_optimizer_wait_s.append(stats.optimizer_wait_s)
        per_tier = bytes_per_tier(traffic)
        metrics = {
            "perf/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "io/ssd_bytes": float(per_tier["ssd"]),
            "io/host_bytes": float(per_tier["host"]),
            "io/ssd_gb_per_s": per_tier["ssd"] / seconds / 1e9 if seconds > 0 else 0.0,
            "perf/io_wait_s": stats.io_wait_s,
            "perf/optimizer_wait_s": stats.optimizer_wait_s,
            "perf/optimizer_busy_s": stats.optimizer_busy_s,
            # producers that waited for a free pooled buffer (memory held to the budget, at this cost)
            "perf/backpressure_wait_s": stats.backpressure_wait_s,
        }
        # Was this step speculative (norm clipping / fp16, engine/optimizer/rollback.py); rollbacks so far.
        metrics["perf/speculation"] = float(stats.speculation)
        metrics["perf/rollbacks"] = float(stats.rollbacks)
        prediction = getattr(trainer.strategy, "prediction", None)
        hardware = getattr(trainer.strategy, "hardware_profile", None)
        plan = getattr(trainer.strategy, "plan", None)
        setup = getattr(plan, "setup_prediction", None)
        if setup is not None:
            self.predicted_before_step_1_s = setup.roofline_s
            self.setup_timing_s = getattr(plan, "setup_timing_s", None)
        if prediction is not None:
            self.predicted_s = prediction.roofline_s
            metrics["perf/predicted_floor_s"] = prediction.roofline_s
            metrics["perf/achieved_over_floor"] = seconds / prediction.roofline_s if prediction.roofline_s else 0.0
            if hardware is not None and not isinstance(hardware, str):
                # FLOP/s achieved on the step's matmul work, next to the roof measured for this shape.
                metrics["perf/flops_per_s"] = prediction.compute_s * hardware.flops_per_s / seconds
                metrics["perf/peak_flops_per_s"] = hardware.flops_per_s
                metrics["io/peak_ssd_read_gb_per_s"] = hardware.ssd_read_gb_per_s
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("perf/s_per_step", seconds, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        step = len(self.step_seconds)
        if self.log_every_n_steps and step % self.log_every_n_steps == 0:
            loss_text = f"{self.losses[-1]:.4f}" if self.losses else "n/a"
            floor = f" (planner floor {prediction.roofline_s:.3f} s" if prediction is not None else ""
            if floor and setup is not None:
                floor += f", {setup.roofline_s:.3f} s predicted before step 1"
            floor += ")" if floor else ""
            log.info("step %d | loss %s | %.3f s%s | %.0f tokens/s | ssd %s | host %s", step, loss_text, seconds, floor,
                     tokens / seconds if seconds > 0 else 0.0, format_bytes(per_tier["ssd"]),
                     format_bytes(per_tier["host"]))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get("val_loss")
        if value is not None:
            self.val_losses.append(float(value))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last moment the engine is alive: the strategy's teardown closes it right after.
        engine = running_engine(trainer)
        if engine is not None:
            self.total_traffic = engine.counters.as_flat_dict()

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        """Plain-Python results of the run so far (JSON-serialisable).

        median_s_per_step: median wall time of one training step (forward, backward, optimizer).
        tokens_per_s: tokens / seconds summed over the steps after ``warmup_steps``.
        bytes_total: the engine's cumulative counters ("tier/state/direction" -> bytes), setup and
            validation traffic included; captured at the end of training (None without an engine).
        bytes_per_tier / bytes_per_tier_state: the same, reads and writes added up.
        step_bytes_mean: mean bytes per training step ("tier/state/direction"), optimizer step included.
        exposed_io_s / exposed_optimizer_s: seconds of all steps that compute waited on transfers / on the
            optimizer worker (what the overlap did not hide), next to train_s, the steps' total.
        """
        skip = self.warmup_steps if len(self.step_seconds) > self.warmup_steps else 0
        seconds = self.step_seconds[skip:]
        tokens = self.step_tokens[skip:]
        total_s = sum(seconds)
        step_bytes: dict[str, float] = {}
        if self.step_traffic:
            summed = _merge(*self.step_traffic)
            step_bytes = {k: v / len(self.step_traffic) for k, v in sorted(summed.items())}
        total = self.total_traffic
        return {
            "steps": len(self.step_seconds),
            "final_train_loss": self.losses[-1] if self.losses else math.nan,
            "val_loss": self.val_losses[-1] if self.val_losses else None,
            "median_s_per_step": statistics.median(self.step_seconds) if self.step_seconds else math.nan,
            "tokens_per_step": self.step_tokens[-1] if self.step_tokens else 0,
            "tokens_per_s": sum(tokens) / total_s if total_s > 0 else math.nan,
            "losses": list(self.losses),
            "val_losses": list(self.val_losses),
            "bytes_total": dict(total) if total is not None else None,
            "bytes_per_tier": bytes_per_tier(total) if total is not None else None,
            "bytes_per_tier_state": bytes_per_tier_state(total) if total is not None else None,
            "step_bytes_mean": step_bytes,
            "predicted_floor_s_per_step": self.predicted_s,  # the last: after the first step and calibration
            "predicted_before_step_1_s_per_step": self.predicted_before_step_1_s,
            "setup_timing_s": self.setup_timing_s,  # what the timing behind that prediction took
            "train_s": sum(self.step_seconds),
            "exposed_io_s": sum(self.step_io_wait_s),
            "exposed_optimizer_s": sum(self.step_optimizer_wait_s),
        }

    def format_summary(self) -> str:
        """A few human-readable lines of ``summary()``."""
        s = self.summary()
        val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
        lines = [
            f"steps {s['steps']} | final train loss {s['final_train_loss']:.4f} | val loss {val}",
            f"median {s['median_s_per_step']:.3f} s/step | {s['tokens_per_s']:.0f} tokens/s "
            f"({s['tokens_per_step']} tokens/step)",
        ]
        if s["predicted_floor_s_per_step"]:
            lines.append(f"planner floor {s['predicted_floor_s_per_step']:.3f} s/step | achieved / floor "
                         f"{s['median_s_per_step'] / s['predicted_floor_s_per_step']:.2f}")
        if s["predicted_before_step_1_s_per_step"]:
            lines.append(f"predicted before step 1 {s['predicted_before_step_1_s_per_step']:.3f} s/step | measured / "
                         f"predicted {s['median_s_per_step'] / s['predicted_before_step_1_s_per_step']:.2f}")
            if s["setup_timing_s"] is not None:
                lines[-1] += (f" | its timing took {s['setup_timing_s']:.1f} s "
                              f"({s['setup_timing_s'] / s['median_s_per_step']:.0%} of a step)")
        if s["bytes_per_tier"] is not None:
            tiers = ", ".join(f"{t} {format_bytes(n)}" for t, n in s["bytes_per_tier"].items())
            lines.append(f"bytes moved (whole run): {tiers}")
            for key, n in s["bytes_per_tier_state"].items():
                lines.append(f"  {key:<24} {format_bytes(n)}")
        if s["steps"]:
            share = (lambda x: f"{x / s['train_s']:.0%}") if s["train_s"] > 0 else (lambda x: "n/a")
            lines.append(f"exposed I/O: compute waited {s['exposed_io_s']:.2f} s on transfers ({share(s['exposed_io_s'])}) "
                         f"and {s['exposed_optimizer_s']:.2f} s on the optimizer ({share(s['exposed_optimizer_s'])}) "
                         f"of {s['train_s']:.2f} s of steps")
        return "\n".join(lines)
