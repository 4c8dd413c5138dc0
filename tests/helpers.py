"""The shared test harness: a very small GPT and a layered stack, fixed data, training with greedysnake and with
plain Lightning (``fit_snake`` / ``fit_lightning``, the GPT runs ``run_snake`` / ``run_reference``, the
checkpoint tests' ``fit_resumable``), the comparisons and their tolerances, and the kill helpers."""
from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.gpt import GPTConfig, GPTModule


class StackModule(snake_strategy.LayeredModule):
    """The contract of docs/guide/model-contract.md in its smallest form: embedding -> ``make_block(i)`` for
    each of ``depth`` blocks -> linear head, cross-entropy over (tokens, next tokens) batches, AdamW."""

    def __init__(self, make_block: Callable[[int], nn.Module], width: int = 16, depth: int = 2, vocab: int = 64,
                 lr: float = 1e-3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(make_block(i) for i in range(depth))
        self.head = nn.Linear(width, vocab)
        self.lr = lr

    def pre_stage(self, batch):
        return self.embed(batch[0])

    def post_stage(self, hidden):
        return self.head(hidden)

    def compute_loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class AlignedStack(snake_strategy.LayeredModule):
    """Units whose sizes are whole pages in fp32 and bf16 (128 x 128 weights, no bias) and whose forward
    part at alpha 0.25 is exactly a quarter: no page rounding between the model and the engine."""

    def __init__(self, width=128, depth=4, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def pre_stage(self, batch):
        return self.embed(batch[0])

    def post_stage(self, hidden):
        return self.head(hidden)

    def compute_loss(self, outputs, batch):
        return F.cross_entropy(outputs.float().flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


SMALL_GPT = GPTConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4, context_len=16, tied_head=True)


def token_data(num_samples: int, seq_len: int = 16, vocab: int = 64, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_samples, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class ParamRecorder(L.Callback):
    """Records the parameters after every optimizer step (or only after the last one).

    Reading greedysnake's parameters flushes its deferred optimizer work, so ``only_last=True`` is how
    a test lets the overlap run undisturbed for all steps but the final one.
    """

    def __init__(self, every_n_batches: int = 1, only_last: bool = False) -> None:
        self.every = every_n_batches
        self.only_last = only_last
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.every:
            return
        if self.only_last and trainer.global_step < trainer.max_steps:
            return
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.states.append(engine.state_dict())
        else:
            self.states.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


# One directory per test process for the trainers' root directories, removed when the process exits: a suite
# run makes over a thousand of them.
_ROOT_DIRS = tempfile.mkdtemp(prefix="snake-test-")
atexit.register(shutil.rmtree, _ROOT_DIRS, True)


def trainer_kwargs(**overrides) -> dict:
    # default_root_dir: a fresh directory, not the working directory: checkpoints of a ModelCheckpoint without
    # dirpath are written there.
    kw = dict(default_root_dir=tempfile.mkdtemp(dir=_ROOT_DIRS), accelerator="cpu", devices=1, logger=False,
              enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              limit_val_batches=0)
    kw.update(overrides)
    return kw


# ------------------------------------------------------------ train with the strategy and with plain Lightning
# The exactness tests' default bounds: float64 differs from plain Lightning only in the summation order of the
# micro-batch gradients; float32 AdamW divides near-zero gradients' rounding noise by eps. A test with another
# bound (a higher learning rate, half precision) passes its own atol, next to the measurement behind it;
# docs/guide/guarantees.md states what users are promised.
TOLERANCES = {"64-true": dict(rtol=0, atol=1e-10), "32-true": dict(rtol=1e-5, atol=1e-5)}


@dataclasses.dataclass
class Fit:
    """One finished ``trainer.fit``: the recorded parameters (see ``record`` of ``fit_snake``), the trainer and
    the module it trained (after fit it holds the trained weights, as under plain Lightning)."""

    states: list[dict[str, torch.Tensor]]
    trainer: L.Trainer
    module: L.LightningModule
    record: str | None = "step"

    @property
    def strategy(self):
        return self.trainer.strategy

    @property
    def last(self) -> dict[str, torch.Tensor]:
        """The parameters after the last step (under ``record="last"`` the one recording)."""
        assert len(self.states) == 1 if self.record == "last" else self.states, len(self.states)
        return self.states[-1]


def token_loader(num_samples: int, batch_size: int, seq_len: int = 16, vocab: int = 64, seed: int = 1234,
                 loader_cls: type = DataLoader) -> DataLoader:
    """``token_data`` in fixed order, ``batch_size`` samples a batch."""
    x, y = token_data(num_samples, seq_len, vocab, seed=seed)
    return loader_cls(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def fit_snake(model, loader, *, steps: int, storage=None, schedule=None, precision: str | None = None,
              callbacks=(), record: str | None = "step", ckpt_dir=None, ckpt_every: int = 3, ckpt_path=None,
              val_loader=None, trainer_extra: dict | None = None, seed: int | None = 0, **strategy_kw) -> Fit:
    """Train ``model`` (a module, or a callable that builds it) with greedysnake, from ``torch.manual_seed(seed)``,
    for ``steps`` optimizer steps (-1: as many as ``trainer_extra``'s ``max_epochs`` give).

    ``record``: "step" keeps the parameters after every optimizer step, "batch" after every loader batch,
    "last" only after the final step (the optimizer overlap runs undisturbed until then), None records
    nothing. ``ckpt_dir``: a ModelCheckpoint there every ``ckpt_every`` steps, all kept (checkpointing is on
    when any callback is a ModelCheckpoint). ``seed`` None: the RNG as the caller left it. ``strategy_kw`` go to
    ``GreedySnakeStrategy`` (hooks, precision_plugin, progress, ...)."""
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule, **strategy_kw)
    return fit_with(strategy, model, loader, steps=steps, precision=precision, accumulate=1, callbacks=callbacks,
                    record=record, ckpt_dir=ckpt_dir, ckpt_every=ckpt_every, ckpt_path=ckpt_path, val_loader=val_loader,
                    trainer_extra=trainer_extra, seed=seed)


def fit_lightning(model, loader, *, steps: int, precision: str | None = None, accumulate: int = 1, callbacks=(),
                  record: str | None = "step", ckpt_dir=None, ckpt_every: int = 3, ckpt_path=None, val_loader=None,
                  trainer_extra: dict | None = None, seed: int | None = 0) -> Fit:
    """The reference: plain Lightning (strategy="auto"), the loader's batches accumulated ``accumulate`` at a
    time into one optimizer step, the module's own optimizer. Arguments as ``fit_snake``'s."""
    return fit_with("auto", model, loader, steps=steps, precision=precision, accumulate=accumulate,
                    callbacks=callbacks, record=record, ckpt_dir=ckpt_dir, ckpt_every=ckpt_every, ckpt_path=ckpt_path,
                    val_loader=val_loader, trainer_extra=trainer_extra, seed=seed)


def fit_with(strategy, model, loader, *, steps: int, precision: str | None = None, accumulate: int = 1, callbacks=(),
             record: str | None = "step", ckpt_dir=None, ckpt_every: int = 3, ckpt_path=None, val_loader=None,
             trainer_extra: dict | None = None, seed: int | None = 0) -> Fit:
    """``trainer.fit`` with a given ``strategy`` (an instance or a registered name): what ``fit_snake`` and
    ``fit_lightning`` run, for tests whose strategy is itself the subject."""
    if seed is not None:  # also for a module the caller built: the seed fixes the run's dropout masks
        torch.manual_seed(seed)
    if not isinstance(model, L.LightningModule):
        model = model()
    assert record in ("step", "batch", "last", None), record
    every = 1 if record == "batch" else accumulate
    recorder = None if record is None else ParamRecorder(every_n_batches=every, only_last=record == "last")
    callbacks = ([recorder] if recorder is not None else []) + list(callbacks)
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=ckpt_every, save_top_k=-1))
    kw = trainer_kwargs(enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    kw.update(trainer_extra or {})
    if precision is not None:
        kw["precision"] = precision
    if accumulate != 1:
        kw["accumulate_grad_batches"] = accumulate
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=callbacks, **kw)
    fit_kw = {} if val_loader is None else {"val_dataloaders": val_loader}
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path, **fit_kw)
    return Fit(recorder.states if recorder is not None else [], trainer, model, record)


