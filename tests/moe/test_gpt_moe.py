"""The built-in GPT's mixture-of-experts blocks (``GPTConfig.num_experts``; the ``gpt_1b_moe`` preset at scale):
top-k routing per token to experts that are separate modules, so an expert no token chose sits the step out.
Exact against plain Lightning (float64, atol 1e-10) with experts sitting out, and sized as the config says."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from snake_strategy.gpt import GPTConfig, GPTModule, preset
from tests.helpers import assert_steps_close, fit_lightning, fit_snake, token_data

CONFIG = GPTConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, context_len=8, num_experts=8,
                   experts_per_token=1)
STEPS, MICRO, MICRO_SIZE, SEQ = 4, 2, 1, 4  # 8 tokens a step for 8 experts: some sit every step out


def _loader(batch_size):
    return DataLoader(TensorDataset(*token_data(STEPS * MICRO * MICRO_SIZE, seq_len=SEQ, vocab=64)),
                      batch_size=batch_size, shuffle=False)


@pytest.mark.parametrize("schedule", [{"kind": "vertical", "alpha": 0.5}, {"kind": "auto"}], ids=["vertical", "auto"])
def test_gpt_moe_equals_plain_lightning_with_experts_sitting_out(schedule, tmp_path):
    ref = fit_lightning(lambda: GPTModule(CONFIG, learning_rate=1e-2), _loader(MICRO_SIZE), steps=STEPS,
                        accumulate=MICRO, precision="64-true").states
    idle = [name for name in ref[0] if ".experts." in name and torch.equal(ref[0][name], ref[1][name])]
    assert idle, "some expert sat step 1 out"
    got = fit_snake(lambda: GPTModule(CONFIG, learning_rate=1e-2), _loader(MICRO * MICRO_SIZE), steps=STEPS,
                    precision="64-true", storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path)},
                    schedule={"num_micro_batches": MICRO, **schedule}).states
    assert_steps_close(got, ref, "64-true", steps=STEPS)


def test_moe_config_sizes_and_errors():
    module = GPTModule(CONFIG)
    module.configure_model()
    assert sum(p.numel() for p in module.parameters()) == CONFIG.num_params()
    big = preset("gpt_1b_moe")
    assert 1.0e9 < big.num_params() < 1.2e9 and big.num_experts == 8 and big.experts_per_token == 2
    # FLOPs count the active experts only: two of eight.
    dense_share = big.block_params(active=True) / big.block_params()
    assert 0.3 < dense_share < 0.45
    with pytest.raises(ValueError, match="experts_per_token must be an integer in \\[1, num_experts=4\\]"):
        GPTConfig(num_experts=4, experts_per_token=5)
    with pytest.raises(ValueError, match="num_experts must be 0"):
        GPTConfig(num_experts=-1)
