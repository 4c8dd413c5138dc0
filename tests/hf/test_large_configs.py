"""Llama-2 sized configs from a directory holding config.json alone (no weight is ever read): a 13B full
fine-tune in a 16 GiB container is refused before step 1, by the dry run and by the fit, naming the host budget,
the bytes needed and the items; a 7B one fits because the planner gives up the parked gradients (alpha 0) rather
than refusing, and with 8-bit moments its SSD state is half of fp32 AdamW's."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import snake_strategy  # noqa: E402
from snake_strategy.dry_run import plan_run  # noqa: E402
from snake_strategy.hf import HFCausalLM  # noqa: E402
from snake_strategy.optimizers import FastAdamW8bit  # noqa: E402

GIB = 2**30
# What the default budget is in a 16 GiB memory cgroup (0.9 x the headroom, or 0.6 x MemAvailable on this machine).
BUDGET_16G = 13 * GIB
REPO = Path(__file__).resolve().parents[2]


def llama2_config_dir(root: Path, size: str) -> Path:
    hidden, mlp, layers = {"7b": (4096, 11008, 32), "13b": (5120, 13824, 40)}[size]
    path = root / f"llama2-{size}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=mlp,
        num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, num_hidden_layers=layers,
        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, torch_dtype="bfloat16")))
    return path


class Llama8bit(HFCausalLM):
    def configure_optimizers(self):
        return FastAdamW8bit(self.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)


def _batch():
    return {"input_ids": torch.randint(0, 32000, (4, 64))}


def test_a_13b_full_fine_tune_is_refused_by_the_dry_run_from_config_json(tmp_path):
    start = time.perf_counter()
    strategy = snake_strategy.GreedySnakeStrategy(storage={"host_budget_bytes": BUDGET_16G, "ssd_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"host_budget_bytes=9.75 GiB .* cannot hold the working set of 13.08 GiB .*"
                                         r"nonlayer_params_and_state 5.49"):
        plan_run(HFCausalLM(path=llama2_config_dir(tmp_path, "13b")), strategy, _batch())
    assert time.perf_counter() - start < 60


def test_a_13b_full_fine_tune_is_refused_by_the_fit_before_step_1(tmp_path):
    module = HFCausalLM(path=llama2_config_dir(tmp_path, "13b"))
    strategy = snake_strategy.GreedySnakeStrategy(storage={"host_budget_bytes": BUDGET_16G, "ssd_dir": str(tmp_path)})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in _batch()["input_ids"]], batch_size=4)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"cannot hold the working set of 13.08 GiB"):
        trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 0 and time.perf_counter() - start < 60
    assert list(tmp_path.iterdir()) == [tmp_path / "llama2-13b"]  # no state file was made


def test_a_7b_whose_kept_checkpoint_cannot_fit_is_refused_before_its_weights_are_made(tmp_path, tmpfs):
    """A ModelCheckpoint that could not hold one checkpoint of a 7B run is refused from the plan, before the
    engine makes ~40 GB of state on the SSD (minutes): in seconds, and nothing is left in the SSD directory."""
    ckpts = tmpfs("64k") / "ckpts"
    module = Llama8bit(path=llama2_config_dir(tmp_path, "7b"))
    strategy = snake_strategy.GreedySnakeStrategy(storage={"host_budget_bytes": BUDGET_16G,
                                                           "ssd_dir": str(tmp_path / "ssd")})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpts)], enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in _batch()["input_ids"]], batch_size=4)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(dirpath=.*need up to \d+ bytes \(3\d\.\d GiB"):
        trainer.fit(module, train_dataloaders=loader)
    # 3 s here; making the state first took ~50 s at this disk's ~0.8 GB/s
    assert trainer.global_step == 0 and time.perf_counter() - start < 30
    assert not (tmp_path / "ssd").exists() or not any((tmp_path / "ssd").iterdir())


def test_the_13b_refusal_from_the_command_line(tmp_path):
    path = llama2_config_dir(tmp_path, "13b")
    proc = subprocess.run([sys.executable, "-m", "snake_strategy.plan", "model=hf_local", f"model.path={path}",
                           "data.context_len=64", f"storage.host_budget_bytes={BUDGET_16G}",
                           f"storage.ssd_dir={tmp_path / 'ssd'}", f"hydra.run.dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "fits: NO -- host_budget_bytes=9.75 GiB" in proc.stdout
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["fits"] is False


def test_a_7b_fits_with_alpha_0_and_8bit_moments_halve_its_ssd_state(tmp_path):
    path = llama2_config_dir(tmp_path, "7b")
    strategy = dict(storage={"host_budget_bytes": BUDGET_16G, "ssd_dir": str(tmp_path)})
    fp32 = plan_run(HFCausalLM(path=path), snake_strategy.GreedySnakeStrategy(**strategy), _batch())
    low = plan_run(Llama8bit(path=path), snake_strategy.GreedySnakeStrategy(**strategy), _batch())
    for dry in (fp32, low):
        assert dry.plan.schedule.alpha == 0.0
        assert dry.plan.reasons["alpha"].startswith("0: the gradients parked at alpha 0.244")
        assert dry.host_peak_bytes - dry.plan.process_baseline_bytes <= BUDGET_16G
    params = 6_738_415_616
    # fp32 weights (4 B, the master too) + moments: 8 B for AdamW, 2 + 8 / 256 B for FastAdamW8bit
    assert fp32.ssd_bytes == pytest.approx(12 * params, rel=0.08)
    assert 0.8 * (4 + 2 + 8 / 256) * params < low.ssd_bytes <= (4 + 2 + 8 / 256) * params  # a share on the host
    assert low.ssd_bytes < 0.55 * fp32.ssd_bytes
    text = low.plan.describe()
    found = re.search(r"([0-9.]+) GB less than Adam's moments, its step ([0-9.]+) s per training step", text)
    assert found is not None, text
    assert float(found.group(1)) == pytest.approx(6e-9 * params, rel=0.1)  # 8 - 2.03 B/param, fewer small tensors
    assert "less than Adam's moments" not in fp32.plan.describe()


def test_an_evaluation_whose_weights_exceed_the_budget_gives_them_back_mapped_from_a_file(tmp_path):
    """Evaluating a model larger than the host budget from its HF directory: after predict the module maps the
    weights from a file, as after fit, instead of copying them into memory (Llama-2-7B's 27 GB in a 16 GiB
    container was OOM-killed that way). The values are the directory's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from snake_strategy.engine.state.weights_file import mapped_parameters
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    reference.save_pretrained(tmp_path / "model")
    module = HFCausalLM(tmp_path / "model", generate_in_predict={"max_new_tokens": 2})
    # 16 MiB holds the evaluation's working set (~11 MiB) but not that and the weights' 14 MiB copy together
    strategy = snake_strategy.GreedySnakeStrategy(storage={"host_budget_bytes": 16 * 2**20,
                                                           "ssd_dir": str(tmp_path / "ssd")})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    prompt = {"input_ids": torch.arange(8), "attention_mask": torch.ones(8, dtype=torch.long)}
    prompts = torch.utils.data.DataLoader([prompt], batch_size=1)
    (tokens,) = trainer.predict(module, prompts)
    assert tokens.shape == (1, 10)
    assert strategy.weights_file is not None
    assert set(mapped_parameters(module).values()) == {strategy.weights_file}
    assert set(mapped_parameters(module)) == {n for n, _ in module.named_parameters()}
    expected = reference.state_dict()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)


def test_the_deferred_step_keeps_its_alpha_1_and_is_refused_rather_than_lowered(tmp_path):
    """Norm clipping with speculation off defers each unit's whole update until the global norm is known
    (alpha 1); lowering that alpha to fit would step before the norm exists. So the 7B plan that fits at alpha 0
    is refused here, naming the working set."""
    strategy = snake_strategy.GreedySnakeStrategy(storage={"host_budget_bytes": BUDGET_16G, "ssd_dir": str(tmp_path)},
                                                  schedule={"speculation": "off"})
    with pytest.raises(ValueError, match=r"cannot hold the working set"):
        plan_run(HFCausalLM(path=llama2_config_dir(tmp_path, "7b")), strategy, _batch(), gradient_clip_val=1.0)