def assert_params_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], precision: str,
                        what: str = "", atol: float | None = None) -> None:
    """One state against the reference's, at ``TOLERANCES[precision]`` (``atol``: a test's own bound)."""
    assert got and got.keys() == ref.keys(), (sorted(got), sorted(ref))
    assert precision in TOLERANCES or atol is not None, f"{precision}: the test states its own atol"
    tol = dict(TOLERANCES[precision]) if precision in TOLERANCES else dict(rtol=0)
    if atol is not None:
        tol["atol"] = atol
    for name in got:
        torch.testing.assert_close(got[name], ref[name], **tol, msg=f"{what} {name}".strip())


def assert_steps_close(got: list[dict], ref: list[dict], precision: str, steps: int | None = None,
                       atol: float | None = None) -> None:
    """Every recorded step against the reference's (both recorded the same, non-zero number of steps)."""
    assert got and len(got) == len(ref), (len(got), len(ref))
    if steps is not None:
        assert len(got) == steps, (len(got), steps)
    for step, (a, b) in enumerate(zip(got, ref)):
        assert_params_close(a, b, precision, f"step {step}", atol=atol)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, every tensor bitwise equal (resumed against straight runs)."""
    assert got and got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def run_reference(config: GPTConfig, steps: int, micro: int, micro_size: int, precision: str, lr: float = 1e-3,
                  seed: int = 0, trainer_extra: dict | None = None, module_cls: type = GPTModule, callbacks=(),
                  **module_kw) -> list[dict[str, torch.Tensor]]:
    """Plain Lightning on the GPT: micro-batches from the loader, accumulate_grad_batches=micro, torch.optim.AdamW."""
    loader = token_loader(steps * micro * micro_size, micro_size, config.context_len, config.vocab_size)
    return fit_lightning(lambda: module_cls(config, learning_rate=lr, **module_kw), loader, steps=steps,
                         precision=precision, accumulate=micro, callbacks=callbacks, trainer_extra=trainer_extra,
                         seed=seed).states


def run_snake(config: GPTConfig, steps: int, micro: int, micro_size: int, precision: str, storage=None,
              schedule_kind: str = "vertical", blocks_per_unit: int = 1, lr: float = 1e-3, seed: int = 0,
              schedule_extra: dict | None = None, only_last: bool = False, validate_every_step: bool = False,
              callbacks: list | None = None, trainer_extra: dict | None = None, module_cls: type = GPTModule,
              **module_kw) -> tuple[list[dict[str, torch.Tensor]], snake_strategy.GreedySnakeStrategy]:
    """greedysnake on the GPT with ``run_reference``'s data: one batch of ``micro`` micro-batches a step."""
    loader = token_loader(steps * micro * micro_size, micro * micro_size, config.context_len, config.vocab_size)
    schedule = {"kind": schedule_kind, "num_micro_batches": micro, "blocks_per_unit": blocks_per_unit}
    schedule.update(schedule_extra or {})
    val_loader, extra = None, dict(trainer_extra or {})
    if validate_every_step:
        val_loader = token_loader(micro * micro_size, micro * micro_size, config.context_len, config.vocab_size,
                                  seed=99)
        extra = dict(limit_val_batches=1, val_check_interval=1, **extra)
    run = fit_snake(lambda: module_cls(config, learning_rate=lr, **module_kw), loader, steps=steps, storage=storage,
                    schedule=schedule, precision=precision, callbacks=callbacks or (),
                    record="last" if only_last else "step", val_loader=val_loader, trainer_extra=extra, seed=seed)
    return run.states, run.strategy


