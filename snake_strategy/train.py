"""Hydra entry points: ``python -m snake_strategy.train`` (or the ``snake-train`` console script), and the dry
run ``python -m snake_strategy.plan`` (snake_strategy/plan.py), which takes the same config groups and overrides.

The only module of the package that imports Hydra. It turns the composed config (``configs/`` at the
repository root) into plain objects, one ``_target_`` per group, and wires them together::

    python -m snake_strategy.train                                   # tiny GPT, placement/schedule: auto
    python -m snake_strategy.train model=small storage=ssd_all trainer.max_steps=50
    python -m snake_strategy.train experiment=io_bound_bench schedule=horizontal
    python -m snake_strategy.train -m storage=device,host,ssd      # a sweep, one job after another

Each run prints a short report and writes it to ``<output dir>/report.json``; ``main`` returns the final
training loss so that sweepers can minimise it. ``run(cfg)`` does the work for an already composed config
(tests use it with Hydra's compose API).
"""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from snake_strategy.checkpoint import consolidate
from snake_strategy.config import STATES, ScheduleConfig, StorageConfig
from snake_strategy.dry_run import DryRun, plan_run
from snake_strategy.gpt import GPTConfig
from snake_strategy.strategy import GreedySnakeStrategy
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.telemetry import StepReport

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def _gpt_field(config: Any, field: str) -> Any:
    """``${gpt:tiny,context_len}``: a field of a GPT preset (or of a GPTConfig mapping)."""
    return getattr(GPTConfig.from_any(config), field)


# Lets data configs follow the model preset, e.g. ``context_len: ${gpt:${model.config},context_len}``.
if not OmegaConf.has_resolver("gpt"):
    OmegaConf.register_new_resolver("gpt", _gpt_field)


