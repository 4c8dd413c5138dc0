"""The Lightning glue, one class past 500 lines: its hooks (setup, the step, checkpoints) share its state.

``Trainer(strategy="greedysnake")``. What the hooks call lives in after_fit.py, checkpoint/ and
preemption.py.

One Lightning batch is one optimizer step: ``training_step`` splits the global batch into
``schedule.num_micro_batches`` micro-batches and runs the whole schedule through the engine;
``optimizer_step`` then lets Lightning run its hooks and applies the engine's AdamW step. The user's
optimizer only holds hyper-parameters (see ``optim.py``), so LR schedulers keep working.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
import datetime
import os
import logging
from collections.abc import Generator
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning.pytorch.utilities.exceptions import SIGTERMException

from snake_strategy import preemption
from snake_strategy.after_fit import (PreFitWeights, after_failure, after_setup_failure, export_location,
                                      give_back_weights, guard_message, has_weight_guard,
                                      remove_weight_guard, teardown_after_failure, weights_fit)
from snake_strategy.checkpoint import pins as checkpoint_pins, shards as checkpoint_shards, store as checkpoint_store
from snake_strategy.checkpoint.consolidate import CheckpointWeights
from snake_strategy.config import ScheduleConfig, StorageConfig, coerce_config, requested_storage
from snake_strategy.contract import check_contract, check_not_empty, check_outputs_on_meta
from snake_strategy.distributed import DataParallelMixin, build_engine, check_rank_loader, close_engine, rank_storage, sync_initial_state
from snake_strategy.engine import EngineHooks, EngineRuntime, EvalEngine, SnakeEngine
from snake_strategy.engine.state.weights_file import weights_file_name
from snake_strategy.module import LayeredModule
from snake_strategy.planning.autoplan import RunPlan, example_batch, first_prediction, resolve
from snake_strategy.planning.planner import HardwareProfile, StepPrediction
from snake_strategy.precision import GreedySnakePrecision
from snake_strategy.progress import Progress
from snake_strategy.storage.counters import traffic_delta
from snake_strategy.timeline import check_trace_path, export_trace

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
        # As asked ("auto" fields unset); self.storage / self.schedule hold the concrete plan after setup.
        self.requested = (requested_storage(storage),
                          coerce_config(ScheduleConfig, None if schedule == "auto" else schedule, "schedule"))
        self.storage, self.schedule = self.requested
        self.plan: RunPlan | None = None
        if isinstance(hardware, str) and hardware != "probe":
            raise ValueError(f"hardware='{hardware}' is not understood; pass 'probe', a HardwareProfile, a mapping or None")
        self.hardware = hardware if hardware in (None, "probe") else coerce_config(HardwareProfile, hardware, "hardware")
        self.hardware_profile: HardwareProfile | None = None  # resolved at the first step
        # With a probed machine, measure the matmul rate at the model's own shape (0.2 s, first step).
        self.hardware_at_model_shape = hardware == "probe"
        self.pretrained = pretrained  # a state dict / .ckpt file streamed in unit by unit at setup
        self.prediction: StepPrediction | None = None  # the planner's floor for this run's step
        self._predicted_at_step_one = False
        self.engine: SnakeEngine | EvalEngine | None = None
        self.hooks = hooks
        self.eval_traffic: dict[str, int] = {}  # bytes moved by the last validate/test/predict loop, per tier/state/direction
        self._eval_start: dict | None = None
        self._eval_checkpoint: CheckpointWeights | None = None  # ckpt_path of an eval stage
        self._gave_back_weights, self._created_ssd_dirs = False, []  # weights a run gave back; ssd_dir levels several ranks made
        # The safetensors file the module's parameters map after fit; its name is already removed (the file
        # goes away with the process) unless storage.export_dir keeps it.
        self.weights_file: str | None = None
        self._failure: BaseException | None = None  # what stopped the current fit (Lightning's on_exception)
        self._pre_fit: PreFitWeights | None = None  # what the module held before this fit/evaluation
        self.progress = progress if isinstance(progress, Progress) else Progress(log=progress)
        self.trace_path = None if trace_path is None else check_trace_path(trace_path)  # refused now, not at the end
        super().__init__(accelerator=accelerator, cluster_environment=cluster_environment,
                         precision_plugin=precision_plugin)  # parallel_devices: filled by Lightning's connector
        self._init_data_parallel(process_group_backend, timeout)
        self.shard_optimizer_state = shard_optimizer_state
        self._deferred = preemption.DeferredSaves()  # saves a signal handler asked for mid-step
        self._preempted = False  # SIGTERM: the checkpoint is written, teardown exits fast
        self._preemption = preemption.PreemptionSaver()
        self._pinning_saves = 0  # zero-copy saves of this fit (the first one's growth is checked)
        self.last_save: dict[str, Any] = {}  # written_bytes, seconds, methods of the last checkpoint save

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
        self._failure = None  # Lightning's on_exception sets it
        if trainer.state.fn != TrainerFn.FITTING:
            self._setup_eval(trainer)
            return
        remove_weight_guard(module)
        self._pre_fit = PreFitWeights(module)
        try:
            self._setup_fit(trainer, module)
        except BaseException as err:
            after_setup_failure(module, err, self._pre_fit)  # its pre-fit weights, or a guard naming err
            raise
        self._pre_fit.setup_done()  # in-memory pre-fit values are released: the engine holds the weights

    def _setup_fit(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if type(module).training_step is not LayeredModule.training_step and isinstance(module, LayeredModule):
            log.warning("%s overrides training_step, which strategy='greedysnake' does not call: it runs its own "
                        "schedule from pre_stage, blocks, post_stage and compute_loss. Put the loss in "
                        "compute_loss; log from callbacks or validation_step", type(module).__name__)
        if not module.automatic_optimization:
            raise ValueError("strategy='greedysnake' runs the backward itself and needs automatic optimization; "
                             "remove `self.automatic_optimization = False` from the LightningModule")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not used with "
                "strategy='greedysnake': one Lightning batch is one optimizer step, split into "
                "schedule.num_micro_batches micro-batches. Set accumulate_grad_batches=1 and make the "
                "DataLoader batch size the global batch (micro-batch size x num_micro_batches)"
            )
        clip = None
        if trainer.gradient_clip_val:
            algorithm = str(trainer.gradient_clip_algorithm or "norm").lower().split(".")[-1]
            if algorithm not in ("norm", "value"):
                raise ValueError(f"Trainer(gradient_clip_algorithm='{algorithm}') is not supported by "
                                 "strategy='greedysnake'; use 'norm' or 'value'")
            clip = (algorithm, float(trainer.gradient_clip_val))
        self.progress.follow_progress_bar(trainer.progress_bar_callback is not None)
        self.accelerator.setup(trainer)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"strategy='greedysnake' needs exactly one optimizer; configure_optimizers "
                             f"returned {len(self.optimizers)}")
        self._resolve_plan(self.optimizers[0], clip)
        batch = example_batch(trainer)  # map-style loader (nothing iterated): for the check and the floor at setup
        check_outputs_on_meta(module, batch, self.schedule.num_micro_batches)  # before any weight exists
        # Once a run gave its weights back, they are the module's weights: pretrained= was the starting point.
        pretrained = None if self._gave_back_weights else self.pretrained
        runtime = EngineRuntime(self.precision_plugin.dtypes, self.root_device, clip=clip,
                                scaler=self.precision_plugin.make_scaler(), pretrained=pretrained, hooks=self.hooks,
                                progress=self.progress, world_size=self.world_size, rank=self.global_rank,
                                shard_optimizer=self.shard_optimizer_state, trace=self.trace_path is not None)

        def build() -> SnakeEngine:
            return SnakeEngine(module, self.optimizers[0], self._rank_plan(), runtime)

        # Several ranks: every rank's storage is checked first, and a failure on one stops all.
        self.engine, self._created_ssd_dirs = build_engine(build, self.storage, self.global_rank, self.world_size)
        if self.world_size > 1:
            sync_initial_state(self.engine, self.root_device)  # every rank starts from rank 0's weights
        self._predicted_at_step_one = False
        with contextlib.suppress(ValueError):  # a batch the run refuses: that refusal comes with its own check
            self.prediction = self._predict(batch, at_setup=True) if batch is not None else None
        # Lightning's strategies set the device through module.to(); the blocks must not move, so set the
        # attribute LightningModule.device reads, as model_to_device would have.
        module._device = self.root_device
        self.setup_precision_plugin()
        self._preempted, self._pinning_saves = False, 0
        self._deferred = preemption.DeferredSaves()
        # Sweep what killed saves left in the checkpoint directories; check the kept checkpoints fit.
        checkpoint_pins.prepare_checkpoint_dirs(self.engine, trainer.checkpoint_callbacks, self.is_global_zero,
                                                checkpoint_store.sweep_and_log)
        if not any(c is self._preemption for c in trainer.callbacks):
            trainer.callbacks.append(self._preemption)  # saves last.ckpt at the end of a SIGTERMed batch
        self._preemption.saved_step = None

    def _setup_eval(self, trainer: pl.Trainer) -> None:
        """validate/test/predict: a forward-only engine with the compute weights only (no optimizer, no
        moments, no gradients), from ``ckpt_path``, ``pretrained`` or the module's own weights."""
        module = self.lightning_module
        checkpoint, self._eval_checkpoint = self._eval_checkpoint, None
        if has_weight_guard(module) and checkpoint is None:
            # Its blocks are on the meta device: evaluating them would evaluate a fresh random init.
            raise ValueError(f"trainer.{trainer.state.fn.value} has no weights to evaluate ({guard_message(module)}). "
                             "Pass ckpt_path=<a greedysnake checkpoint directory saved during fit>")
        remove_weight_guard(module)
        self.progress.follow_progress_bar(trainer.progress_bar_callback is not None)
        self.accelerator.setup(trainer)
        self._resolve_plan(None)
        source = (checkpoint.with_base(module, self.pretrained) if checkpoint is not None  # fine-tuning: + base
                  else None if self._gave_back_weights else self.pretrained)
        runtime = EngineRuntime(self.precision_plugin.dtypes, self.root_device, hooks=self.hooks, progress=self.progress)
        # The module's own weights, mapped from a file: teardown maps them again instead of copying them back.
        self._pre_fit = PreFitWeights(module).setup_done() if source is None else None
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

    def _begin_eval_traffic(self) -> None:  # around the eval loop: what a forward pass moves, not materialization
        self._eval_start = self.engine.counters.snapshot() if self.engine is not None else None

    def _end_eval_traffic(self) -> None:
        if self.engine is not None and self._eval_start is not None:
            self.eval_traffic = traffic_delta(self._eval_start, self.engine.counters.snapshot())

    @override
    def on_validation_start(self) -> None:
        # Deferred forward-part updates must land before anything reads the weights.
        if self.engine is not None:
            self.engine.flush()
        self._begin_eval_traffic()

    @override
    def on_validation_end(self) -> None:
        self._end_eval_traffic()

    @override
    def on_test_start(self) -> None:
        self._begin_eval_traffic()

    @override
    def on_test_end(self) -> None:
        self._end_eval_traffic()

    @override
    def on_predict_start(self) -> None:
        self._begin_eval_traffic()

    @override
    def on_predict_end(self) -> None:
        self._end_eval_traffic()

    @override
    def on_train_start(self) -> None:
        # The global batch size from the loader: a short last batch is then recognised as such, and a
        # batch size that can never split is refused before step 1.
        loader = self.lightning_module.trainer.train_dataloader
        size = getattr(loader, "batch_size", None)
        if isinstance(size, int) and self.engine is not None:
            if size % self.schedule.num_micro_batches:
                raise ValueError(
                    f"DataLoader batch_size={size} does not split into schedule.num_micro_batches="
                    f"{self.schedule.num_micro_batches} equal micro-batches; make it a multiple of "
                    f"{self.schedule.num_micro_batches} (micro-batch size x num_micro_batches)")
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
        if self._eval_checkpoint is not None:  # a stage that failed between loading and setup
            self._eval_checkpoint.close()
            self._eval_checkpoint = None
        if engine is not None:
            export_trace(self.trace_path, engine.trace)  # first: also after a failed step
            close = functools.partial(close_engine, engine, self._created_ssd_dirs)  # files, locks, rank dirs
            if self._preempted:  # the zero-copy checkpoint holds the weights and the process exits: no export
                close()
            elif self._failure is not None:  # no export; never raises over the original failure
                teardown_after_failure(self.lightning_module, engine, self._failure, self.plan.host_budget_bytes,
                                       self._pre_fit, close)
            else:
                try:
                    engine.flush()
                    checkpoint_pins.CHECKSUMS.wait()  # the pinned files' CRC-32s, read while training ran
                    self._give_back_weights(engine)
                except BaseException as err:  # a failed export: the module is left clean, then err is raised
                    after_failure(self.lightning_module, engine, err, self.plan.host_budget_bytes, self._pre_fit)
                    raise
                finally:
                    close()  # even when the flush failed; re-raises
        self.precision_plugin.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def weights_fit_host(self, engine: SnakeEngine | EvalEngine) -> bool:
        """Whether the weights go back in memory after fit (else mapped from a file): ``after_fit.weights_fit``."""
        return weights_fit(engine.master_bytes(), self.plan.host_budget_bytes, self.plan.host_bytes)

    def _give_back_weights(self, engine: SnakeEngine | EvalEngine) -> None:
        """The module's weights after the engine (after_fit.give_back_weights): in memory, or mapped from a file."""
        module = self.lightning_module
        directory, keep = export_location(self.storage.export_dir, engine, self.storage.ssd_dir)
        self.weights_file = give_back_weights(
            module, engine, self.plan.host_budget_bytes, self.plan.host_budget_source, directory, self._pre_fit,
            weights_file_name(self.world_size, self.global_rank), self.progress, self.plan.host_bytes, keep)
        self._gave_back_weights = not has_weight_guard(module)

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = args[0] if args else kwargs["batch"]
        check_not_empty(batch, args[1] if len(args) > 1 else kwargs.get("batch_idx"), self.lightning_module)
        self._deferred.in_step = True  # until optimizer_step: a save asked for now waits for the step's end
        loss = self.engine.train_step(batch)
        if not self._predicted_at_step_one:  # with what the first step measured (kept graphs, checkpoints)
            self._predicted_at_step_one = True
            self.prediction = self._predict(batch)
            self.progress.predictions["step"] = self.prediction.roofline_s  # the ETA of long steps
        self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=self.world_size > 1)  # the global mean
        return loss

    def _predict(self, batch: Any, at_setup: bool = False) -> StepPrediction:
        """The planner's roofline for this run, from ``batch``'s shapes (at setup, before kept graphs and
        checkpoint sizes are measured; again after the first step)."""
        engine = self.engine
        self.model_shape = engine.model_shape(engine.split(batch)[0][0])
        prediction, self.hardware_profile = first_prediction(
            self.plan, self.model_shape, engine.alpha, self.hardware, self.root_device,
            engine.ssd.path if engine.ssd else None, engine.largest_block_matrix(), self.hardware_at_model_shape)
        if self.plan is not None:
            # "auto" decides the kept graphs at the first step
            kept = self.plan.kept_units if at_setup else sorted(self.engine.runner.kept.units or ())
            self.plan = dataclasses.replace(self.plan, prediction=prediction, kept_units=kept)
        return prediction

    def _resolve_plan(self, optimizer: Any, clip: tuple[str, float] | None = None) -> None:
        """The planner turns the requested "auto" settings (and ``clip``: alpha, step mode) into concrete ones."""
        storage, schedule = self.requested
        hardware = self.hardware if isinstance(self.hardware, HardwareProfile) else HardwareProfile()
        self.plan = resolve(self.lightning_module, optimizer, storage, schedule, self.precision_plugin.dtypes,
                            self.root_device, hardware, processes_per_node=self.num_processes,
                            optimizer_shards=self.world_size if self.shard_optimizer_state else 1,
                            clip=clip)  # per-rank moments; alpha, step mode
        self.storage, self.schedule = self.plan.storage, self.plan.schedule
        log.info("planner: %s", self.plan.describe())

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Runs the closure (training_step + the hook chain) through the user's optimizer, which holds no
        # gradients and so changes nothing, then applies the engine's step over the tiers.
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.engine.optimizer_step()
        self._deferred.in_step = False
        return result

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The previous step is complete and counted: the moment for a save a signal handler asked for.
        if self._deferred.pending:
            self._deferred.run(self.lightning_module.trainer)
        return super().on_train_batch_start(batch, batch_idx)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failure = exception  # teardown then leaves a clean module without a multi-GB export
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if isinstance(exception, SIGTERMException) and isinstance(self.engine, SnakeEngine) and trainer is not None:
            self._deferred.pending = []  # the preemption save covers them
            if self._preemption.saved_step != trainer.global_step:  # the signal came after the batch's end
                preemption.save_on_preemption(trainer)
            self._preempted = True

    def streamed_forward(self, batch: Any) -> Tensor:
        """Outputs of the whole model, blocks streamed from their tiers (used by LayeredModule.forward)."""
        if self.engine is None:
            raise RuntimeError("streamed_forward needs a set-up strategy (inside Trainer.fit)")
        return self.engine.forward(batch)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The non-layer entries only: block weights go to per-unit files in ``save_checkpoint``, streamed
        from their tiers (never the whole model in memory). ``snake_strategy.checkpoint.consolidate``
        makes one ordinary file."""
        if self.engine is None:
            return self.lightning_module.state_dict()
        self.engine.flush()
        block_keys = {f"{self.engine.blocks_prefix}.{k}" for k in self.lightning_module.blocks.state_dict()}
        # Frozen parameters are the base model's: checkpoints record their checksums, not a copy.
        frozen = {k for k, v in self.lightning_module.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.nn.Parameter) and not v.requires_grad}
        return {k: v for k, v in self.lightning_module.state_dict().items() if k not in block_keys | frozen}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # The Adam moments live in the engine's tiers and are saved per unit by save_checkpoint; the
        # optimizer itself only holds hyper-parameters, which an LR scheduler may have changed.
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise ValueError("strategy='greedysnake' writes checkpoint directories itself; storage_options is not supported")
        if isinstance(self.engine, EvalEngine):
            raise ValueError(f"cannot save {filepath} during trainer.validate/test/predict with strategy='greedysnake': "
                             "the evaluation engine holds the weights only (no optimizer state). Save during fit "
                             "(ModelCheckpoint), or after it")
        if self.engine is None:
            # After fit: the module holds the trained weights (teardown gave them back), the optimizer
            # state is gone with the run. An ordinary Lightning file, loadable by load_from_checkpoint.
            log.warning("saving %s after fit: the trained weights are in it, the Adam moments are not (they end "
                        "with the run); to resume training exactly, checkpoint during fit (ModelCheckpoint)", filepath)
            if self.is_global_zero:  # as DDPStrategy: one writer
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            return
        if self._deferred.in_step:
            # A signal handler's save (Lightning's SLURM requeue) in the middle of a step: at its end.
            log.warning("a checkpoint to %s was asked for in the middle of a step; it is written when the step "
                        "completes", filepath)
            self._deferred.pending.append(str(filepath))
            return
        shards = self.engine.partition is not None  # every rank writes its shard, rank 0 the manifest last
        if not shards and self.is_global_zero:
            # Before the first byte: the growth this save's pinned versions may cause (the first one of the
            # fit; each one when every checkpoint is kept), and what it writes.
            keep_all = any(getattr(c, "save_top_k", 1) < 0 for c in self.lightning_module.trainer.checkpoint_callbacks)
            if self._pinning_saves == 0 or keep_all:
                checkpoint_pins.check_space(self.engine, os.path.dirname(os.path.abspath(filepath)), 1,
                                            f"saving {filepath}")
            self._pinning_saves += 1
        if shards:  # every rank writes its shard, rank 0 the manifest last
            checkpoint_shards.save(self.engine, checkpoint, filepath, self.progress)
        elif self.is_global_zero:  # one writer, as DDPStrategy (replicated state); Lightning barriers after
            rate = checkpoint_pins.checksum_read_rate(self.hardware_profile and self.hardware_profile.ssd_read_gb_per_s)
            self.last_save = checkpoint_store.save(self.engine, checkpoint, filepath, self.progress, zero_copy=True,
                                                   checksum_read_bytes_per_s=rate)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Top-k rotation: a directory checkpoint is renamed aside, then unlinked (checkpoint/store.py: release)."""
        if self.is_global_zero:
            if os.path.isdir(filepath):
                checkpoint_store.release(filepath)
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if os.path.isfile(checkpoint_path):
            raise ValueError(
                f"{checkpoint_path} is not a greedysnake checkpoint directory; to start from the weights of an "
                "ordinary state dict or .ckpt file, pass GreedySnakeStrategy(pretrained=path) instead of ckpt_path"
            )
        if self._evaluating:
            # Evaluation restores before setup (restore_checkpoint_after_setup): the engine is then built
            # straight from the checkpoint's master weights, with no init and nothing written twice.
            self._eval_checkpoint = CheckpointWeights(checkpoint_path)
            return self._eval_checkpoint.meta()
        if self.world_size > 1:  # rank 0 alone adopts a checkpoint a killed save left aside, then all read
            if self.is_global_zero:
                checkpoint_store.recover(checkpoint_path)
            self.barrier("greedysnake.load_checkpoint")
        checkpoint = checkpoint_store.load(self.engine, checkpoint_path, self.progress,
                                               recover=self.world_size == 1)
        # Lightning restores the LR schedulers, but the current lr lives in the optimizer's param_groups.
        for optimizer, saved in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            for group, saved_group in zip(optimizer.param_groups, saved.get("param_groups", [])):
                group.update(saved_group)
        return checkpoint

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