# ------------------------------------------------------------------------ checkpoint, resume, compare bitwise
RESUME_MICRO, RESUME_MICRO_SIZE = 4, 2
RESUME_SSD = {"weights": "ssd", "optimizer": "ssd"}
# The lifecycle tests' variant of ``fit_resumable``: 6 steps an epoch (a resume can land mid-epoch), the LR
# schedule over 8 steps (two epochs' worth of changes), the schedule's kind left to the planner.
TWO_EPOCHS = dict(steps_per_epoch=6, lr_steps=8, kind="auto")


class ResumableLoader(DataLoader):
    """Lightning's resumable-dataloader interface (``state_dict`` / ``load_state_dict``): resumes after
    the batches already consumed. With a plain DataLoader Lightning restarts the epoch's data from its
    first batch (it warns "your dataloader is not resumable"), whatever the strategy does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self.yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self._skip = state["yielded"]


def resume_loader(steps_per_epoch: int = 3, loader_cls: type = DataLoader) -> DataLoader:
    """``steps_per_epoch`` optimizer steps an epoch for ``fit_resumable``: a resume at an epoch's end starts
    the next epoch with the same data order, so it is bitwise the straight run (``ResumableLoader``: also
    in the middle of an epoch)."""
    return token_loader(steps_per_epoch * RESUME_MICRO * RESUME_MICRO_SIZE, RESUME_MICRO * RESUME_MICRO_SIZE,
                        SMALL_GPT.context_len, SMALL_GPT.vocab_size, loader_cls=loader_cls)


def fit_resumable(steps: int, ssd_dir=None, *, steps_per_epoch: int = 3, lr_steps: int = 6, kind: str = "vertical",
                  storage: dict | None = None, schedule: dict | None = None, module_cls: type = GPTModule, loader=None,
                  record: str | None = "last", **fit_kw) -> Fit:
    """The checkpoint tests' run: the small GPT at lr 1e-2 (warmup 1 step, cosine over ``lr_steps``), its
    weights and moments in SSD files under ``ssd_dir`` (None: a temporary directory; ``storage`` adds to
    them), 4 micro-batches, alpha 0.25, ``resume_loader(steps_per_epoch)``'s data unless ``loader``;
    ``fit_kw`` as ``fit_snake``'s (ckpt_dir, ckpt_path, callbacks, hooks, ...)."""
    storage = {**({} if ssd_dir is None else {"ssd_dir": str(ssd_dir)}), **RESUME_SSD, **(storage or {})}
    schedule = {"kind": kind, "num_micro_batches": RESUME_MICRO, "alpha": 0.25, **(schedule or {})}
    return fit_snake(lambda: module_cls(SMALL_GPT, learning_rate=1e-2, warmup_steps=1, max_steps=lr_steps),
                     loader if loader is not None else resume_loader(steps_per_epoch), steps=steps, storage=storage,
                     schedule=schedule, record=record, **fit_kw)


