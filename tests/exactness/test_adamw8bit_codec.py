"""``FusedAdamW8bit``'s 8-bit state against an independent reference: the quantization maps bitsandbytes' own
8-bit AdamW uses (``name2qmap``: the signed dynamic map for the first moment, the unsigned one for the second)
and bitsandbytes' blockwise functions, on the exact first-step moments ((1-b1) g and (1-b2) g^2, computed here
in float64). A corrupted or swapped code map then fails on its numbers, not by a crash."""
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise  # noqa: E402

from snake_strategy.optimizers import FusedAdamW8bit  # noqa: E402
from snake_strategy.optimizers.adamw8bit import BLOCK  # noqa: E402

BETAS = (0.9, 0.999)


def test_first_step_moments_are_bitsandbytes_blockwise_codes_of_the_exact_moments():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(3 * BLOCK + 17, generator=g) * torch.logspace(-4, 1, 3 * BLOCK + 17)  # many magnitudes
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    optimizer = FusedAdamW8bit([param], lr=1e-3, betas=BETAS, min_8bit_size=BLOCK)
    optimizer.step()
    state = optimizer.state[param]

    maps = bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(1))], lr=1e-3).name2qmap
    exact = {"exp_avg": ((1 - BETAS[0]) * grad.double()).float(),
             "exp_avg_sq": ((1 - BETAS[1]) * grad.double() ** 2).float()}
    for name, code in (("exp_avg", maps["dynamic"]), ("exp_avg_sq", maps["udynamic"])):
        codes, absmax = state[f"{name}_codes"], state[f"{name}_absmax"]
        assert codes.dtype == torch.uint8 and absmax.numel() == -(-grad.numel() // BLOCK)
        reference, quant = quantize_blockwise(exact[name], code=code, blocksize=BLOCK)
        torch.testing.assert_close(absmax, quant.absmax, rtol=1e-6, atol=0, msg=name)
        # The same code for every value, but where the exact moment sits on a rounding boundary between two
        # codes (the class's float32 moment may round the other way): at most one code apart, rarely.
        apart = (codes.int() - reference.int()).abs()
        assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.01, name
        # Dequantized with bitsandbytes' function and its map, within half a code step of the exact moment.
        values = dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=BLOCK)
        steps = (code[1:] - code[:-1]).abs().max()
        bound = absmax.repeat_interleave(BLOCK)[:grad.numel()] * steps
        assert bool(((values - exact[name]).abs() <= bound).all()), name
        assert float((values - exact[name]).abs().max()) > 0  # 8 bits: not the exact moment
