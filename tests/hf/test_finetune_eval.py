"""Evaluation and consolidation of fine-tuning checkpoints, which hold the trained parameters only.

The frozen base weights come from a base: the module itself (built with them), the strategy's
``pretrained`` source (an ``HFCausalLM`` built from a directory), or ``--base PATH`` for the CLI. A
different base is refused before any value is used. float64, atol 1e-10 against strategy="auto" on the
trained weights.
"""
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import snake_strategy
from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.checkpoint.consolidate import CheckpointWeights
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, trainer_kwargs

pytest.importorskip("peft")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from snake_strategy.hf import HFCausalLM  # noqa: E402
from tests.hf.finetune_cases import MICRO, MICRO_SIZE, STEPS, build, data, run_snake  # noqa: E402
from tests.hf.models import Samples, batches, hf_model  # noqa: E402


def _fit_with_checkpoint(case, tmp_path, module=None):
    """Fit ``case`` with greedysnake, checkpointing at the last step: (checkpoint dir, trained parameters)."""
    ckpts = tmp_path / "ckpts"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=STEPS)
    states, _, _ = run_snake(case, tmp_path / "ssd", callbacks=[saver], only_last=True,
                             module=module)
    (ckpt,) = ckpts.iterdir()
    return ckpt, states[-1]


def _eval_strategy(tmp_path, name):
    return snake_strategy.GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(tmp_path / f"ssd_{name}")},
                                              schedule={"num_micro_batches": MICRO})


def _evaluate(strategy, module, loader, ckpt_path=None):
    trainer = L.Trainer(strategy=strategy, precision="64-true", **trainer_kwargs(limit_val_batches=None))
    val = trainer.validate(module, loader, ckpt_path=ckpt_path, verbose=False)[0]["val_loss"]
    return val, trainer.predict(module, loader, ckpt_path=ckpt_path)


def _assert_same(got, expected):
    assert got[0] == pytest.approx(expected[0], rel=1e-6, abs=0)  # Lightning's logged float32 mean
    assert len(got[1]) == len(expected[1])
    for a, b in zip(got[1], expected[1]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _plain_gpt_base():
    """The LoRA run's base model as its own state dict file would hold it: no peft names."""
    torch.manual_seed(0)
    module = GPTModule(SMALL_GPT)
    module.configure_model()
    return module.double().state_dict()


def test_lora_checkpoint_evaluates_with_the_module_as_base_and_refuses_another(tmp_path):
    ckpt, trained = _fit_with_checkpoint("lora_gpt", tmp_path)
    loader = DataLoader(data(1), batch_size=MICRO * MICRO_SIZE)
    reference = build("lora_gpt")
    reference.load_state_dict(trained, strict=False)
    expected = _evaluate("auto", reference, loader)

    fresh = build("lora_gpt")  # the same base with untrained adapters: the checkpoint has the trained ones
    strategy = _eval_strategy(tmp_path, "eval")
    _assert_same(_evaluate(strategy, fresh, loader, str(ckpt)), expected)
    assert strategy.eval_traffic["ssd/weights/read"] > 0
    assert not any(k.endswith("/write") for k in strategy.eval_traffic)

    other = build("lora_gpt")
    with torch.no_grad():
        other.blocks[1].mlp_in.weight.add_(1.0)
    with pytest.raises(ValueError, match=r"not the ones it was fine-tuned from.*unit 1 \(blocks\.1\."):
        _evaluate(_eval_strategy(tmp_path, "other"), other, loader, str(ckpt))

    weights = CheckpointWeights(ckpt)
    assert "blocks.0.qkv.base_layer.weight" in weights.frozen_names
    with pytest.raises(ValueError, match="fine-tuning checkpoint.*GreedySnakeStrategy\\(pretrained="):
        weights.with_base(torch.nn.Module())  # a module without the base weights, and no pretrained source
    with pytest.raises(ValueError, match="--base PATH"):
        CheckpointWeights(ckpt).tensor("wte.weight")


def test_consolidation_cli_takes_the_base_weights(tmp_path, capsys):
    ckpt, trained = _fit_with_checkpoint("lora_gpt", tmp_path)
    base = _plain_gpt_base()  # "blocks.0.qkv.weight" where the peft model says "blocks.0.qkv.base_layer.weight"
    torch.save(base, tmp_path / "base.pt")

    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "trained_only.ckpt"), "--quiet"]) == 0
    assert "pass --base PATH" in capsys.readouterr().out
    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "full.ckpt"), "--quiet", "--base",
                                  str(tmp_path / "base.pt")]) == 0
    state = torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"]
    for name, value in trained.items():
        assert torch.equal(state[name], value), name

    base["blocks.2.mlp_out.weight"][0, 0] += 1e-3
    torch.save(base, tmp_path / "other.pt")
    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "bad.ckpt"), "--quiet", "--base",
                                  str(tmp_path / "other.pt")]) == 2
    assert "not the ones it was fine-tuned from" in capsys.readouterr().err
    assert not (tmp_path / "bad.ckpt").exists()


class FrozenLowerLlama(HFCausalLM):
    """Embedding, head and the first decoder layer frozen; built on the meta device under greedysnake."""

    def configure_model(self):
        super().configure_model()
        for name, p in self.named_parameters():
            if name.startswith(("model.embed_tokens.", "model.layers.0.", "lm_head.")):
                p.requires_grad_(False)


def test_hf_checkpoint_takes_its_base_from_the_model_directory(tmp_path, capsys):
    """An HFCausalLM built from a directory under greedysnake: fit, then validate/predict from the checkpoint
    (the base streamed from the directory again) and export it with --format hf --base DIR."""
    hf_model("llama").save_pretrained(tmp_path / "start")
    ckpts = tmp_path / "ckpts"
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"num_micro_batches": 2, "alpha": 0.25})
    trainer = L.Trainer(strategy=strategy, precision="64-true", max_steps=2,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=2)],
                        **trainer_kwargs(enable_checkpointing=True))
    module = FrozenLowerLlama(tmp_path / "start", learning_rate=1e-2)
    trainer.fit(module, DataLoader(Samples(batches(8, 1)), batch_size=4))
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    (ckpt,) = ckpts.iterdir()
    assert snake_checkpoint.read_manifest(ckpt)["frozen_nonlayer"]

    loader = DataLoader(Samples(batches(6, 1, seed=3)), batch_size=4)
    reference = HFCausalLM(tmp_path / "start")
    reference.configure_model()
    reference.load_state_dict(trained)
    expected = _evaluate("auto", reference, loader)
    got = _evaluate(_eval_strategy(tmp_path, "eval"), FrozenLowerLlama(tmp_path / "start"), loader, str(ckpt))
    _assert_same(got, expected)

    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "no_base"), "--format", "hf", "--quiet"]) == 2
    assert "--base PATH" in capsys.readouterr().err
    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "out"), "--format", "hf", "--quiet", "--base",
                                  str(tmp_path / "start")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).state_dict()
    for name, value in trained.items():
        assert torch.equal(back[name], value), name
    loaded = FrozenLowerLlama.load_from_checkpoint(str(ckpt), base=str(tmp_path / "start")).state_dict()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
