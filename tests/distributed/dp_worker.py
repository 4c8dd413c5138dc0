"""One training run of the small GPT with strategy="greedysnake", started as a script so that Lightning's
subprocess launcher (devices > 1) or torchrun (``--nnodes``) can start the other ranks.

    python tests/distributed/dp_worker.py CONFIG.json

CONFIG: world (devices per node), nodes, micro (micro-batches per rank), micro_size, steps, precision,
half_weights (False: full-precision weight storage), tied_head, poison ({step, rank}: an inf loss there),
as_ranks (one process ordering the samples so that its micro-batches are those N ranks would see),
record_every (parameters after every step), kind, alpha, storage (a StorageConfig mapping; ssd_dir may be
set), clip (gradient_clip_val, norm),
resume (a checkpoint directory), save_every (ModelCheckpoint every n steps into ckpt_dir), ckpt_dir,
kill_in_save ({rank, save}: that rank exits hard inside its n-th checkpoint save, after its first file),
kill_rank/kill_step (that rank exits hard in that step's optimizer work), moe (tests/moe/models.py's MoE
instead of the GPT: in step 0 only rank 1's samples go to expert 1, in step 1 no sample does, later each
rank's samples go to one expert of its own), out (a directory: each rank writes rank{r}.pt with its final
parameters, step stats and reduction records).
The dataset is ``steps x world x nodes x micro x micro_size`` samples in order: N ranks x M micro-batches
see the same global batches as one rank with N x M micro-batches.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# Started as a script: the repository root (the caller sets PYTHONPATH) holds the tests package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers import SMALL_GPT, ParamRecorder, token_data, trainer_kwargs  # noqa: E402

import snake_strategy  # noqa: E402
from snake_strategy.gpt import GPTModule  # noqa: E402
from snake_strategy.planning.memory_model import ssd_plan  # noqa: E402
from snake_strategy.precision import GreedySnakePrecision  # noqa: E402


class StepStats(L.Callback):
    def __init__(self) -> None:
        self.stats: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        reducer = engine.reducer
        self.stats.append({**engine.last_step.as_dict(),
                           "reductions": [vars(r).copy() for r in reducer.records] if reducer else [],
                           "tasks": [(t.kind, t.unit, tuple(t.micro_batches)) for t in engine.trace.last.tasks],
                           "layout": engine.storage_layout(), "batch_head": batch[0][:, 0].tolist(),
                           "scale": engine.scaler.scale, "step_count": engine.step_count,
                           "ssd_dir": engine.ssd.path if engine.ssd is not None else None,
                           # this rank's planned SSD bytes next to the files it has there
                           "ssd_plan": ssd_plan(engine.memory_inputs(engine.checkpoint_bytes)),
                           "ssd_files": {os.path.relpath(f, engine.ssd.path): size  # fstat: nameless files too
                                         for f, size in engine.ssd.file_sizes().items()}
                           if engine.ssd is not None else {}})


class PoisonedGPT(GPTModule):
    """An inf loss (hence inf gradients) in every micro-batch of one global step, on one rank only; with
    ``odd_factor``, the loss times that factor on odd steps (the gradient norm alternates around a clip)."""

    poison: dict | None = None
    odd_factor: float = 1.0
    optimizer: str | None = None  # a name of tests/exactness/test_any_optimizer.py's OPTIMIZERS; None: AdamW

    def configure_optimizers(self):
        if self.optimizer is None:
            return super().configure_optimizers()
        from tests.exactness.test_any_optimizer import OPTIMIZERS
        return OPTIMIZERS[self.optimizer](self)

    def compute_loss(self, outputs, batch):
        loss = super().compute_loss(outputs, batch)
        if self.trainer.global_step % 2:
            loss = loss * self.odd_factor
        p = self.poison
        if p and self.trainer.global_step == p["step"] and self.trainer.global_rank == p["rank"]:
            loss = loss * float("inf")
        return loss


class KillInStep:
    """EngineHooks.before_optimizer_chunk: exit the process hard in the given step (rank ``rank`` only)."""

    def __init__(self, strategy, step: int) -> None:
        self.strategy, self.step = strategy, step

    def __call__(self, unit: int) -> None:
        engine = self.strategy.engine
        if engine is not None and engine.step_count + 1 >= self.step:
            os._exit(17)


class SaveWatch:
    """A progress listener: the bytes each checkpoint save wrote in this process (its END events), and,
    with ``kill_at`` (the n-th save, 1-based), a hard exit right after that save wrote its first file."""

    def __init__(self, kill_at: int | None) -> None:
        self.saved_bytes: list[int] = []
        self.kill_at, self.saves = kill_at, 0

    def __call__(self, event) -> None:
        if event.phase != "checkpoint_save":
            return
        if event.stage == "start":
            self.saves += 1
        elif event.stage == "end":
            self.saved_bytes.append(event.done_bytes)
        elif self.saves == self.kill_at and event.done >= 1:
            os._exit(17)


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    world, nodes = cfg.get("world", 1), cfg.get("nodes", 1)
    micro, micro_size, steps = cfg["micro"], cfg.get("micro_size", 2), cfg["steps"]
    samples = cfg.get("samples", steps * world * nodes * micro * micro_size)
    x, y = token_data(samples, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    # MoE routes by global sample: sample i is rank i % 2's (the sampler deals them in turn), in step
    # i // (world x micro x micro_size) (one process with as_ranks=2 and twice the micro-batches: the same steps).
    index = torch.arange(samples)
    route = torch.where(index // (world * nodes * micro * micro_size) == 1, 0, index % 2)
    if cfg.get("as_ranks"):  # one process whose micro-batches are those of N ranks (same samples together)
        n, per_rank = cfg["as_ranks"], micro * micro_size // cfg["as_ranks"]
        order = [r + n * j for k in range(samples // (n * per_rank)) for r in range(n)
                 for j in range(k * per_rank, (k + 1) * per_rank)]
        x, y, route = x[order], y[order], route[order]
    # tied_head=False: fp16 runs (a tied weight's two gradients add in another order than one process's)
    module = PoisonedGPT(dataclasses.replace(SMALL_GPT, tied_head=cfg.get("tied_head", True)),
                         learning_rate=cfg.get("lr", 1e-3))
    module.poison = cfg.get("poison")
    module.optimizer = cfg.get("optimizer")
    module.odd_factor = cfg.get("odd_factor", 1.0)
    if cfg.get("moe"):
        from tests.moe.models import MoEStack
        module = MoEStack(width=16, depth=2, vocab=SMALL_GPT.vocab_size, num_experts=2)
    schedule = {"kind": cfg.get("kind", "vertical"), "num_micro_batches": micro, "alpha": cfg.get("alpha", 0.25)}
    hooks = None
    precision = {"precision": cfg.get("precision", "64-true")}
    plugin = None
    if cfg.get("half_weights") is False:  # partitioned state stores full-precision weights
        plugin, precision = GreedySnakePrecision(precision["precision"], half_weights=False), {}
    strategy = snake_strategy.GreedySnakeStrategy(storage=cfg.get("storage"), schedule=schedule,
                                                  shard_optimizer_state=cfg.get("shard", True), precision_plugin=plugin)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    if cfg.get("kill_rank") is not None and rank == cfg["kill_rank"]:
        hooks = snake_strategy.EngineHooks(before_optimizer_chunk=KillInStep(strategy, cfg["kill_step"]))
        strategy.hooks = hooks
    kill_save = cfg.get("kill_in_save")  # {rank, save}: that rank dies inside its n-th checkpoint save
    watch = SaveWatch(kill_save["save"] if kill_save and rank == kill_save["rank"] else None)
    strategy.progress.listeners.append(watch)
    rec, stats = ParamRecorder(only_last=not cfg.get("record_every")), StepStats()
    callbacks = [rec, stats]
    extra = {}
    if cfg.get("val"):  # validate after every step (Lightning inserts a DistributedSampler into this loader)
        extra.update(limit_val_batches=1, val_check_interval=1)
    if cfg.get("save_every"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=cfg["save_every"],
                                                             save_top_k=-1))
        extra["enable_checkpointing"] = True
    trainer = L.Trainer(strategy=strategy, **precision, max_steps=steps,
                        callbacks=callbacks, gradient_clip_val=cfg.get("clip"),
                        **trainer_kwargs(devices=world, num_nodes=nodes, **extra))
    # Lightning's own DistributedSampler would shuffle the training set (seeded), so the global batches
    # would not be the ones one process sees: shard in order, rank r taking samples r, r + N, ...
    data = TensorDataset(x, y, route) if cfg.get("moe") else TensorDataset(x, y)
    sampler = (DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
               if trainer.world_size > 1 else None)
    loader = DataLoader(data, batch_size=micro * micro_size, shuffle=False, sampler=sampler)
    # Seeded right before fit: the weights are initialised in setup, from this stream (a rank > 0 starts
    # from the same seed, Lightning's reset_seed; rank 0's weights are broadcast anyway).
    L.seed_everything(0, verbose=False)
    val = DataLoader(TensorDataset(x[:4 * world * nodes], y[:4 * world * nodes]), batch_size=4) if cfg.get("val") else None
    if cfg.get("validate_only"):  # trainer.validate on the module's own weights, no fit
        trainer.validate(module, DataLoader(TensorDataset(x[:4 * world], y[:4 * world]), batch_size=4))
        return
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val, ckpt_path=cfg.get("resume"))
    out = cfg.get("out")
    if out:
        os.makedirs(out, exist_ok=True)
        torch.save({"state": rec.states[-1] if rec.states else None, "stats": stats.stats, "states": rec.states,
                    "saved_bytes": watch.saved_bytes,
                    "world_size": trainer.world_size, "global_rank": trainer.global_rank,
                    "sampler": type(trainer.train_dataloader.sampler).__name__,
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                    "ssd_dir": getattr(strategy, "_last_ssd_dir", None), "pid": os.getpid()},
                   os.path.join(out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