# ------------------------------------------------------------------------ fp16 against torch's GradScaler
# Untied head: with the tied head the strategy adds the head's and the embedding's gradient of the tied
# weight in another order than autograd does (one fp32 ulp), the next fp16 cast of the weights
# rounds a few elements the other way, and Adam's normalisation turns those into differences of
# order lr: measured 7e-5 after 2 steps and 6.5e-4 after 4 steps (lr 1e-3), too close to the
# movement (4e-3) for a meaningful element-wise test. Untied, the spread stays at rounding level.
FP16_GPT = dataclasses.replace(SMALL_GPT, tied_head=False)
OVERFLOW_FACTOR = 2.0**20  # loss x 2^20 x scale 2^16: the fp16 backward of the head overflows
# Measured max |snake - reference| over all parameters and steps: 7.0e-10 (no overflow) and 2.3e-10
# (with the skipped step); the weights move 1e-3 per step (4e-3 in total). 1e-8 leaves a 14x margin
# and is 1e5 times smaller than one step's movement.
FP16_ATOL = 1e-8


class ScaledLossGPT(GPTModule):
    """Multiplies the loss by ``loss_factor`` (1.0 except on the step forced to overflow)."""

    loss_factor = 1.0

    def compute_loss(self, outputs, batch):
        return super().compute_loss(outputs, batch) * self.loss_factor


def fp16_scaled_backward(module, scaler, x: torch.Tensor, y: torch.Tensor, step: int, micro: int,
                         micro_size: int) -> None:
    """Plain torch's fp16 recipe for one step's micro-batches: autocast forward, ``scaler.scale(loss / micro)
    .backward()`` (the caller unscales, clips, steps and updates the scaler). Batches are consecutive rows."""
    for m in range(micro):
        lo = (step * micro + m) * micro_size
        batch = (x[lo:lo + micro_size], y[lo:lo + micro_size])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = module.compute_loss(module(batch), batch)
        scaler.scale(loss / micro).backward()


def fp16_clip_reference(x: torch.Tensor, y: torch.Tensor, config: GPTConfig, steps: int, micro: int, micro_size: int,
                        lr: float, algorithm: str | None, value: float, norm_in_float64: bool = False
                        ) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Plain torch: fp16 autocast, GradScaler, ``unscale_``, then the clip (``algorithm`` "norm", "value" or
    None) and the module's own AdamW. Returns the parameters after every step and, under norm clipping,
    each step's pre-clip global norm (``norm_in_float64``: the same clip, its norm summed in float64)."""
    torch.manual_seed(0)
    module = GPTModule(config, learning_rate=lr)
    module.configure_model()
    optimizer = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    params = list(module.parameters())
    states, norms = [], []
    for step in range(steps):
        fp16_scaled_backward(module, scaler, x, y, step, micro, micro_size)
        scaler.unscale_(optimizer)  # clip the true gradients
        if algorithm == "norm" and norm_in_float64:
            grads = [p.grad for p in params if p.grad is not None]
            norm = float(sum(torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads).sqrt())
            for g in grads:
                g.mul_(min(1.0, value / (norm + 1e-6)))
            norms.append(norm)
        elif algorithm == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, value)))
        elif algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, value)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        states.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return states, norms


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


class Killed(BaseException):
    """The process dies here: from now on nothing it would still do reaches the disk."""


class KillAt:
    """Counts the file-system mutations of a save and kills it at the n-th (before it happens)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls, self.dead = n, 0, False

    def __call__(self, fn):
        def mutation(*args, **kwargs):
            if self.dead:
                raise Killed  # a dead process's exception handlers do not clean anything up
            self.calls += 1
            if self.calls == self.n:
                self.dead = True
                raise Killed
            return fn(*args, **kwargs)
        return mutation


def checkpoint_tag(path) -> str:
    """The ``tag`` a kill test put into the checkpoint dict saved at ``path``."""
    return torch.load(path / "meta.pt", weights_only=False)["tag"]