def output_dir(cfg: DictConfig) -> Path:
    """This job's output directory: Hydra's runtime one inside a Hydra app, otherwise (compose API)
    ``hydra.runtime.output_dir`` or ``hydra.run.dir`` from the config, else the working directory."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    for key in ("hydra.runtime.output_dir", "hydra.run.dir"):
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value:
            return Path(str(value)).absolute()
    return Path.cwd()


def trainer_kwargs(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """``cfg.trainer`` as keyword arguments of ``lightning.Trainer``."""
    node = cfg.trainer
    root = OmegaConf.to_container(node, resolve=False).get("default_root_dir")
    kwargs = {}
    for key in node:
        if key == "default_root_dir" and isinstance(root, str) and root.startswith("${hydra:") \
                and not HydraConfig.initialized():
            kwargs[key] = str(out_dir)  # composed outside a Hydra app: the hydra resolver has nothing to read
        else:
            value = node[key]
            kwargs[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    if not cfg.run_validation:
        kwargs["limit_val_batches"] = 0
    return kwargs


def _choices() -> dict[str, str]:
    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: str(v) for k, v in choices.items() if not k.startswith("hydra/") and v is not None}


def _objects(cfg: DictConfig) -> tuple[Path, Any, Any, StorageConfig, ScheduleConfig]:
    """(output dir, model, data module, storage, schedule) of a composed config, the run seeded."""
    out_dir = output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    # One `_target_` per group; _convert_="all" hands the library plain dicts and lists, not OmegaConf nodes.
    model = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    storage = instantiate(cfg.storage, _convert_="all")
    schedule = instantiate(cfg.schedule, _convert_="all")
    if not isinstance(storage, StorageConfig) or not isinstance(schedule, ScheduleConfig):
        raise ValueError("configs storage/ and schedule/ must target snake_strategy.StorageConfig and "
                         f"snake_strategy.ScheduleConfig; got {type(storage).__name__}, {type(schedule).__name__}")
    return out_dir, model, datamodule, storage, schedule


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; return the report (also written to ``<output dir>/report.json``)."""
    out_dir, model, datamodule, storage, schedule = _objects(cfg)

    # A relative trace_path lands in the run's output directory, next to report.json.
    trace_path = out_dir / Path(str(cfg.trace_path)).expanduser() if cfg.get("trace_path") else None
    strategy = GreedySnakeStrategy(storage=storage, schedule=schedule, progress=cfg.get("progress", True),
                                   trace_path=trace_path)
    kwargs = trainer_kwargs(cfg, out_dir)
    report_cb = StepReport(log_every_n_steps=int(kwargs.get("log_every_n_steps") or 10))
    save_cb = SaveFinal(out_dir) if cfg.get("save_final", True) else None
    callbacks: list[L.Callback] = [report_cb] + ([save_cb] if save_cb is not None else [])
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **kwargs)
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)

    report = report_cb.summary()
    if report["val_loss"] is None and "val_loss" in trainer.callback_metrics:
        report["val_loss"] = float(trainer.callback_metrics["val_loss"])
    report["choices"] = _choices()
    report["plan"] = strategy.plan.as_dict() if strategy.plan is not None else None  # what "auto" chose
    report["saved"] = save_cb.saved if save_cb is not None else {}
    report["output_dir"] = str(out_dir)
    report["trace"] = str(trace_path) if trace_path is not None else None
    # Any model: counted from the module (tied weights once; meta tensors have a size too).
    report["num_params"] = sum(p.numel() for p in model.parameters())
    report["storage"] = {k: v for k, v in OmegaConf.to_container(cfg.storage, resolve=True).items() if k != "_target_"}
    report["schedule"] = {k: v for k, v in OmegaConf.to_container(cfg.schedule, resolve=True).items()
                          if k != "_target_"}
    path = out_dir / "report.json"
    path.write_text(json.dumps(_jsonable(report), indent=2) + "\n")

    print(f"\n=== greedysnake report ({path}) ===")
    if report["choices"]:
        print(" ".join(f"{k}={v}" for k, v in sorted(report["choices"].items())))
    print(report_cb.format_summary())
    if strategy.plan is not None:
        print("\n".join(plan_lines(strategy.plan)))
    for kind, saved in report["saved"].items():
        print(f"saved {kind}: {saved}")
    if trace_path is not None:
        print(f"timeline: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    return report


# The settings whose reasons the end-of-run report shows (all of them are in report.json's plan.reasons).
REPORTED_REASONS = (*STATES, "rollback", "kind", "prefetch_depth", "keep_activations")


def plan_lines(plan: RunPlan) -> list[str]:
    """The plan in a few lines: where each state lives, the budget it was placed in, and why (settings that
    share a reason on one line)."""
    places = ", ".join(f"{state} " + "/".join(f"{tier} {getattr(split, tier):g}" for tier in ("device", "host", "ssd")
                                              if getattr(split, tier))
                       for state in STATES if (split := getattr(plan.storage, state)) is not None)
    lines = [f"plan: {places}; host budget {plan.host_budget_bytes / 2**20:.1f} MiB ({plan.host_budget_source})"]
    by_reason: dict[str, list[str]] = {}
    for key in REPORTED_REASONS:
        if key in plan.reasons:
            by_reason.setdefault(plan.reasons[key], []).append(key)
    lines += [f"  {', '.join(keys)}: {reason}" for reason, keys in by_reason.items()]
    return lines


class SaveFinal(L.Callback):
    """Saves the trained model when training ends, while the strategy still holds its state: a directory
    checkpoint (resumable with ckpt_path=...) and, when the weights fit in host memory, a consolidated
    file that LightningModule.load_from_checkpoint reads."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.saved: dict[str, str] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        final = self.out_dir / "final.ckpt"
        trainer.save_checkpoint(final)
        self.saved["checkpoint"] = str(final)
        if trainer.strategy.weights_fit_host(trainer.strategy.engine):
            model_file = self.out_dir / "final_model.ckpt"
            consolidate(final, model_file, trainer.strategy.progress)
            self.saved["model"] = str(model_file)


def _jsonable(value: Any) -> Any:
    """NaN/inf become null so report.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def dry_run(cfg: DictConfig) -> DryRun:
    """The dry run of a composed config (``snake_strategy.dry_run.plan_run``): the model built on meta, the
    plan ``run(cfg)`` would use, its prediction for the data's first batch; written to ``<output dir>/plan.json``."""
    out_dir, model, datamodule, storage, schedule = _objects(cfg)
    strategy = GreedySnakeStrategy(storage=storage, schedule=schedule, progress=False)
    trainer = trainer_kwargs(cfg, out_dir)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    report = plan_run(model, strategy, batch, precision=str(trainer.get("precision") or "32-true"),
                      gradient_clip_val=trainer.get("gradient_clip_val"),
                      gradient_clip_algorithm=str(trainer.get("gradient_clip_algorithm") or "norm"))
    (out_dir / "plan.json").write_text(json.dumps(_jsonable(report.as_dict()), indent=2, default=str) + "\n")
    return report


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def plan_main(cfg: DictConfig) -> None:
    """``python -m snake_strategy.plan``: print the dry run and where its JSON is."""
    try:
        report = dry_run(cfg)
    except ValueError as err:  # the placement's refusal (even the working set does not fit): fit raises the same
        (output_dir(cfg) / "plan.json").write_text(json.dumps({"fits": False, "problems": [str(err)]}, indent=2) + "\n")
        print(f"fits: NO -- {err}\njson: {output_dir(cfg) / 'plan.json'}")
        sys.exit(1)
    print(report.describe())
    print(f"json: {output_dir(cfg) / 'plan.json'}")
    if not report.fits:
        sys.exit(1)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float:
    """Console entry point (``snake-train``); returns the final training loss for sweepers."""
    return float(run(cfg)["final_train_loss"])


if __name__ == "__main__":
    main()
