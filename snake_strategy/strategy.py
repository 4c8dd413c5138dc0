"""The Lightning glue: ``Trainer(strategy="greedysnake")``. Its hooks delegate: checkpoint saves, loads and
preemption to ``checkpoint/saver.py``, the weights the module holds after a run to ``weights_handback.py``,
the trainer and loader checks to ``contract.py``, evaluation traffic to ``telemetry.py``.

One Lightning batch is one optimizer step: ``training_step`` splits the global batch into
``schedule.num_micro_batches`` micro-batches and runs the whole schedule through the engine;
``optimizer_step`` then lets Lightning run its hooks and applies the engine's AdamW step. The user's
optimizer only holds hyper-parameters (see ``optim.py``), so LR schedulers keep working.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import time
from collections.abc import Generator
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from snake_strategy.checkpoint import saver as checkpoint_saver
from snake_strategy.config import ScheduleConfig, StorageConfig, coerce_config, requested_storage
from snake_strategy.contract import (check_contract, check_fit_settings, check_not_empty, check_outputs_on_meta,
                                     loader_batch_size)
from snake_strategy.distributed import DataParallelMixin, build_engine, check_rank_loader, close_engine, rank_storage, sync_initial_state
from snake_strategy.engine import EngineHooks, EngineRuntime, EvalEngine, SnakeEngine
from snake_strategy.engine.state.weights_file import weights_file_name
from snake_strategy.module import LayeredModule
from snake_strategy.planning.run_plan import RunPlan, resolve
from snake_strategy.planning.run_prediction import RunPredictor, example_batch
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, StepPrediction
from snake_strategy.precision import GreedySnakePrecision
from snake_strategy.progress import Progress
from snake_strategy.telemetry import EvalTraffic
from snake_strategy.timeline import check_trace_path, export_trace
from snake_strategy.weights_handback import WeightsHandback, weights_fit

log = logging.getLogger(__name__)


class GreedySnakeStrategy(DataParallelMixin, ParallelStrategy):
    """Train a layered model whose state lives on device, host and SSD tiers, with the snake schedule.

    Args:
        storage: where each state lives (``StorageConfig`` or a mapping of its fields); None, "auto", or a
            mapping that names no state (``{"ssd_dir": ...}``): placed by the planner
            (``StorageConfig(placement="auto")``).
        schedule: task order, micro-batches per step and blocks per unit (``ScheduleConfig`` or mapping;
            its default kind "auto" lets the planner choose what is not given). ``strategy.plan`` holds the
            choice after setup.
        hardware: the machine's rates for the planner's roofline: ``"probe"`` (measure, cached on disk),
            a ``HardwareProfile`` or mapping, or None (this machine class's nominal figures).
        pretrained: a state-dict or Lightning checkpoint file to stream in one unit at a time instead of
            initialising the weights.
        hooks: test hooks that slow parts of the engine down (``EngineHooks``); None in normal use.
        progress: progress of setup, checkpoints, export and long steps: a ``Progress`` (add listeners
            there), or True/False to force its output on/off; None (and a ``Progress(log=None)``) shows it
            exactly when the Trainer's progress bar is enabled. Work shorter than ``Progress.delay_s`` (2 s)
            writes one summary line; longer work a bar on a terminal, log lines elsewhere.
        trace_path: write the run's timeline (the last ``engine.trace.keep`` steps) to this file at teardown, as
            a Chrome/Perfetto trace (``snake_strategy.timeline``); None records no timeline.
        cluster_environment, process_group_backend, timeout: as ``DDPStrategy``'s, for ``devices``/``num_nodes``
            > 1 (data parallel, ``distributed.py``): gloo on CPU, NCCL on CUDA by default.
        shard_optimizer_state: with several ranks, each keeps 1/N of the Adam moments (ZeRO-1,
            ``engine/parallel/partition.py``); False replicates them.
    """

    strategy_name = "greedysnake"

    def __init__(
        self,
        storage: StorageConfig | dict | None = None,
        schedule: ScheduleConfig | dict | None = None,
        hardware: HardwareProfile | dict | str | None = None,
        pretrained: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        precision_plugin: Precision | None = None,
        hooks: EngineHooks | None = None,
        progress: Progress | bool | None = None,
        trace_path: str | os.PathLike | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | None = None,
        shard_optimizer_state: bool = True,
    ) -> None:
        self.requested = (requested_storage(storage),  # as asked ("auto" fields unset); the plan's after setup
                          coerce_config(ScheduleConfig, None if schedule == "auto" else schedule, "schedule"))
        self.plan: RunPlan | None = None
        if isinstance(hardware, str) and hardware != "probe":
            raise ValueError(f"hardware='{hardware}' is not understood; pass 'probe', a HardwareProfile, a mapping or None")
        self.hardware = hardware if hardware in (None, "probe") else coerce_config(HardwareProfile, hardware, "hardware")
        self.pretrained = pretrained  # a state dict / .ckpt file streamed in unit by unit at setup
        self.prediction: StepPrediction | None = None  # the planner's floor for this run's step
        self.engine: SnakeEngine | EvalEngine | None = None
        self.hooks = hooks
        self.progress = progress if isinstance(progress, Progress) else Progress(log=progress)
        self.trace_path = None if trace_path is None else check_trace_path(trace_path)  # refused now, not at the end
        super().__init__(accelerator=accelerator, cluster_environment=cluster_environment,
                         precision_plugin=precision_plugin)  # parallel_devices: filled by Lightning's connector
        self._init_data_parallel(process_group_backend, timeout)
        self.shard_optimizer_state = shard_optimizer_state
        self._predicted_at_step_one = False
        self.predictor: RunPredictor | None = None  # the fit's prediction, from before step 1 to its calibration
        self._step_start_s = 0.0  # when the running step's training_step began (the calibration's wall time)
        self._created_ssd_dirs: list[str] = []  # ssd_dir levels several ranks made, removed at close
        self._saver = checkpoint_saver.CheckpointSaver(self.progress)
        self._handback = WeightsHandback()
        self._eval_traffic = EvalTraffic()

    # ------------------------------------------------------------------ what users and tests read
    @property
    def storage(self) -> StorageConfig:
        """Where each state lives: the plan's concrete placement after setup, as requested before."""
        return self.plan.storage if self.plan is not None else self.requested[0]

    @property
    def schedule(self) -> ScheduleConfig:
        """The schedule: the plan's concrete one after setup, as requested before."""
        return self.plan.schedule if self.plan is not None else self.requested[1]

    @property
    def weights_file(self) -> str | None:
        """The safetensors file the module's parameters map after fit (``WeightsHandback.weights_file``)."""
        return self._handback.weights_file

    @property
    def eval_traffic(self) -> dict[str, int]:
        """Bytes moved by the last validate/test/predict loop, per tier/state/direction."""
        return self._eval_traffic.last

    @property
    def last_save(self) -> dict[str, Any]:
        """written_bytes, seconds, methods of the last checkpoint save."""
        return self._saver.last_save

    # ------------------------------------------------------------------ plugins and devices
    @property
    @override
    def precision_plugin(self) -> GreedySnakePrecision:
        return self._precision_plugin if self._precision_plugin is not None else GreedySnakePrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands a registry-built strategy a generic plugin; keep only its precision string.
        if plugin is None or isinstance(plugin, GreedySnakePrecision):
            self._precision_plugin = plugin
        else:
            self._precision_plugin = GreedySnakePrecision(getattr(plugin, "precision", "32-true"))

    @override
    def model_to_device(self) -> None:
        """Nothing: moving the whole model to the device is exactly what must not happen."""

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Build on the meta device; the engine materializes one unit at a time into its tiers.
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        check_contract(module)
        if trainer.state.fn != TrainerFn.FITTING:
            self._setup_eval(trainer)
            return
        self._handback.start_fit(module)
        try:
            self._setup_fit(trainer, module)
        except BaseException as err:
            self._handback.setup_failed(module, err)  # its pre-fit weights, or a guard naming err
            raise
        self._handback.setup_done()

    def _setup_fit(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if type(module).training_step is not LayeredModule.training_step and isinstance(module, LayeredModule):
            log.warning("%s overrides training_step, which strategy='greedysnake' does not call: it runs its own "
                        "schedule from pre_stage, blocks, post_stage and compute_loss. Put the loss in "
                        "compute_loss; log from callbacks or validation_step", type(module).__name__)
        clip = check_fit_settings(trainer, module)
        self.progress.follow_progress_bar(trainer.progress_bar_callback is not None)
        self.accelerator.setup(trainer)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"strategy='greedysnake' needs exactly one optimizer; configure_optimizers "
                             f"returned {len(self.optimizers)}")
        self._resolve_plan(self.optimizers[0], clip)
        batch = example_batch(trainer)  # map-style loader (nothing iterated): for the check and the floor at setup
        check_outputs_on_meta(module, batch, self.schedule.num_micro_batches)  # before any weight exists
        runtime = EngineRuntime(self.precision_plugin.dtypes, self.root_device, clip=clip,
                                scaler=self.precision_plugin.make_scaler(),
                                pretrained=self._handback.pretrained(self.pretrained), hooks=self.hooks,
                                progress=self.progress, world_size=self.world_size, rank=self.global_rank,
                                shard_optimizer=self.shard_optimizer_state, trace=self.trace_path is not None)

        def build() -> SnakeEngine:
            plan = self._rank_plan()
            # The checkpoints' space is checked before the engine streams the weights (minutes at 7B).
            self._saver.prepare_fit(plan, trainer, self.is_global_zero)
            return SnakeEngine(module, self.optimizers[0], plan, runtime)

        # Several ranks: every rank's storage is checked first, and a failure on one stops all.
        self.engine, self._created_ssd_dirs = build_engine(build, self.storage, self.global_rank, self.world_size)
        if self.world_size > 1:
            sync_initial_state(self.engine, self.root_device)  # every rank starts from rank 0's weights
        self._predicted_at_step_one = False
        self.predictor = RunPredictor(self.hardware, self.root_device, self.is_global_zero)
        with contextlib.suppress(ValueError):  # a batch the run refuses: that refusal comes with its own check
            self.prediction = self._predict(batch, at_setup=True) if batch is not None else None
        # Lightning's strategies set the device through module.to(); the blocks must not move, so set the
        # attribute LightningModule.device reads, as model_to_device would have.
        module._device = self.root_device
        self.setup_precision_plugin()
        self._saver.start_fit(self.engine, trainer, self.is_global_zero)

    def _setup_eval(self, trainer: pl.Trainer) -> None:
        """validate/test/predict: a forward-only engine with the compute weights only (no optimizer, no
        moments, no gradients), from ``ckpt_path``, ``pretrained`` or the module's own weights."""
        module = self.lightning_module
        checkpoint = self._saver.take_eval_checkpoint()
        self._handback.start_eval(module, trainer.state.fn.value, checkpoint is not None)
        self.progress.follow_progress_bar(trainer.progress_bar_callback is not None)
        self.accelerator.setup(trainer)
        self._resolve_plan(None)
        source = self._handback.eval_source(module, checkpoint, self.pretrained)
        runtime = EngineRuntime(self.precision_plugin.dtypes, self.root_device, hooks=self.hooks, progress=self.progress)
        plan = self._rank_plan()
        # As for training: under data parallelism the ranks' SSD directories are checked together first.
        self.engine, self._created_ssd_dirs = build_engine(lambda: EvalEngine(module, plan, runtime, source=source),
                                                           self.storage, self.global_rank, self.world_size)
        module._device = self.root_device  # as in setup(): the blocks must not move
        self.setup_precision_plugin()

    def _rank_plan(self) -> RunPlan:
        """The plan as this rank runs it: its own ``ssd_dir/rank{r}`` under data parallelism."""
        return dataclasses.replace(self.plan, storage=rank_storage(self.storage, self.global_rank, self.world_size))

    @property
    def _evaluating(self) -> bool:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return trainer is not None and trainer.state.fn not in (None, TrainerFn.FITTING)

    @override
    def on_validation_start(self) -> None:
        # Deferred forward-part updates must land before anything reads the weights.
        if self.engine is not None:
            self.engine.flush()
        self._eval_traffic.begin(self.engine)

    @override
    def on_validation_end(self) -> None:
        self._eval_traffic.end(self.engine)

    @override
    def on_test_start(self) -> None:
        self._eval_traffic.begin(self.engine)

    @override
    def on_test_end(self) -> None:
        self._eval_traffic.end(self.engine)

    @override
    def on_predict_start(self) -> None:
        self._eval_traffic.begin(self.engine)

    @override
    def on_predict_end(self) -> None:
        self._eval_traffic.end(self.engine)

    @override
    def on_train_start(self) -> None:
        # The global batch size from the loader: a short last batch is then recognised as such, and a
        # batch size that can never split is refused before step 1.
        loader = self.lightning_module.trainer.train_dataloader
        size = loader_batch_size(loader, self.schedule.num_micro_batches) if self.engine is not None else None
        if size is not None:
            self.engine.global_batch_size = size  # this rank's batch (its DistributedSampler's share)
            if self.world_size > 1:
                check_rank_loader(loader, size, self.world_size)

    @override
    def on_train_end(self) -> None:
        if self.engine is not None:
            self.engine.flush()

    @override
    def teardown(self) -> None:
        engine, self.engine = self.engine, None
        self._saver.close()
        if engine is not None:
            export_trace(self.trace_path, engine.trace)  # first: also after a failed step
            close = functools.partial(close_engine, engine, self._created_ssd_dirs)  # files, locks, rank dirs
            self._handback.teardown(self.lightning_module, engine, self.plan,
                                    weights_file_name(self.world_size, self.global_rank), self.progress,
                                    self._saver.preempted, close)
        self.precision_plugin.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def weights_fit_host(self, engine: SnakeEngine | EvalEngine) -> bool:
        """Whether the weights go back in memory after fit (else mapped from a file): ``weights_handback.weights_fit``."""
        return weights_fit(engine.master_bytes(), self.plan.host_budget_bytes, self.plan.host_bytes)

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = args[0] if args else kwargs["batch"]
        check_not_empty(batch, args[1] if len(args) > 1 else kwargs.get("batch_idx"), self.lightning_module)
        self._saver.step_started()  # until optimizer_step: a save asked for now waits for the step's end
        self._step_start_s = time.perf_counter()
        if self.prediction is None:  # no batch at setup (a DataModule): the prediction before step 1 is made now
            with contextlib.suppress(ValueError):
                self.prediction = self._predict(batch, at_setup=True)
        loss = self.engine.train_step(batch)
        if not self._predicted_at_step_one:  # with what the first step measured (kept graphs, checkpoints)
            self._predicted_at_step_one = True
            self.prediction = self._predict(batch)
            self.progress.predictions["step"] = self.prediction.roofline_s  # the ETA of long steps
        self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=self.world_size > 1)  # the global mean
        return loss

    def _predict(self, batch: Any, at_setup: bool = False) -> StepPrediction:
        """The planner's roofline for this run from ``batch``'s shapes (``planning.run_prediction``), before
        step 1 and again after it; the engine runs the rate-dependent settings from the next step on."""
        self.plan = self.predictor.predict(self.plan, self.engine, batch, at_setup)
        self._run_plan()
        return self.predictor.prediction

    def _after_step(self) -> None:
        """The step's time to the predictor, which calibrates and re-plans when it misses (``RunPredictor``)."""
        plan = self.predictor.after_step(self.plan, self.engine, time.perf_counter() - self._step_start_s)
        if plan is self.plan:
            return
        self.plan, self.prediction = plan, plan.prediction
        self.progress.predictions["step"] = self.prediction.roofline_s
        self._run_plan()

    def _run_plan(self) -> None:
        """The engine switches to the plan's rate-dependent settings (the prefetch depth) between steps; a deeper
        prefetch the budget has no room for keeps the current one (``SnakeEngine.use_plan``)."""
        self.plan = dataclasses.replace(self.plan, schedule=self.engine.use_plan(self._rank_plan()).schedule)

    @property
    def model_shape(self) -> ModelShape | None:
        """The planner's view of the model, at the step's shapes (the latest prediction's)."""
        return self.predictor.model_shape if self.predictor is not None else None

    @property
    def hardware_profile(self) -> HardwareProfile | None:
        """The machine's rates of the latest prediction (probed, given, or corrected from measured steps)."""
        return self.predictor.hardware_profile if self.predictor is not None else None

    def _resolve_plan(self, optimizer: Any, clip: tuple[str, float] | None = None) -> None:
        """The planner turns the requested "auto" settings (and ``clip``: alpha, step mode) into concrete ones."""
        storage, schedule = self.requested
        hardware = self.hardware if isinstance(self.hardware, HardwareProfile) else HardwareProfile()
        self.plan = resolve(self.lightning_module, optimizer, storage, schedule, self.precision_plugin.dtypes,
                            self.root_device, hardware, processes_per_node=self.num_processes,
                            optimizer_shards=self.world_size if self.shard_optimizer_state else 1,
                            clip=clip)  # per-rank moments; alpha, step mode
        log.info("planner: %s", self.plan.describe())

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Runs the closure (training_step + the hook chain) through the user's optimizer, which holds no
        # gradients and so changes nothing, then applies the engine's step over the tiers.
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.engine.optimizer_step()
        self._after_step()
        self._saver.step_ended()
        return result

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._saver.run_deferred(self.lightning_module.trainer)  # the previous step is complete and counted
        return super().on_train_batch_start(batch, batch_idx)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._handback.failure = exception  # teardown then leaves a clean module without a multi-GB export
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._saver.on_exception(exception, trainer, training=isinstance(self.engine, SnakeEngine))

    def streamed_forward(self, batch: Any, with_block_outputs: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Outputs of the whole model, blocks streamed from their tiers (used by LayeredModule.forward);
        with ``with_block_outputs``, ``(outputs, block outputs)`` (``LayeredModule.forward_with_block_outputs``)."""
        if self.engine is None:
            raise RuntimeError("streamed_forward needs a set-up strategy (inside Trainer.fit)")
        outputs, block_outputs = self.engine.forward(batch)
        return (outputs, block_outputs) if with_block_outputs else outputs

    # ------------------------------------------------------------------ checkpoints (checkpoint/saver.py)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The non-layer entries only: block weights go to per-unit files in ``save_checkpoint``."""
        if self.engine is None:
            return self.lightning_module.state_dict()
        return checkpoint_saver.nonlayer_state_dict(self.engine, self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return checkpoint_saver.optimizer_hyperparameters(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint_saver.check_save_request(filepath, storage_options, evaluating=isinstance(self.engine, EvalEngine))
        if self.engine is None:  # after fit; as DDPStrategy, one writer
            checkpoint_saver.save_after_fit(checkpoint, filepath,
                                            self.checkpoint_io.save_checkpoint if self.is_global_zero else None)
            return
        hardware = self.hardware_profile  # its probed SSD rate paces the background checksums
        self._saver.save(self.engine, checkpoint, filepath, self.lightning_module.trainer, self.is_global_zero,
                         hardware.ssd_read_gb_per_s if hardware is not None else None)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_saver.remove(filepath, self.checkpoint_io.remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._saver.load(self.engine, checkpoint_path, self._evaluating, self.world_size, self.is_global_zero,
                                self.barrier, self.optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` already streamed every parameter into its tier."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: the Adam moments were restored with the parameters."""

    # ------------------------------------------------------------------ ownership flags
    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Training loads into the tiers built by setup(); evaluation builds its tiers from the checkpoint.
        return not self._evaluating

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls,
                description="GreedySnake: SSD-offloaded training with the vertical (snake) schedule",
            )


