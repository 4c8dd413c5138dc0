"""snake_strategy.hf: HF causal LMs as layered modules, streamed safetensors in and out.

Every model is a tiny config built here (no download). float64 checks are bitwise or atol 1e-10.
"""
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import snake_strategy  # noqa: E402
from snake_strategy import checkpoint as snake_checkpoint  # noqa: E402
from snake_strategy.hf import HFCausalLM, export_hf  # noqa: E402
from snake_strategy.sources.pretrained import PretrainedSource  # noqa: E402
from snake_strategy.units import build_layouts  # noqa: E402
from tests.helpers import fit_lightning, fit_snake, fit_with, trainer_kwargs  # noqa: E402
from tests.hf.models import FAMILIES, Samples, batches, built, hf_model, tiny_config  # noqa: E402

MICRO, MICRO_SIZE, STEPS = 2, 2, 2


@pytest.fixture(autouse=True)
def _fp64_by_default(float64_default):
    """Every test here builds its models in fp64 (conftest.float64_default)."""


# ---------------------------------------------------------------------- forward
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_names_equal_hf(family):
    hf = hf_model(family)
    module = built(tiny_config(family))
    assert set(module.state_dict()) == set(hf.state_dict())  # the HF names, no key map
    assert list(module.blocks.buffers()) == []  # the engine refuses block buffers
    module.load_state_dict(hf.state_dict())
    batch = batches(1, 3)[0]
    with torch.no_grad():
        expected = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = module(batch)
        assert torch.equal(got, expected)
        unpadded = {"input_ids": batch["input_ids"]}
        torch.testing.assert_close(module(unpadded), hf(input_ids=batch["input_ids"]).logits, rtol=0, atol=1e-10)
        # The loss is HF's causal-LM loss (HF rounds logits to float32 first; float64 here stays float64).
        hf_loss = hf(**batch).loss
        torch.testing.assert_close(module.compute_loss(got, batch).float(), hf_loss, rtol=1e-6, atol=0)


def test_tied_embeddings_stay_tied():
    for family in ("gpt2", "qwen3"):
        module = built(tiny_config(family))
        assert module.lm_head.weight is module.trunk.get_submodule(
            "wte" if family == "gpt2" else "embed_tokens").weight


# ---------------------------------------------------------------------- training
def reference_training(hf, micro_batches, lr):
    """The raw HF model, the same manual accumulation loop as Lightning: each micro-batch mean / M."""
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        for mb in micro_batches[step * MICRO:(step + 1) * MICRO]:
            logits = hf(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(), ignore_index=-100)
            (loss / MICRO).backward()
        opt.step()
    return {n: p.detach() for n, p in hf.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_lightning_accumulation_equals_hf_loop(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "start")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)
    expected = reference_training(hf, micro_batches, lr=1e-2)
    module = HFCausalLM(tmp_path / "start", learning_rate=1e-2, weight_decay=0.01)
    got = fit_lightning(module, DataLoader(Samples(micro_batches), batch_size=MICRO_SIZE, shuffle=False), steps=STEPS,
                        precision="64-true", accumulate=MICRO, record="last").last
    assert got.keys() == expected.keys()
    moved = max((got[n] - hf_model(family).state_dict()[n]).abs().max().item() for n in got)
    assert moved > 1e-3
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)


# ---------------------------------------------------------------------- safetensors in
@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pretrained_source_reads_hf_directory_bitwise(family, shard, tmp_path):
    hf = hf_model(family)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    hf.save_pretrained(tmp_path, **kwargs)
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == (shard is not None)
    module = built(tiny_config(family))
    source = PretrainedSource(str(tmp_path))
    for name, p in module.named_parameters():
        assert torch.equal(source.tensor(name, p.shape), hf.state_dict()[name]), name
    # Unit by unit, as the engine asks: "<blocks prefix>.<block>.<name>".
    module.load_state_dict(hf.state_dict())
    layouts = build_layouts(module.blocks, 2, {id(p): 0 for p in module.parameters()})
    for layout in layouts:
        flat = source.unit_flat(layout, layout.index * 2, "transformer.h" if family == "gpt2" else "model.layers",
                                torch.float64)
        assert torch.equal(flat, layout.flatten(layout.blocks, torch.float64))
    with pytest.raises(ValueError, match="has no entry"):
        source.tensor("model.nothing.weight", torch.Size([1]))
    source.close()


