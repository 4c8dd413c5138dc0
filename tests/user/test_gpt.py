"""Tests for the GPT model (snake_strategy.gpt): shapes, parameter accounting, causality, init, training."""
from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.func import functional_call

from snake_strategy.contract import check_contract
from snake_strategy.data import TextDataModule
from snake_strategy.gpt import GPT_PRESETS, Block, GPTConfig, GPTModule, WarmupCosineSchedule, preset

# Smaller than "tiny" so each test builds in milliseconds.
MICRO = dict(vocab_size=256, d_model=32, num_layers=2, num_heads=4, context_len=16, tied_head=True)


def build(config, seed: int = 0, **kwargs) -> GPTModule:
    torch.manual_seed(seed)
    module = GPTModule(config, **kwargs)
    module.configure_model()
    return module


def random_batch(config: GPTConfig, batch: int = 2, time: int | None = None, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    time = config.context_len if time is None else time
    tokens = torch.randint(0, config.vocab_size, (batch, time + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_tiny_param_count_matches_built_module():
    cfg = preset("tiny")
    module = build(cfg)
    assert cfg.num_params() == sum(p.numel() for p in module.parameters())
    check_contract(module)


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_every_preset_count_matches_meta_build(name):
    cfg = preset(name)
    with torch.device("meta"):
        module = GPTModule(cfg)
        module.configure_model()
    assert cfg.num_params() == sum(p.numel() for p in module.parameters())


def test_untied_and_biasless_counts():
    for overrides in ({"tied_head": False}, {"bias": False}, {"mlp_ratio": 2, "tied_head": False}):
        cfg = GPTConfig(**{**MICRO, **overrides})
        assert cfg.num_params() == sum(p.numel() for p in build(cfg).parameters())


def test_preset_sizes_are_as_named():
    assert 1.2e9 < preset("gpt_1b").num_params() < 1.5e9
    assert 3.5e9 < preset("gpt_4b").num_params() < 4.5e9
    assert preset("r1").tied_head is False and preset("r1").vocab_size == 50257


def test_preset_errors_and_copies():
    with pytest.raises(ValueError, match="known presets: .*tiny"):
        preset("huge")
    cfg = preset("tiny")
    cfg.num_layers = 99
    assert GPT_PRESETS["tiny"].num_layers == 4


@pytest.mark.parametrize(
    "overrides, field",
    [({"d_model": 30}, "d_model"), ({"num_layers": 0}, "num_layers"), ({"dropout": 1.5}, "dropout"),
     ({"vocab_size": -1}, "vocab_size"), ({"context_len": 2.5}, "context_len")],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**MICRO, **overrides})


def test_config_from_dict_and_unknown_field():
    assert GPTModule(dict(MICRO)).config == GPTConfig(**MICRO)
    with pytest.raises(ValueError, match="d_modle"):
        GPTModule({**MICRO, "d_modle": 3})


def test_tied_head_shares_storage_and_untied_does_not():
    tied = build(GPTConfig(**MICRO))
    assert tied.lm_head.weight is tied.wte.weight
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    untied = build(GPTConfig(**{**MICRO, "tied_head": False}))
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()


def test_children_registered_in_contract_order():
    module = build(GPTConfig(**MICRO))
    names = [name for name, _ in module.named_children() if name != "val_perplexity"]
    assert names == ["wte", "wpe", "drop", "blocks", "ln_f", "lm_head"]


def test_configure_model_is_idempotent():
    module = build(GPTConfig(**MICRO))
    blocks = module.blocks
    module.configure_model()
    assert module.blocks is blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_shape_dtype_no_buffers_and_functional_call(dtype):
    cfg = GPTConfig(**MICRO)
    torch.manual_seed(0)
    block = Block(cfg).to(dtype)
    assert list(block.buffers()) == []
    hidden = torch.randn(3, 5, cfg.d_model, dtype=dtype)
    out = block(hidden)
    assert out.shape == hidden.shape and out.dtype == dtype
    params = {name: p.detach().clone() for name, p in block.named_parameters()}
    assert torch.equal(functional_call(block, params, (hidden,)), out)


def test_future_tokens_do_not_change_earlier_logits():
    cfg = GPTConfig(**MICRO)
    module = build(cfg).eval()
    inputs, targets = random_batch(cfg, batch=1)
    changed = inputs.clone()
    changed[0, 10] = (changed[0, 10] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = module((inputs, targets)), module((changed, targets))
    assert before.shape == (1, cfg.context_len, cfg.vocab_size)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_too_long_sequence_is_rejected():
    cfg = GPTConfig(**MICRO)
    module = build(cfg)
    with pytest.raises(ValueError, match="context_len"):
        module.pre_stage(random_batch(cfg, time=cfg.context_len + 1))


def test_initial_loss_is_near_uniform_and_residual_init_is_scaled():
    cfg = preset("tiny")
    module = build(cfg)
    inputs, targets = random_batch(cfg, batch=4)
    with torch.no_grad():
        loss = module.compute_loss(module((inputs, targets)), (inputs, targets))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)
    block = module.blocks[0]
    assert block.attn_out.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert block.mlp_out.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert block.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(block.qkv.bias) == 0
    assert torch.equal(module.ln_f.weight, torch.ones(cfg.d_model))


def test_meta_build_draws_no_rng_and_matches_real_build_shapes():
    cfg = GPTConfig(**MICRO)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with torch.device("meta"):
        meta = GPTModule(cfg)
        meta.configure_model()
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.is_meta for p in meta.parameters())
    real_a, real_b = build(cfg, seed=0), build(cfg, seed=0)
    meta_shapes = {n: p.shape for n, p in meta.named_parameters()}
    assert meta_shapes == {n: p.shape for n, p in real_a.named_parameters()}
    for (_, a), (_, b) in zip(real_a.named_parameters(), real_b.named_parameters()):
        assert torch.equal(a, b)


def test_optimizer_groups_deduplicate_tied_weight():
    module = build(GPTConfig(**MICRO), weight_decay=0.2)
    optimizer = module.configure_optimizers()
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(module.parameters()))
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])


