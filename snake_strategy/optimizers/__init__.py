"""The optimizer: any ``torch.optim.Optimizer`` from ``configure_optimizers``, its state on the tiers.

``spec``: what the optimizer keeps per parameter and how it is stepped; ``stepping``: the user's class
stepping tensors with state read from the tiers; ``adam``: torch's fused kernel, the fast path for Adam/AdamW;
``adamw8bit``: ``FusedAdamW8bit``, an opt-in AdamW with 8-bit moments that a user may return from
``configure_optimizers`` (needs the ``optim8bit`` extra).
"""
from snake_strategy.optimizers.adamw8bit import FusedAdamW8bit
from snake_strategy.optimizers.spec import (ELEMENTWISE, FUSED_ADAM, PER_TENSOR, OptimizerSpec, inspect_optimizer,
                                            optimizer_kind)
from snake_strategy.optimizers.stepping import ShadowOptimizer, hyper_params

__all__ = ["ELEMENTWISE", "FusedAdamW8bit", "FUSED_ADAM", "PER_TENSOR", "OptimizerSpec", "ShadowOptimizer", "hyper_params",
           "inspect_optimizer", "optimizer_kind"]
