"""``FusedAdamW8bit``: AdamW with 8-bit moments, stepped by torch's fused AdamW kernel (opt-in).

bitsandbytes' own ``AdamW8bit`` steps about 35 M parameters/s on one core of a CPU, too slow to pay for the
SSD bytes its 2-byte state saves (benchmarks/results/optimizer_kernels/). This class keeps the same kind of
state, bitsandbytes' blockwise dynamic 8-bit code (one fp32 scale per 256 values, signed for the first
moment, unsigned for the second), but steps differently: per parameter, it dequantizes both moments into
fp32 (bitsandbytes' kernels), runs ``torch.optim.adam.adam(..., fused=True)`` on them, and quantizes them back.
That is about 60 M parameters/s per core.

Its math is its own, not bitsandbytes' ``AdamW8bit``'s: it rounds the moments at the end of each step
instead of inside the update. greedysnake never substitutes it for the user's class. A user who wants it
returns it from ``configure_optimizers``, and plain Lightning trains it the same way. Tensors under
``min_8bit_size`` elements keep fp32 moments, as bitsandbytes does.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch.optim.adam import adam as functional_adam

BLOCK = 256  # values per fp32 scale: bitsandbytes' optimizer block size


class FusedAdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are stored in 8 bits per value plus a scale per 256.

    State per parameter of ``min_8bit_size`` elements or more: ``exp_avg_codes`` / ``exp_avg_sq_codes``
    (uint8, the parameter's shape), ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per 256 values),
    ``step``: 2.03 bytes per parameter. Smaller ones: fp32 ``exp_avg`` / ``exp_avg_sq``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"FusedAdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("FusedAdamW8bit quantizes with bitsandbytes' kernels: pip install 'snake_strategy[optim8bit]'")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      min_8bit_size=min_8bit_size))

    @staticmethod
    def _codes(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        from bitsandbytes.functional import create_dynamic_map
        return create_dynamic_map(signed=True).to(device), create_dynamic_map(signed=False).to(device)

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                quantized = p.numel() >= group["min_8bit_size"]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    if quantized:
                        blocks = -(-p.numel() // BLOCK)
                        for name in ("exp_avg", "exp_avg_sq"):
                            state[f"{name}_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if quantized:
                    signed, unsigned = self._codes(p.device)
                    moments = [dequantize_blockwise(state[f"{name}_codes"], absmax=state[f"{name}_absmax"], code=code,
                                                    blocksize=BLOCK).to(p.dtype).view(p.shape)
                               for name, code in (("exp_avg", signed), ("exp_avg_sq", unsigned))]
                else:
                    moments = [state["exp_avg"], state["exp_avg_sq"]]
                functional_adam([p], [p.grad], moments[:1], moments[1:], [], [state["step"]], fused=True, amsgrad=False,
                                beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=False, decoupled_weight_decay=True)
                if quantized:
                    for (name, code), value in zip((("exp_avg", signed), ("exp_avg_sq", unsigned)), moments):
                        quantize_blockwise(value.float().reshape(-1), code=code, blocksize=BLOCK,
                                           out=state[f"{name}_codes"].view(-1), absmax=state[f"{name}_absmax"])
        return loss
