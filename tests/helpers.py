"""Shared test fixtures: a very small GPT, fixed data, and runners for the reference and greedysnake."""
from __future__ import annotations

import tempfile
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
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


def trainer_kwargs(**overrides) -> dict:
    # default_root_dir: a fresh directory, not the working directory: checkpoints of a ModelCheckpoint without
    # dirpath are written there.
    kw = dict(default_root_dir=tempfile.mkdtemp(prefix="snake-test-"), accelerator="cpu", devices=1, logger=False,
              enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              limit_val_batches=0)
    kw.update(overrides)
    return kw


def run_reference(config: GPTConfig, steps: int, micro: int, micro_size: int, precision: str, lr: float = 1e-3,
                  seed: int = 0, trainer_extra: dict | None = None, module_cls: type = GPTModule, **module_kw) -> list[dict[str, torch.Tensor]]:
    """Plain Lightning: micro-batches from the loader, accumulate_grad_batches=micro, torch.optim.AdamW."""
    x, y = token_data(steps * micro * micro_size, config.context_len, config.vocab_size)
    loader = DataLoader(TensorDataset(x, y), batch_size=micro_size, shuffle=False)
    torch.manual_seed(seed)
    module = module_cls(config, learning_rate=lr, **module_kw)
    rec = ParamRecorder(every_n_batches=micro)
    trainer = L.Trainer(strategy="auto", precision=precision, max_steps=steps, accumulate_grad_batches=micro,
                        callbacks=[rec], **trainer_kwargs(**(trainer_extra or {})))
    trainer.fit(module, train_dataloaders=loader)
    return rec.states


def run_snake(config: GPTConfig, steps: int, micro: int, micro_size: int, precision: str, storage=None,
              schedule_kind: str = "vertical", blocks_per_unit: int = 1, lr: float = 1e-3, seed: int = 0,
              schedule_extra: dict | None = None, only_last: bool = False, validate_every_step: bool = False,
              callbacks: list | None = None, trainer_extra: dict | None = None, module_cls: type = GPTModule,
              **module_kw) -> tuple[list[dict[str, torch.Tensor]], snake_strategy.GreedySnakeStrategy]:
    x, y = token_data(steps * micro * micro_size, config.context_len, config.vocab_size)
    loader = DataLoader(TensorDataset(x, y), batch_size=micro * micro_size, shuffle=False)
    torch.manual_seed(seed)
    module = module_cls(config, learning_rate=lr, **module_kw)
    schedule = {"kind": schedule_kind, "num_micro_batches": micro, "blocks_per_unit": blocks_per_unit}
    schedule.update(schedule_extra or {})
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule)
    rec = ParamRecorder(only_last=only_last)
    extra = {}
    if validate_every_step:
        vx, vy = token_data(micro * micro_size, config.context_len, config.vocab_size, seed=99)
        extra = dict(val_dataloaders=DataLoader(TensorDataset(vx, vy), batch_size=micro * micro_size))
    kw = trainer_kwargs(**(dict(limit_val_batches=1, val_check_interval=1) if validate_every_step else {}),
                        **(trainer_extra or {}))
    trainer = L.Trainer(strategy=strategy, precision=precision, max_steps=steps,
                        callbacks=[rec] + list(callbacks or []), **kw)
    trainer.fit(module, train_dataloaders=loader, **extra)
    return rec.states, strategy


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
