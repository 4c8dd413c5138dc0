"""The optimizer: any ``torch.optim.Optimizer`` from ``configure_optimizers``, its state on the tiers.

``spec``: what the optimizer keeps per parameter and which kind steps it; ``kind``: the protocol of a kind,
one module each (``adam``: torch's fused kernel, the fast path for Adam/AdamW; ``elementwise``; ``per_tensor``);
``probe``: the state a class keeps, found by stepping it; ``stepping``: the user's class stepping tensors with
state read from the tiers;
``adamw8bit``: ``FusedAdamW8bit``, an opt-in AdamW with 8-bit moments that a user may return from
``configure_optimizers`` (needs the ``optim8bit`` extra); ``fast_adamw8bit``: ``FastAdamW8bit``, an opt-in AdamW
with 8-bit moments of its own format whose step is one compiled kernel (no extra needed).
"""
from snake_strategy.optimizers.adam import FUSED_ADAM
from snake_strategy.optimizers.adamw8bit import FusedAdamW8bit
from snake_strategy.optimizers.elementwise import ELEMENTWISE
from snake_strategy.optimizers.fast_adamw8bit import FastAdamW8bit
from snake_strategy.optimizers.kind import StepKind
from snake_strategy.optimizers.per_tensor import PER_TENSOR
from snake_strategy.optimizers.spec import OptimizerSpec, inspect_optimizer, step_kind
from snake_strategy.optimizers.stepping import ShadowOptimizer, hyper_params

__all__ = ["ELEMENTWISE", "FastAdamW8bit", "FusedAdamW8bit", "FUSED_ADAM", "PER_TENSOR", "OptimizerSpec", "ShadowOptimizer", "StepKind",
           "hyper_params", "inspect_optimizer", "step_kind"]
