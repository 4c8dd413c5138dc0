"""A hand-written mixture-of-experts model, written as MoE code usually is: each block routes every sample
to one expert MLP (the rows of a sample are indexed out, an expert with no rows is not run), the gate's
probability scales the expert's output (so the router trains), and the chosen expert is a side input, so a
test decides which expert sits out which step."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy


class RoutedBlock(nn.Module):
    """``balance``: also return the gate's probabilities (samples x experts) for a load-balancing loss."""

    def __init__(self, width: int, num_experts: int, balance: bool = False) -> None:
        super().__init__()
        self.balance = balance
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(num_experts))

    def forward(self, hidden: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        gate = torch.softmax(self.router(h.mean(1)), dim=-1)  # (samples, experts)
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():  # an expert with no rows is not run: its parameters get no gradient
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows, e, None, None])
        return (hidden + out, gate) if self.balance else hidden + out


class MoEStack(snake_strategy.LayeredModule):
    """embedding -> ``depth`` routed blocks -> head; batches are (tokens, next tokens, expert per sample)."""

    def __init__(self, width: int = 16, depth: int = 3, vocab: int = 32, num_experts: int = 2,
                 optimizer=None, balance: float = 0.0) -> None:
        super().__init__()
        self.width, self.depth, self.vocab, self.num_experts = width, depth, vocab, num_experts
        # A load-balancing loss over every block's gate (the contract's block outputs) when non-zero.
        self.balance = balance
        self.loss_reads_block_outputs = balance != 0.0
        self.make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.embed = nn.Embedding(self.vocab, self.width)
        self.unused = nn.Linear(self.width, self.width)  # a non-layer parameter that never gets a gradient
        self.blocks = nn.ModuleList(RoutedBlock(self.width, self.num_experts, self.balance != 0.0)
                                    for _ in range(self.depth))
        self.head = nn.Linear(self.width, self.vocab)

    def pre_stage(self, batch):
        return self.embed(batch[0]), {"route": batch[2]}

    def post_stage(self, hidden):
        return self.head(hidden)

    def compute_loss(self, outputs, batch, block_outputs=None):
        loss = F.cross_entropy(outputs.flatten(0, 1), batch[1].flatten())
        if self.balance:  # the experts' mean gate probability, squared, summed over experts and blocks
            loss = loss + self.balance * self.num_experts * sum((g.mean(0) ** 2).sum() for g in block_outputs)
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def routed_loader(steps: int, step_samples: int, batch_size: int, sit_out: dict[int, int], num_experts: int = 2,
                  seq_len: int = 8, vocab: int = 32, seed: int = 7) -> DataLoader:
    """``steps`` optimizer steps of ``step_samples`` samples in fixed order, in batches of ``batch_size``; in step
    s every sample goes to an expert other than ``sit_out[s]`` (that expert sits the whole step out), elsewhere
    samples cycle through the experts."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (steps * step_samples, seq_len + 1), generator=g)
    route = torch.arange(steps * step_samples) % num_experts
    for step, expert in sit_out.items():
        rows = slice(step * step_samples, (step + 1) * step_samples)
        route[rows] = torch.where(route[rows] == expert, (expert + 1) % num_experts, route[rows])
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:], route), batch_size=batch_size, shuffle=False)
