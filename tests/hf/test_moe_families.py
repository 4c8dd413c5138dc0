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


def with_router_loss(family: str, seed: int = 0):
    """The raw HF model of ``family`` whose loss adds the router's load-balancing loss (a large coefficient,
    so the router's gradient from it is far above the tolerance)."""
    hf = hf_model(family, seed)
    hf.config.output_router_logits = True
    hf.config.router_aux_loss_coef = 0.5
    hf.router_aux_loss_coef = 0.5  # the causal LM read it at construction
    return hf


def reference_with_router_loss(hf, micro_batches, lr):
    """The HF model trained by hand: its loss (cross entropy + coefficient x its own aux_loss) / M per micro-batch."""
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        for mb in micro_batches[step * MICRO:(step + 1) * MICRO]:
            out = hf(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
            ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten())
            ((ce + hf.router_aux_loss_coef * out.aux_loss) / MICRO).backward()
        opt.step()
    return {n: p.detach() for n, p in hf.named_parameters()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_loss_adds_hf_router_loss(family):
    hf = with_router_loss(family)
    module = moe_module(hf.config)
    module.configure_model()
    module.load_state_dict(hf.state_dict())
    assert module.loss_reads_block_outputs
    batch = batches(1, 3)[0]
    with torch.no_grad():
        out = hf(**{k: batch[k] for k in ("input_ids", "attention_mask")})
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        assert out.aux_loss > 0.5  # ~1 at a uniform router: far from negligible
        torch.testing.assert_close(module.batch_loss(batch), ce + 0.5 * out.aux_loss, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family,kind", [("mixtral", "vertical"), ("mixtral", "horizontal"), ("mixtral", "auto"),
                                         ("mixtral", "split"), ("qwen3_moe", "vertical"), ("olmoe", "auto")])
def test_router_loss_trains_as_the_hf_model(family, kind, tmp_path):
    """The router's gradient from the load-balancing loss reaches every layer's router through the strategy's
    recompute, in the vertical, horizontal, auto (batched passes, kept graphs) and split-backward schedules;
    the alpha split steps half of each unit a step late."""
    hf = with_router_loss(family)
    hf.save_pretrained(tmp_path / "start", max_shard_size="20KB")
    micro_batches = batches(STEPS * MICRO, MICRO_SIZE)
    expected = reference_with_router_loss(hf, micro_batches, lr=1e-2)
    without = reference_training(hf_model(family), micro_batches, lr=1e-2)
    router = "model.layers.0.mlp.gate.weight"
    assert (expected[router] - without[router]).abs().max() > 1e-4  # the balancing loss moved the router
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "ssd_dir": str(tmp_path / "ssd")},
        schedule={"kind": "vertical" if kind == "split" else kind, "num_micro_batches": MICRO, "alpha": 0.5,
                  **({"split_backward": True} if kind == "split" else {})})
    got = fit_with(strategy, lambda: moe_module(tmp_path / "start"),
                   DataLoader(Samples(micro_batches), batch_size=MICRO * MICRO_SIZE, shuffle=False), steps=STEPS,
                   precision="64-true", record="last").last
    if kind == "auto":  # the backward of the lower layers starts from their kept forward graphs
        assert strategy.plan.kept_units and strategy.schedule.batched_forward
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)


def test_validation_loss_with_the_router_loss(tmp_path):
    """``val_loss`` under greedysnake (blocks streamed, router logits collected per micro-batch) equals plain
    Lightning's, which runs the whole batch at once."""
    import lightning as L

    hf = with_router_loss("mixtral")
    hf.save_pretrained(tmp_path / "start")
    data = batches(2, 4)

    def validate(strategy):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, precision="64-true",
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=str(tmp_path))
        return trainer.validate(moe_module(tmp_path / "start"), DataLoader(Samples(data), batch_size=4))[0]["val_loss"]

    expected = validate("auto")
    got = validate(snake_strategy.GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                                                      schedule={"num_micro_batches": 2}))
    assert abs(got - expected) < 1e-10


def test_router_settings_checked():
    config = tiny_config("mixtral")
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.0  # HF adds nothing: no block outputs
    assert not HFCausalLM(config).loss_reads_block_outputs
    with pytest.raises(ValueError, match="experts_implementation='fused'"):
        HFCausalLM(tiny_config("olmoe"), experts_implementation="fused")
