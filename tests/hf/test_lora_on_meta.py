"""LoRA on models built on the meta device: the base streamed in unit by unit from ``pretrained`` (or
initialised by the model), the adapters initialised as ``get_peft_model`` does. Training equals plain
Lightning on the same base model built for real with the same initial adapters (float64, atol 1e-10).
"""
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import snake_strategy
from snake_strategy.hf.lora import trained_parameters
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, assert_params_close, fit_lightning, fit_snake, trainer_kwargs

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from snake_strategy.hf import HFCausalLM  # noqa: E402
from tests.hf.models import Samples, batches, hf_model  # noqa: E402

MICRO, MICRO_SIZE, STEPS = 2, 2, 2
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture(autouse=True)
def _fp64_by_default(float64_default):
    """fp64 models (conftest.float64_default)."""


class InitialAdapters(L.Callback):
    """The adapters' values at the start of training, read from the engine's tiers."""

    def on_train_start(self, trainer, pl_module):
        self.values = {n: v.clone() for n, v in trained_parameters(pl_module).items() if "lora_" in n}


def assert_peft_init(values):
    assert values and all(torch.count_nonzero(v) == 0 for n, v in values.items() if "lora_B" in n)
    for name, value in values.items():
        if "lora_A" in name:  # kaiming_uniform_(a=sqrt(5)): bound 1 / sqrt(fan_in)
            assert 0 < value.abs().max() <= 1 / math.sqrt(value.shape[1]), name


def lora_on_meta(module, lora=LORA):
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())  # nothing of the base is in memory
    torch.manual_seed(5)
    peft.get_peft_model(module, peft.LoraConfig(**lora))
    return module


@pytest.mark.parametrize("targets", [LORA["target_modules"], LORA["target_modules"] + ["lm_head"]])
def test_lora_on_meta_hf_model_streams_the_base_from_its_directory(targets, tmp_path):
    """With ``lm_head`` targeted too, its adapters (outside the blocks, absent from the base directory) are
    initialised as peft does."""
    lora = {**LORA, "target_modules": targets}
    hf_model("llama").save_pretrained(tmp_path / "start")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)
    initial = InitialAdapters()
    run = fit_snake(lora_on_meta(HFCausalLM(tmp_path / "start", learning_rate=1e-2), lora),
                    DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE), steps=STEPS, precision="64-true",
                    storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                    schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25}, callbacks=[initial],
                    record="last", seed=None)
    assert run.strategy.pretrained == str(tmp_path / "start")  # handed over by the meta-built module
    assert_peft_init(initial.values)
    assert any(n.startswith("lm_head") for n in initial.values) == ("lm_head" in targets)

    # The reference: the same base built for real, the same initial adapters, plain Lightning.
    reference = HFCausalLM(tmp_path / "start", learning_rate=1e-2)
    reference.configure_model()
    peft.get_peft_model(reference, peft.LoraConfig(**lora))
    reference.load_state_dict(initial.values, strict=False)
    want = fit_lightning(reference, DataLoader(Samples(micro_batches), batch_size=MICRO_SIZE), steps=STEPS,
                         precision="64-true", accumulate=MICRO, record="last", seed=None).last
    got = run.last
    assert_params_close(got, want, "64-true")
    assert any(not torch.equal(got[n], initial.values[n]) for n in initial.values)  # the adapters trained


def test_lora_on_meta_gpt_initialises_base_and_adapters(tmp_path):
    """No pretrained weights: the model's own init for the base, peft's for the adapters (seeded: the
    same numbers in a second run)."""
    runs = []
    for run in range(2):
        torch.manual_seed(0)
        module = GPTModule(SMALL_GPT, learning_rate=1e-2)
        with torch.device("meta"):
            module.configure_model()
        torch.manual_seed(5)
        peft.get_peft_model(module, peft.LoraConfig(r=4, target_modules=["qkv"], lora_dropout=0.0))
        initial = InitialAdapters()
        trainer = L.Trainer(strategy=snake_strategy.GreedySnakeStrategy(
            storage={"weights": "ssd", "ssd_dir": str(tmp_path / f"ssd{run}")}, schedule={"num_micro_batches": 2}),
            precision="64-true", max_steps=1, callbacks=[initial], **trainer_kwargs())
        data = torch.randint(0, SMALL_GPT.vocab_size, (4, SMALL_GPT.context_len + 1), generator=torch.Generator().manual_seed(1))
        trainer.fit(module, DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4))
        assert_peft_init(initial.values)
        runs.append(initial.values)
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_lora_inits_that_need_the_base_are_refused_on_meta():
    from snake_strategy.sources.lora_init import adapter_initializer

    module = lora_on_meta(HFCausalLM(hf_model("llama").config))
    module.peft_config["default"].init_lora_weights = "olora"  # computed from the base weights
    layer = module.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="init_lora_weights='olora'.*build the base model for real"):
        adapter_initializer(module)(layer)


