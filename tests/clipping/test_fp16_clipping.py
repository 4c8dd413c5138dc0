"""16-mixed with gradient clipping (issue 25, item 15): greedysnake through the Trainer against plain torch
(fp16 autocast + torch.amp.GradScaler + ``scaler.unscale_`` + ``clip_grad_norm_`` / ``clip_grad_value_`` +
AdamW), per step. A black-box comparison: only the Trainer's clip settings and the parameters are read.

Why norm clipping is compared with an adaptive tolerance after step 0: the
clip factor is a rounding-level function of how the global norm is summed. Plain torch given the SAME
clip with its norm summed in float64 (an equally exact computation) moves 4 of the matmul weights'
fp16 copies (what autocast multiplies with) across a rounding boundary at step 0 (3.7e-9 apart), and
from step 1 on drifts from torch's own result by 3.5e-5 .. 4.7e-5 (lr 1e-3), the one-ulp fp16
amplification; greedysnake stays within 2.2e-6 of that float64-norm reference at every step. So after
step 0 the bound is a multiple of torch's distance from itself, measured in the test, with a FLOOR: on
CPUs whose float32 norm lands on the same clip factors as the float64 one (an AMD EPYC) torch's two
results agree bitwise, the measured distance is 0, and yet a third exact summation order (greedysnake's)
may still cross one of those fp16 rounding boundaries. The floor is that one-ulp amplification's size.
The two bugs this guards against are 20-1000x larger: the norm of the loss-scaled gradients (9.9e-4 at
step 0) and the value clamp before unscaling (4.0e-4 at step 0).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import SMALL_GPT, fit_snake, fp16_clip_reference, max_abs_diff, token_data

# Untied head (see tests/clipping/test_fp16_loss_scaling.py: the tied head's gradient sum order is one more fp16-amplified ulp).
GPT = dataclasses.replace(SMALL_GPT, tied_head=False)
STEPS, MICRO, MICRO_SIZE, LR = 4, 4, 2, 1e-3
STEP0_ATOL = 1e-8  # measured: 3.7e-9 (norm), 1.2e-10 (value); one step moves the weights by 1e-3
# One fp16 ulp of a weight copy crossed by one summation order and not by another moves later Adam steps
# by this much (measured 3.5e-5 .. 4.7e-5 at lr 1e-3, Intel Xeon Sapphire Rapids): Adam's step is about
# lr whatever the gradient's size, so a tiny change of a tiny gradient is not damped by its size.
FP16_ULP_DRIFT = 0.05 * LR
CLIPS = {"norm": 0.05, "value": 1e-3}  # both trigger: the global norm is ~1.3, many elements exceed 1e-3


def _reference(x, y, algorithm: str | None, value: float, norm_in_float64: bool = False):
    """Plain torch, the module's own AdamW; the parameters after every step and the pre-clip norms."""
    return fp16_clip_reference(x, y, GPT, STEPS, MICRO, MICRO_SIZE, LR, algorithm, value, norm_in_float64)


def _snake(x, y, algorithm: str, value: float) -> list[dict[str, torch.Tensor]]:
    return fit_snake(lambda: GPTModule(GPT, learning_rate=LR), DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE),
                     steps=STEPS, schedule={"kind": "vertical", "num_micro_batches": MICRO},
                     precision_plugin=GreedySnakePrecision("16-mixed"),
                     trainer_extra={"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}).states


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fp16_clipping_matches_gradscaler_unscale_clip(algorithm):
    value = CLIPS[algorithm]
    x, y = token_data(STEPS * MICRO * MICRO_SIZE, GPT.context_len, GPT.vocab_size)
    ref, norms = _reference(x, y, algorithm, value)
    unclipped, _ = _reference(x, y, None, value)
    got = _snake(x, y, algorithm, value)
    assert len(got) == len(ref) == len(unclipped) == STEPS
    assert max_abs_diff(ref[-1], unclipped[-1]) > 0.5 * LR  # the clip changed training (6.8e-4 at step 0 for
    # norm; 1.5e-8 for value: Adam's first step is about lr x sign(g) whatever the clamp; 2.3e-3 at step 3)
    if algorithm == "norm":
        assert all(n > value for n in norms), norms
    assert max_abs_diff(got[0], ref[0]) < STEP0_ATOL
    if algorithm == "value":  # element-wise: no norm, nothing to amplify
        for step, (a, b) in enumerate(zip(got, ref)):
            assert max_abs_diff(a, b) < STEP0_ATOL, step
        return
    same_clip, _ = _reference(x, y, algorithm, value, norm_in_float64=True)
    for step in range(1, STEPS):
        own_drift = max_abs_diff(same_clip[step], ref[step])  # torch against itself, one summation order apart
        assert own_drift < 1e-3 * LR * 100, (step, own_drift)  # 0 where both orders give the same factors
        bound = 4 * max(own_drift, FP16_ULP_DRIFT) + STEP0_ATOL
        assert max_abs_diff(got[step], ref[step]) <= bound, (step, own_drift)