def test_optimizer_on_meta_parameters():
    with torch.device("meta"):
        module = GPTModule(GPTConfig(**MICRO))
        module.configure_model()
    assert isinstance(module.configure_optimizers(), torch.optim.AdamW)


def test_warmup_cosine_schedule():
    module = build(GPTConfig(**MICRO), warmup_steps=4, max_steps=14)
    config = module.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"
    schedule = WarmupCosineSchedule(4, 14)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(9) == pytest.approx(0.55)
    assert schedule(14) == pytest.approx(0.1) and schedule(100) == pytest.approx(0.1)
    assert WarmupCosineSchedule(0, None)(50) == 1.0


@pytest.mark.parametrize(
    "kwargs, setting",
    [({"learning_rate": 0}, "learning_rate"), ({"warmup_steps": -1}, "warmup_steps"),
     ({"warmup_steps": 5, "max_steps": 5}, "max_steps"), ({"betas": (0.9, 1.0)}, "betas"),
     ({"eps": 0}, "eps"), ({"weight_decay": -0.1}, "weight_decay")],
)
def test_module_hparam_validation(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        GPTModule(GPTConfig(**MICRO), **kwargs)


def test_flops_per_token_formula():
    cfg = GPTConfig(**MICRO)
    module = GPTModule(cfg)
    n_matmul = cfg.num_layers * cfg.block_params() + cfg.vocab_size * cfg.d_model
    assert module.flops_per_token() == 6 * n_matmul + 12 * cfg.num_layers * cfg.d_model * cfg.context_len
    assert module.flops_per_token(seq_len=8) < module.flops_per_token()


def test_plain_trainer_fit_produces_finite_loss(tmp_path):
    cfg = GPTConfig(**MICRO)
    torch.manual_seed(0)
    model = GPTModule(cfg, learning_rate=1e-3, warmup_steps=1, max_steps=3)
    data = TextDataModule(context_len=cfg.context_len, micro_batch_size=2, num_micro_batches=2, max_bytes=32 * 1024)
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, default_root_dir=tmp_path,
        # Three batches per epoch, so the epoch (and its validation run) ends exactly at max_steps.
        limit_train_batches=3,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train_loss"])
    assert torch.isfinite(metrics["val_loss"]) and torch.isfinite(metrics["val_ppl"])
    # Perplexity is exp(mean token NLL); with one val batch it equals exp(val_loss).
    assert metrics["val_ppl"].item() == pytest.approx(math.exp(metrics["val_loss"].item()), rel=1e-4)