def test_get_peft_model_directly_on_hf_causal_lm(tmp_path):
    """get_peft_model(HFCausalLM(dir), cfg) with no configure_model first: the constructor built the
    structure on meta (no base weight allocated). Under greedysnake it trains exactly as the meta-built
    flow; under plain Lightning configure_model loads the base and initialises the adapters as peft does."""
    hf_model("llama").save_pretrained(tmp_path / "start")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)

    def snake_fit(module):
        initial = InitialAdapters()
        run = fit_snake(module, DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE), steps=STEPS,
                        precision="64-true",
                        storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                        schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25}, callbacks=[initial],
                        record="last", seed=11)
        return initial.values, run.last

    def plain_fit(module):
        initial = InitialAdapters()
        run = fit_lightning(module, DataLoader(Samples(micro_batches), batch_size=MICRO_SIZE), steps=STEPS,
                            precision="64-true", accumulate=MICRO, callbacks=[initial], record="last", seed=None)
        return initial.values, run.last

    direct = HFCausalLM(tmp_path / "start", learning_rate=1e-2)
    assert all(p.is_meta for p in direct.parameters())  # like from_pretrained's structure, nothing allocated
    peft.get_peft_model(direct, peft.LoraConfig(**LORA))
    assert all(p.is_meta for p in direct.parameters())
    initial, got = snake_fit(direct)
    assert_peft_init(initial)
    want_initial, want = snake_fit(lora_on_meta(HFCausalLM(tmp_path / "start", learning_rate=1e-2)))
    assert initial.keys() == want_initial.keys() and all(torch.equal(initial[n], want_initial[n]) for n in initial)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)

    plain = HFCausalLM(tmp_path / "start", learning_rate=1e-2)
    peft.get_peft_model(plain, peft.LoraConfig(**LORA))
    initial, got = plain_fit(plain)
    assert_peft_init(initial)
    reference = HFCausalLM(tmp_path / "start", learning_rate=1e-2)
    reference.configure_model()  # the base built for real and loaded, then the same initial adapters
    peft.get_peft_model(reference, peft.LoraConfig(**LORA))
    reference.load_state_dict(initial, strict=False)
    base = hf_model("llama").state_dict()
    assert all(torch.equal(p, base[n.replace(".base_layer", "")]) for n, p in reference.named_parameters()
               if "lora_" not in n)
    _, want = plain_fit(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_base_derived_lora_init_on_a_meta_model_gets_the_documented_error(init, tmp_path):
    """peft's own get_peft_model raises the ValueError that names the fix (not peft's "variable.set_data ...
    incompatible tensor type", which names neither the init nor the fix); snake_strategy.hf.get_peft_model
    refuses with it before peft touches the model; the same config on the model built for real works."""
    from snake_strategy.hf import get_peft_model

    torch.set_default_dtype(torch.float32)  # PiSSA/OLoRA need float32/16 weights (peft's rule); the fixture restores
    hf_model("llama").float().save_pretrained(tmp_path / "start")
    config = dict(LORA, init_lora_weights=init)
    module = HFCausalLM(tmp_path / "start")
    fix = f"init_lora_weights='{init}'.*module.configure_model\\(\\) first"
    with pytest.raises(ValueError, match=fix):
        peft.get_peft_model(HFCausalLM(tmp_path / "start"), peft.LoraConfig(**config))
    meta_gpt = GPTModule(SMALL_GPT)  # a model of one's own, built on meta
    with torch.device("meta"):
        meta_gpt.configure_model()
    with pytest.raises(ValueError, match=fix):
        peft.get_peft_model(meta_gpt, peft.LoraConfig(r=4, target_modules=["qkv"], init_lora_weights=init))
    with pytest.raises(ValueError, match=fix):
        get_peft_model(module, peft.LoraConfig(**config))
    assert not hasattr(module, "peft_config")  # refused before peft touched the model
    real = HFCausalLM(tmp_path / "start")
    real.configure_model()
    wrapped = get_peft_model(real, peft.LoraConfig(**config))
    assert wrapped.base_model.model is real and not any(p.is_meta for p in real.parameters())


def test_planner_keeps_the_adapter_state_on_the_host_while_the_base_streams():
    """A LoRA shape with a host budget far below its weights: the moments and the trainable part of every
    unit (it leads the unit's flat vector) stay on the host, so a step writes nothing to the SSD and reads
    the frozen base once per fetch; full fine-tuning, even with three times the budget (its working set
    alone is 4.3 GiB), writes its state every step."""
    from snake_strategy.planning.placement import choose_alpha, plan
    from snake_strategy.planning.time_model import HardwareProfile, ModelShape, predict
    from snake_strategy.storage.tiered import tier_bytes

    def planned(shape, budget_bytes):  # the placement and its predicted traffic
        placed = plan(shape, HardwareProfile(), budget_bytes, alpha=choose_alpha(shape))
        return placed, predict(shape, HardwareProfile(), placed.storage, "vertical", placed.alpha)

    units, per_unit, adapter = 16, 60_000_000, 4096 * 16
    lora = ModelShape(num_units=units, params_per_unit=per_unit, nonlayer_params=0, head_params=0,
                      tokens_per_micro=512, num_micro=4, checkpoint_bytes=0, trainable_per_unit=(adapter,) * units,
                      nonlayer_frozen_params=100_000_000)
    full = ModelShape(num_units=units, params_per_unit=per_unit, nonlayer_params=100_000_000, head_params=0,
                      tokens_per_micro=512, num_micro=4, checkpoint_bytes=0)
    budget = 2 * 2**30  # the weights alone are 3.6 GiB
    chosen, prediction = planned(lora, budget)
    storage = chosen.storage
    assert storage.optimizer.host == 1.0 and 0 < storage.weights.host < 1.0
    assert tier_bytes(per_unit, storage.weights, 4, 0, adapter)["ssd"] == 0  # the adapters' master copy
    assert prediction.ssd_write_bytes == 0
    fetches = 2 * units - 1
    assert prediction.ssd_read_bytes == fetches * tier_bytes(per_unit, storage.weights, 4)["ssd"]
    assert planned(full, 3 * budget)[1].ssd_write_bytes > 2**30