def test_trunk_only_checkpoint_is_found(tmp_path):
    """The original GPT-2 files store 'h.0...' without the 'transformer.' prefix."""
    hf = hf_model("gpt2")
    hf.transformer.save_pretrained(tmp_path)
    source = PretrainedSource(str(tmp_path))
    w = hf.transformer.h[1].mlp.c_fc.weight
    assert torch.equal(source.tensor("transformer.h.1.mlp.c_fc.weight", w.shape), w)


def test_hf_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="neither model.safetensors"):
        PretrainedSource(str(tmp_path))
    hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        PretrainedSource(str(tmp_path))
    with pytest.raises(ValueError, match="never downloads"):
        HFCausalLM("meta-llama/Llama-2-7b-hf")
    with pytest.raises(ValueError, match="not supported"):
        HFCausalLM({"model_type": "bert"})


def test_checkpoint_with_more_layers_than_the_config_is_refused(tmp_path):
    """A config with fewer layers than the checkpoint (transformers lists the rest as UNEXPECTED) is refused
    naming the unexpected keys, under plain strategies and greedysnake, before any unit is built; with
    ignore_unexpected_keys=True the model trains on the layers it has, as plain Lightning does."""
    import shutil

    hf = hf_model("llama")  # 3 layers
    hf.save_pretrained(tmp_path / "start")
    shutil.copytree(tmp_path / "start", tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    (tmp_path / "two" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    loader = DataLoader(Samples(batches(STEPS * MICRO, MICRO_SIZE)), batch_size=MICRO * MICRO_SIZE)
    unexpected = r"has no parameter for: model\.layers\.2\.input_layernorm\.weight, .*ignore_unexpected_keys=True"
    with pytest.raises(ValueError, match=unexpected):
        built(tmp_path / "two")  # plain: the directory's config.json says 2 layers
    two_layers = tiny_config("llama")
    two_layers.num_hidden_layers = 2
    for module in (HFCausalLM(tmp_path / "two"), HFCausalLM(two_layers)):
        strategy = snake_strategy.GreedySnakeStrategy(pretrained=str(tmp_path / "start"),
                                                      storage={"weights": "host"}, schedule={"num_micro_batches": MICRO})
        trainer = L.Trainer(strategy=strategy, precision="64-true", max_steps=1, **trainer_kwargs())
        with pytest.raises(ValueError, match=unexpected):
            trainer.fit(module, loader)
        assert trainer.global_step == 0

    # What from_pretrained itself ignores is not unexpected: per-layer inv_freq of older Llama files, GPT-2's
    # attention-mask buffers.
    from safetensors import safe_open
    from safetensors.torch import save_file

    for family, extra in (("llama", "model.layers.0.self_attn.rotary_emb.inv_freq"), ("gpt2", "transformer.h.0.attn.bias")):
        base = hf_model(family)
        base.save_pretrained(tmp_path / family)
        with safe_open(tmp_path / family / "model.safetensors", "pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        save_file({**state, extra: torch.zeros(4)}, str(tmp_path / family / "model.safetensors"))
        module = built(tmp_path / family)  # no ValueError
        assert all(torch.equal(p, base.state_dict()[n]) for n, p in module.named_parameters())
    kept = HFCausalLM(tmp_path / "two", ignore_unexpected_keys=True)
    kept.configure_model()  # plain: loads the two layers it has
    for name, p in kept.named_parameters():
        assert torch.equal(p, hf.state_dict()[name]), name

    def fit(strategy, batch_size, accumulate):
        return fit_with(strategy, lambda: HFCausalLM(tmp_path / "two", learning_rate=1e-2, ignore_unexpected_keys=True),
                        DataLoader(Samples(batches(STEPS * MICRO, MICRO_SIZE)), batch_size=batch_size), steps=STEPS,
                        precision="64-true", accumulate=accumulate, record="last").last

    expected = fit("auto", MICRO_SIZE, MICRO)
    got = fit(snake_strategy.GreedySnakeStrategy(storage={"weights": "host"},
                                                 schedule={"kind": "vertical", "num_micro_batches": MICRO}),
              MICRO_SIZE * MICRO, 1)
    assert got.keys() == expected.keys() and not any(".layers.2." in n for n in got)
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)


# ---------------------------------------------------------------------- safetensors out
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    module = built(tmp_path / "start")  # loads the sharded directory
    files = export_hf(module, tmp_path / "out", dtype=torch.float64, max_shard_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert back.state_dict().keys() == hf.state_dict().keys()
    for name, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    if family in ("gpt2", "qwen3"):
        assert back.lm_head.weight is back.get_input_embeddings().weight
    batch = batches(1, 2)[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                           hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits)


def test_export_from_state_dict_single_file(tmp_path):
    hf = hf_model("gpt2")
    state = hf.state_dict()  # holds the tied lm_head.weight too: written once
    files = export_hf(state, tmp_path, config=hf.config, dtype=torch.float32)
    assert files == ["model.safetensors"] and not (tmp_path / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.transformer.wte.weight.dtype == torch.float32
    assert torch.equal(back.transformer.wte.weight, state["transformer.wte.weight"].float())
    with pytest.raises(ValueError, match="never written"):
        export_hf({"transformer.wte.weight": state["transformer.wte.weight"]}, tmp_path / "bad", config=hf.config)
    with pytest.raises(ValueError, match="needs config"):
        export_hf(state, tmp_path / "bad2")


# ---------------------------------------------------------------------- generation: tests/hf/test_generation.py


# ---------------------------------------------------------------------- greedysnake
@pytest.mark.skipif(not getattr(snake_strategy, "SUPPORTS_SIDE_INPUTS", False),
                    reason="the engine does not pass side inputs to blocks yet (snake_strategy.SUPPORTS_SIDE_INPUTS)")
@pytest.mark.parametrize("kind", ["vertical", "horizontal", "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedysnake_equals_plain_lightning(family, kind, tmp_path):
    """auto: batched passes (HFCausalLM.independent_samples) and kept forward graphs."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)

    def fit(strategy, batch_size, accumulate):
        return fit_with(strategy, lambda: HFCausalLM(tmp_path / "start", learning_rate=1e-2, weight_decay=0.01),
                        DataLoader(Samples(micro_batches), batch_size=batch_size, shuffle=False), steps=STEPS,
                        precision="64-true", accumulate=accumulate, record="last").last

    expected = fit("auto", MICRO_SIZE, MICRO)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": kind, "num_micro_batches": MICRO, "alpha": 0.25})
    got = fit(strategy, MICRO_SIZE * MICRO, 1)
    if kind == "auto":
        assert strategy.schedule.batched_forward and strategy.schedule.batched_backward
        assert strategy.plan.kept_units == list(range(hf.config.num_hidden_layers - 1 if family != "gpt2"
                                                       else hf.config.n_layer - 1))
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)


# ---------------------------------------------------------------------- Hydra
def test_hydra_model_configs_instantiate(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from snake_strategy.train import CONFIG_DIR
    hf_model("llama").save_pretrained(tmp_path / "local")
    for overrides in (["model=hf_tiny_llama"], ["model=hf_local", f"model.path={tmp_path / 'local'}"]):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides + ["data.context_len=16"])
        module = instantiate(cfg.model, _convert_="all")
        assert isinstance(module, HFCausalLM) and module.hf_config.model_type == "llama"
        module.configure_model()
        assert module({"input_ids": torch.zeros(1, 4, dtype=torch.long)}).shape[-1] == module.hf_config.vocab_size
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):  # the options, without `+`
            cfg = compose("train", overrides=overrides + ["data.context_len=16", "model.ignore_unexpected_keys=true",
                                                          "model.generate_in_predict={max_new_tokens: 3}"])
        module = instantiate(cfg.model, _convert_="all")
        assert module.ignore_unexpected_keys and module.generate_in_predict == {"max_new_tokens": 3}
    with pytest.raises(ValueError, match="exactly one of"):
        HFCausalLM()


def test_hydra_app_trains_hf_tiny_llama(tmp_path):
    """`python -m snake_strategy.train model=hf_tiny_llama`, end to end (the model sets data.context_len)."""
    import math
    import subprocess
    import sys

    out = tmp_path / "run"
    # storage=ssd: the default (auto) keeps a model this small on the host; this run checks the SSD tier
    cmd = [sys.executable, "-m", "snake_strategy.train", "model=hf_tiny_llama", "storage=ssd", "trainer.max_steps=2",
           "data.max_bytes=200000", "data.micro_batch_size=1", "trainer.limit_val_batches=1",
           "trainer.log_every_n_steps=1", f"hydra.run.dir={out}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["choices"]["model"] == "hf_tiny_llama" and report["steps"] == 2
    assert math.isfinite(report["final_train_loss"]) and math.isfinite(report["val_loss"])
    assert report["bytes_per_tier"]["ssd"] > 0
    module = built({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2})
    assert report["num_params"] == sum(p.numel() for p in module.parameters())


def test_checkpoint_cli_exports_hf_directory(tmp_path):
    """Fit with greedysnake + ModelCheckpoint, `python -m snake_strategy.checkpoint DIR OUT --format hf`:
    from_pretrained holds exactly the engine's weights at that step (master values, float64 here)."""
    import subprocess
    import sys

    hf_model("llama").save_pretrained(tmp_path / "start")

    class ExportInsideFit(L.Callback):
        def on_train_end(self, trainer, pl_module):
            assert trainer.strategy.engine is not None  # export_hf reads the units from their tiers
            export_hf(pl_module, tmp_path / "in_run", dtype=torch.float64)

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=STEPS)
    engine_state = fit_snake(HFCausalLM(tmp_path / "start", learning_rate=1e-2),
                             DataLoader(Samples(batches(STEPS * MICRO, MICRO_SIZE)), batch_size=MICRO * MICRO_SIZE),
                             steps=STEPS, precision="64-true",
                             storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                             schedule={"num_micro_batches": MICRO, "alpha": 0.25},
                             callbacks=[checkpoints, ExportInsideFit()], record="last", seed=None).last
    (ckpt,) = (tmp_path / "ckpts").iterdir()

    out = tmp_path / "hf_out"
    cmd = [sys.executable, "-m", "snake_strategy.checkpoint", str(ckpt), str(out), "--format", "hf"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config.json" in proc.stdout
    for exported in (out, tmp_path / "in_run"):
        back = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64)
        assert back.state_dict().keys() == engine_state.keys()
        for name, value in engine_state.items():
            assert torch.equal(back.state_dict()[name], value), (exported, name)
    assert max((engine_state[n] - hf_model("llama").state_dict()[n]).abs().max().item() for n in engine_state) > 1e-3

    # --config names the model explicitly (a HF directory or a config.json); --dtype sets the files' dtype.
    proc = subprocess.run(cmd[:3] + [str(ckpt), str(tmp_path / "f32"), "--format", "hf", "--config",
                                     str(tmp_path / "start" / "config.json"), "--dtype", "float32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    f32 = AutoModelForCausalLM.from_pretrained(tmp_path / "f32")
    assert f32.model.norm.weight.dtype == torch.float32
    assert torch.equal(f32.model.norm.weight, engine_state["model.norm.weight"].float())
    assert snake_checkpoint.main([str(ckpt), str(tmp_path / "from_dir"), "--format", "hf", "--config",
                                  str(tmp_path / "start")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "from_dir").config.num_hidden_layers == 3
    with pytest.raises(SystemExit, match="2"):  # --dtype/--config belong to --format hf
        snake_checkpoint.main([str(ckpt), str(tmp_path / "x.ckpt"), "--dtype", "float32"])


def test_export_defaults_to_the_master_dtype(tmp_path):
    """An fp64 run exported without dtype= (inside fit, after it, from a state dict, from a stream) loads
    back with from_pretrained as the identical fp64 tensors, as the checkpoint CLI's default does."""
    hf_model("llama").save_pretrained(tmp_path / "start")

    class ExportInsideFit(L.Callback):
        def on_train_end(self, trainer, pl_module):
            export_hf(pl_module, tmp_path / "in_run")

    module = HFCausalLM(tmp_path / "start", learning_rate=1e-2)
    trained = fit_snake(module, DataLoader(Samples(batches(STEPS * MICRO, MICRO_SIZE)), batch_size=MICRO * MICRO_SIZE),
                        steps=STEPS, precision="64-true", storage={"weights": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                        schedule={"num_micro_batches": MICRO}, callbacks=[ExportInsideFit()], record="last",
                        seed=None).last
    export_hf(module, tmp_path / "after")
    export_hf(dict(trained), tmp_path / "state", config=module.hf_config)
    export_hf(iter(list(trained.items())), tmp_path / "stream", config=module.hf_config)
    for out in ("in_run", "after", "state", "stream"):
        back = AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype="auto")
        assert back.config.dtype == torch.float64, out
        assert back.state_dict().keys() == trained.keys()
        for name, value in trained.items():
            assert back.state_dict()[name].dtype == torch.float64 and torch.equal(back.state_dict()[name], value), \
                (out, name)
    # fp32 weights stay fp32; dtype= still rounds on request.
    export_hf({k: v.float() for k, v in trained.items()}, tmp_path / "f32", config=module.hf_config)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "f32", dtype="auto").model.norm.weight.dtype == torch.float32
    export_hf(module, tmp_path / "bf16", dtype=torch.bfloat16)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").model.norm.weight.dtype == torch.bfloat16


class GeneratingLM(HFCausalLM):
    def predict_step(self, batch, batch_idx):
        return self.generate(batch["input_ids"][:, :4], max_new_tokens=3)


def test_generate_under_greedysnake_predict(tmp_path):
    """generate() inside predict_step: every token streams the units from the SSD, same tokens as auto."""
    hf_model("llama").save_pretrained(tmp_path / "start")
    loader = DataLoader(Samples(batches(2, 2)), batch_size=4)

    def predict(strategy):
        trainer = L.Trainer(strategy=strategy, precision="64-true", **trainer_kwargs())
        return trainer.predict(GeneratingLM(tmp_path / "start"), loader)[0]

    strategy = snake_strategy.GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                                                  schedule={"num_micro_batches": 2})
    got = predict(strategy)
    assert got.shape == (4, 7) and torch.equal(got, predict("auto"))
    assert strategy.eval_traffic["ssd/weights/read"] > 0
    assert not any(k.endswith("/write") for k in strategy.eval_traffic)


class _HFWithOptimizer(HFCausalLM):
    """HFCausalLM whose configure_optimizers returns tests/exactness/test_any_optimizer.py's optimizer ``name``."""

    optimizer_name = "sgd_nesterov"

    def configure_optimizers(self):
        from tests.exactness.test_any_optimizer import OPTIMIZERS
        return OPTIMIZERS[self.optimizer_name](self)


@pytest.mark.skipif(not getattr(snake_strategy, "SUPPORTS_SIDE_INPUTS", False),
                    reason="the engine does not pass side inputs to blocks yet (snake_strategy.SUPPORTS_SIDE_INPUTS)")
@pytest.mark.parametrize("name", ["sgd_nesterov", "nadam", "adafactor", "muon"])
def test_other_optimizers_on_an_hf_model(name, tmp_path):
    """A pretrained HF Llama under SGD, NAdam, Adafactor and Muon: greedysnake (all on the SSD, alpha split)
    equals plain Lightning with the same optimizer. Muon steps only matrices: the 1-D norms are frozen."""
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)

    def build():
        module = type("M", (_HFWithOptimizer,), {"optimizer_name": name})(tmp_path / "start", learning_rate=1e-2)
        if name == "muon":
            for n, p in module.named_parameters():
                if p.dim() < 2:
                    p.requires_grad_(False)
        return module

    def fit(strategy, batch_size, accumulate):
        return fit_with(strategy, build, DataLoader(Samples(micro_batches), batch_size=batch_size, shuffle=False),
                        steps=STEPS, precision="64-true", accumulate=accumulate, record="last").last

    expected = fit("auto", MICRO_SIZE, MICRO)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.5})
    got = fit(strategy, MICRO_SIZE * MICRO, 1)
    assert got.keys() == expected.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-10, msg=key)
