"""Mixture-of-experts HF families (Mixtral, Qwen3-MoE, OLMoE) through ``HFCausalLM``: the same logits as the
HF model, greedysnake training equal to the raw HF model trained by hand (float64, atol 1e-10), LoRA on an
MoE, and the router's load-balancing loss refused before any work rather than dropped.

A layer's experts are 3-D parameters (``mlp.experts.gate_up_proj``: experts x rows x columns) that every
step's backward fills, zero for an expert no token chose, as in plain PyTorch: nothing sits out here (the
hand-written MoE tests in tests/moe/ cover experts as separate modules, which do).
"""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import snake_strategy  # noqa: E402
from snake_strategy.hf import HFCausalLM  # noqa: E402
from snake_strategy.sources.pretrained import PretrainedSource  # noqa: E402
from tests.helpers import fit_lightning, fit_with  # noqa: E402
from tests.hf.models import MOE_FAMILIES, Samples, batches, hf_model, tiny_config  # noqa: E402
from tests.hf.test_hf_models import MICRO, MICRO_SIZE, STEPS, reference_training  # noqa: E402


@pytest.fixture(autouse=True)
def _fp64_by_default(float64_default):
    """float64 models (conftest.float64_default)."""


def moe_module(source, **kw) -> HFCausalLM:
    return HFCausalLM(source, learning_rate=1e-2, weight_decay=0.01, experts_implementation="eager", **kw)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_equal_hf_bitwise(family):
    hf = hf_model(family)
    module = moe_module(tiny_config(family))
    module.configure_model()
    assert set(module.state_dict()) == set(hf.state_dict())
    assert any(p.dim() == 3 for p in module.blocks.parameters())  # stacked experts
    module.load_state_dict(hf.state_dict())
    batch = batches(1, 3)[0]
    with torch.no_grad():
        assert torch.equal(module(batch), hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits)


@pytest.mark.parametrize("kind", ["vertical", "auto"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedysnake_equals_the_hf_model_trained_by_hand(family, kind, tmp_path):
    """The reference is the HF model itself (its forward, cross entropy, AdamW, micro-batch means / M); auto
    batches the micro-batches and keeps forward graphs."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)
    expected = reference_training(hf, micro_batches, lr=1e-2)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": kind, "num_micro_batches": MICRO, "alpha": 0.25})
    got = fit_with(strategy, lambda: moe_module(tmp_path / "start"),
                   DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE, shuffle=False), steps=STEPS,
                   precision="64-true", record="last").last
    assert got.keys() == expected.keys()
    start = hf_model(family).state_dict()
    assert min((got[n] - start[n]).abs().max().item() for n in got if "experts" in n) > 1e-3  # the experts trained
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)


def test_default_experts_kernel_trains_as_plain_lightning(tmp_path):
    """transformers' default experts kernel (grouped matmuls where they dispatch), float32: greedysnake runs
    the kernel plain Lightning runs, to float32 rounding."""
    torch.set_default_dtype(torch.float32)
    hf_model("mixtral").float().save_pretrained(tmp_path / "start")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)

    def build():
        return HFCausalLM(tmp_path / "start", learning_rate=1e-2)

    expected = fit_lightning(build, DataLoader(Samples(micro_batches), batch_size=MICRO_SIZE), steps=STEPS,
                             precision="32-true", accumulate=MICRO, record="last").last
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "host", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": "vertical", "num_micro_batches": MICRO})
    got = fit_with(strategy, build, DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE), steps=STEPS,
                   precision="32-true", record="last").last
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_lora_on_an_moe_model(tmp_path):
    """peft LoRA on Mixtral's attention with the router trained too, the experts frozen and streamed from the
    directory: equal to plain Lightning on the same base built for real with the same initial adapters."""
    peft = pytest.importorskip("peft")
    from tests.hf.test_lora_on_meta import InitialAdapters

    hf_model("mixtral").save_pretrained(tmp_path / "start")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    def adapted(module):
        peft.get_peft_model(module, peft.LoraConfig(**lora))
        for name, p in module.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.requires_grad_(True)  # the router trains with the adapters
        return module

    initial = InitialAdapters()
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25})
    got = fit_with(strategy, adapted(moe_module(tmp_path / "start")),
                   DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE), steps=STEPS,
                   precision="64-true", record="last", callbacks=[initial]).last
    reference = moe_module(tmp_path / "start")
    reference.configure_model()  # the base built for real, converted from the per-expert files
    adapted(reference).load_state_dict(initial.values, strict=False)
    want = fit_lightning(reference, DataLoader(Samples(micro_batches), batch_size=MICRO_SIZE), steps=STEPS,
                         precision="64-true", accumulate=MICRO, record="last").last
    assert got.keys() == want.keys()
    base = hf_model("mixtral").state_dict()
    assert any("lora_B" in n for n in got)
    assert all(torch.equal(got[n], base[n.replace(".base_layer", "")]) for n in got if "experts" in n)  # frozen
    trained = [n for n in got if n.endswith("mlp.gate.weight")]
    assert trained and all(not torch.equal(got[n], base[n]) for n in trained)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=name)


def test_per_expert_files_load_into_stacked_experts(tmp_path):
    """``save_pretrained`` writes one matrix per expert (the Hub's layout); the stacked 3-D parameters read
    back bitwise through transformers' conversion mapping, under plain strategies as under greedysnake's
    streaming source; an extra expert in the files is refused by name."""
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    keys = {k for f in (tmp_path / "start").glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys  # per expert on file
    module = moe_module(tmp_path / "start")
    module.configure_model()
    assert all(torch.equal(module.state_dict()[n], v) for n, v in hf.state_dict().items())
    fewer = tiny_config("mixtral")
    fewer.num_local_experts = 3
    source = PretrainedSource(tmp_path / "start", HFCausalLM(fewer, experts_implementation="eager"))
    try:
        with pytest.raises(ValueError, match="gate_up_proj' has shape \\(4, 128, 32\\), the model expects \\(3, 128, 32\\)"):
            source.tensor("model.layers.0.mlp.experts.gate_up_proj", torch.Size([3, 128, 32]))
    finally:
        source.close()


def test_router_load_balancing_loss_is_refused_before_any_work():
    config = tiny_config("mixtral")
    config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True and router_aux_loss_coef=0.001"):
        HFCausalLM(config)
    config.router_aux_loss_coef = 0.0  # HF adds nothing: the cross entropy alone, accepted
    HFCausalLM(config)
    with pytest.raises(ValueError, match="experts_implementation='fused'"):
        HFCausalLM(tiny_config("olmoe"), experts_implementation="fused")
