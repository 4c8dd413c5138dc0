"""Model and optimizer variants docs/guide/model-contract.md promises, each against plain Lightning (fp64, atol 1e-10),
and the RNG replay of dropout masks during the recompute."""
import dataclasses
import logging

import pytest
import torch
from torch import nn

import snake_strategy
from snake_strategy.gpt import GPTModule
from tests.helpers import (SMALL_GPT, StackModule, assert_steps_close, fit_lightning, fit_snake, run_reference,
                           run_snake, token_loader)

STEPS, MICRO, MICRO_SIZE, LR = 3, 4, 2, 1e-2


class AdamCoupledGPT(GPTModule):
    """torch.optim.Adam: weight decay is added to the gradient (coupled, L2), not applied to the weights."""

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.Adam(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=self.hparams.learning_rate, betas=(0.9, 0.95), fused=fused or None)


VARIANTS = {
    "adam_coupled_weight_decay": (SMALL_GPT, AdamCoupledGPT),
    "untied_head": (dataclasses.replace(SMALL_GPT, tied_head=False), GPTModule),
    "no_bias": (dataclasses.replace(SMALL_GPT, bias=False), GPTModule),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_plain_lightning(tmp_path, variant):
    config, module_cls = VARIANTS[variant]
    ref = run_reference(config, STEPS, MICRO, MICRO_SIZE, "64-true", lr=LR, module_cls=module_cls)
    got, _ = run_snake(config, STEPS, MICRO, MICRO_SIZE, "64-true", lr=LR, module_cls=module_cls,
                       storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path)},
                       schedule_extra={"alpha": 0.25})
    assert_steps_close(got, ref, "64-true", steps=STEPS)
    moved = max((got[-1][k] - got[0][k]).abs().max().item() for k in got[0])
    assert moved > 1e-3
    names = set(got[0])
    if variant == "untied_head":
        assert "lm_head.weight" in names and "wte.weight" in names
    if variant == "no_bias":
        assert not any(n.endswith(".bias") for n in names), sorted(names)


class TorchEncoderStack(StackModule):
    """torch's own ``nn.TransformerEncoderLayer`` as the blocks, built in ``configure_model`` (on the meta device
    under greedysnake, in memory under plain Lightning): its ``nn.MultiheadAttention`` initialises through
    ``_reset_parameters``, not ``reset_parameters``."""

    def __init__(self, width: int = 32, depth: int = 3, vocab: int = 64) -> None:
        snake_strategy.LayeredModule.__init__(self)
        self.width, self.depth, self.vocab, self.lr = width, depth, vocab, LR

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.embed = nn.Embedding(self.vocab, self.width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(self.width, 4, 2 * self.width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(self.depth))
        self.head = nn.Linear(self.width, self.vocab)


def test_torch_transformer_layers_built_on_meta_initialise_and_train_as_in_memory(tmp_path):
    loader = token_loader(STEPS * MICRO * MICRO_SIZE, MICRO_SIZE)
    ref = fit_lightning(TorchEncoderStack, loader, steps=STEPS, precision="64-true", accumulate=MICRO, record="step")
    got = fit_snake(TorchEncoderStack, token_loader(STEPS * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE), steps=STEPS,
                    precision="64-true", storage={"ssd_dir": str(tmp_path)}, schedule={"num_micro_batches": MICRO})
    assert_steps_close(got.states, ref.states, "64-true", steps=STEPS)


# ------------------------------------------------------------------------------------------ dropout
MASKS: list[tuple[str, bytes, bool, torch.Tensor]] = []  # (site, input key, grad enabled, keep mask)


def _record(site: str, key: torch.Tensor, out: torch.Tensor) -> None:
    MASKS.append((site, key.detach().double().numpy().tobytes(), torch.is_grad_enabled(), (out != 0).clone()))


class MaskLoggingBlock(nn.Module):
    def __init__(self, index: int, width: int, p: float) -> None:
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.drop(torch.tanh(self.linear(self.norm(x))) + 1.5)  # + 1.5: no exact zeros before dropout
        if self.training:  # the schedule's calls (eval-mode ones, the setup's timing and checks, draw no mask)
            _record(f"block{self.index}", x, h)
        return x + h


class DropoutStack(StackModule):
    """Dropout in the embedding stage and in every block, each call's mask recorded with its input."""

    def __init__(self, vocab=64, width=32, depth=4, p=0.3):
        super().__init__(lambda i: MaskLoggingBlock(i, width, p), width, depth, vocab)
        self.drop = nn.Dropout(p)

    def pre_stage(self, batch):
        e = self.embed(batch[0]) + 1.5
        h = self.drop(e)
        if self.training:
            _record("embed", batch[0], h)
        return h


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_recompute_replays_the_forward_dropout_masks(kind):
    """Every recomputed forward (and the embedding's re-run for its backward) draws exactly the
    dropout masks its original forward drew, micro-batch by micro-batch."""
    depth = 4
    MASKS.clear()
    try:
        fit_snake(lambda: DropoutStack(depth=depth), token_loader(2 * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE), steps=2,
                  schedule={"kind": kind, "num_micro_batches": MICRO}, record=None)
        records = list(MASKS)
    finally:
        MASKS.clear()
    calls: dict[tuple[str, bytes], list[tuple[bool, torch.Tensor]]] = {}
    for site, key, grad, mask in records:
        calls.setdefault((site, key), []).append((grad, mask))
    # 2 steps x 4 micro-batches, each seen by the embedding and every block.
    assert {site for site, _ in calls} == {"embed"} | {f"block{i}" for i in range(depth)}
    assert len(calls) == 2 * MICRO * (depth + 1), len(calls)
    for (site, _), seen in calls.items():
        if site == f"block{depth - 1}":
            # The last unit's backward is fused with its forward: one call, with grad, no recompute.
            assert [g for g, _ in seen] == [True], site
            continue
        # A no-grad forward, then the recompute (or the embedding's backward re-run) with grad.
        assert [g for g, _ in seen] == [False, True], (site, [g for g, _ in seen])
        forward, again = seen[0][1], seen[1][1]
        assert torch.equal(forward, again), f"{site}: the recompute drew another dropout mask"
    masks = [seen[0][1] for seen in calls.values()]
    dropped = torch.cat([m.flatten() for m in masks]).float().mean().item()
    assert 0.2 < 1 - dropped < 0.4  # dropout really ran (p = 0.3) ...
    assert len({m.numpy().tobytes() for m in masks}) == len(masks)  # ... with a fresh mask for every call


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_run_whose_blocks_draw_random_numbers_says_once_that_its_masks_are_not_plain_lightnings(p, caplog):
    """Dropout masks are drawn in the schedule's order (unit by unit), not plain Lightning's (micro-batch by
    micro-batch): such a run says so once, naming the unit; a run without dropout says nothing."""
    with caplog.at_level(logging.WARNING, logger="snake_strategy"):
        fit_snake(lambda: DropoutStack(depth=4, p=p), token_loader(2 * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE),
                  steps=2, schedule={"num_micro_batches": MICRO}, record=None)
    MASKS.clear()
    said = [r.getMessage() for r in caplog.records if "draw random numbers (dropout)" in r.getMessage()]
    assert len(said) == (1 if p else 0), said
    if p:
        assert said[0].startswith("the blocks of unit 0 draw") and "only with dropout off" in said[0]
