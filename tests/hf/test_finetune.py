"""Fine-tuning: frozen parameters anywhere, LoRA through peft, base weights that are only ever read.

Reference: plain Lightning + the same frozen model + accumulate_grad_batches=M + torch.optim.AdamW.
float64 atol 1e-10. Every model is built for real before fit (as a fine-tuning run loads its base
model), frozen, then handed to the trainer; the reference gets an identical copy.
"""
from collections import Counter

import lightning as L
import pytest
import torch

import snake_strategy
from snake_strategy.storage.aligned import round_up
from tests.helpers import SMALL_GPT, assert_steps_close

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from snake_strategy.hf import save_adapter  # noqa: E402
from snake_strategy.hf import HFCausalLM  # noqa: E402
from tests.hf.finetune_cases import CASES, LLAMA, LORA_LLAMA, MICRO, build, reference, run_snake  # noqa: E402


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("case", CASES)
def test_matches_plain_lightning_with_the_same_frozen_model(case, kind, tmp_path):
    ref = reference(case)
    got, strategy, _ = run_snake(case, tmp_path / "ssd", kind)
    assert_steps_close(got, ref, "64-true")
    first = build(case)
    frozen = [n for n, p in first.named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(got[-1][n], dict(first.named_parameters())[n].detach()) for n in frozen)
    moved = [n for n, p in first.named_parameters() if p.requires_grad and not torch.equal(got[-1][n], p.detach())]
    assert moved  # the trainable ones really train


def test_norm_clipping_with_lora(tmp_path):
    ref = reference("lora_gpt", clip=0.05)
    got, strategy, _ = run_snake("lora_gpt", tmp_path / "ssd", clip=0.05)
    assert_steps_close(got, ref, "64-true")


@pytest.mark.parametrize("case", ["lora_gpt", "lower_half"])
def test_frozen_elements_get_no_optimizer_state_and_no_files(case, tmp_path):
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            seen["layout"] = engine.storage_layout()
            seen["files"] = engine.ssd_files()
            seen["frozen_names"] = [name for u in range(engine.num_units)
                                    for name, *_ in engine.unit_slots(u, trainable=False)]

    run_snake(case, tmp_path / "ssd", steps=1, callbacks=[Look()])
    for unit in seen["layout"]:
        assert unit["train_end"] < unit["numel"] or case == "lower_half"
        assert unit["exp_avg_ssd"] == round_up(unit["train_end"] * 8)  # moments: the trainable part only
    if case == "lower_half":
        assert [u["train_end"] for u in seen["layout"]][:2] == [0, 0]
        assert not [f for f in seen["files"] if "unit00000" in f and "weights" not in f]  # weights only
    assert "blocks.0.ln_1.weight" in seen["frozen_names"] or "blocks.0.qkv.base_layer.weight" in seen["frozen_names"]


def _window(module, case, tmp_path, storage):
    """Counters of one steady-state step (step 2 to step 3) and the strategy."""
    snapshots = []

    class Window(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            snapshots.append(trainer.strategy.engine.counters.snapshot())

        def on_train_batch_end(self, trainer, *args):
            snapshots.append(list(trainer.strategy.engine.trace.last.tasks))

    _, strategy, _ = run_snake(case, tmp_path / "ssd", precision="32-true", storage=storage, callbacks=[Window()],
                               only_last=True, module=module)
    before, tasks, after = snapshots[4], snapshots[5], snapshots[6]
    delta = Counter({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
    return delta, tasks, strategy


SSD_ALL = {"weights": "ssd", "optimizer": "ssd", "gradients": "ssd", "checkpoints": "ssd", "checkpoint_host_ends": 0}


def test_lora_traffic_reads_the_base_once_per_pass_and_writes_only_the_adapter(tmp_path):
    module = build("lora_gpt", torch.float32)
    delta, tasks, strategy = _window(module, "lora_gpt", tmp_path, SSD_ALL)
    shape = strategy.model_shape
    L_units, n = shape.num_units, shape.params_per_unit
    trained = shape.trainable_per_unit
    assert all(0 < t < n for t in trained) and shape.first_backward_unit == 0
    ckpt = MICRO * L_units * shape.checkpoint_bytes
    writes = sum(v for (tier, _, d), v in delta.items() if tier == "ssd" and d == "write")
    adapter_state = sum(t * 4 * 3 for t in trained) + sum(round_up(4 * t) for t in trained)  # master, 2 moments, grads
    assert writes <= adapter_state + ckpt, (writes, adapter_state, ckpt)
    # The compute weights are the master copy in fp32: the only weight bytes written are the adapters'.
    assert delta[("ssd", "weights", "write")] == sum(4 * t for t in trained)
    # Base weights read: one vertical pass (2N - 1 fetches), plus the optimizer's read of the adapter part.
    fetches = 2 * L_units - 1
    assert delta[("ssd", "weights", "read")] == fetches * round_up(4 * n) + sum(4 * t for t in trained)
    assert strategy.prediction.ssd_read_bytes == sum(v for (t, _, d), v in delta.items() if t == "ssd" and d == "read")
    assert strategy.prediction.ssd_write_bytes == writes


def test_full_finetuning_writes_far_more_than_lora(tmp_path):
    lora, _, _ = _window(build("lora_gpt", torch.float32), "lora_gpt", tmp_path / "a", SSD_ALL)
    full, _, _ = _window(build("part_of_block", torch.float32), "part_of_block", tmp_path / "b", SSD_ALL)

    def state_writes(delta):
        return sum(v for (tier, state, d), v in delta.items() if tier == "ssd" and d == "write" and state != "checkpoints")

    # At this toy size a LoRA unit's trainable part is one padded page of 4096 elements against ~12600
    # for the whole block; at the io_bound shape the ratio is ~1/3000 (docs/design.md).
    assert state_writes(lora) * 2 < state_writes(full), (state_writes(lora), state_writes(full))


def test_units_below_the_first_trainable_one_get_no_backward(tmp_path):
    delta, tasks, strategy = _window(build("lower_half", torch.float32), "lower_half", tmp_path, SSD_ALL)
    backward_units = sorted({t.unit for t in tasks if t.kind == "bwd"})
    assert backward_units == [2, 3]
    shape = strategy.model_shape
    assert shape.first_backward_unit == 2
    fetches = 2 * shape.num_units - 1 - 2  # N forward fetches + N - 2 backward: 5 instead of 7
    n, trained = shape.params_per_unit, shape.trainable_per_unit
    # + the optimizer's page-rounded reads of the trainable units' master (= compute) copy: forward and
    # backward part, each rounded up
    optimizer = sum(round_up(4 * 4096) + round_up(4 * (t - 4096)) for t in trained if t)
    assert delta[("ssd", "weights", "read")] == fetches * round_up(4 * n) + optimizer
    assert strategy.prediction.ssd_read_bytes == sum(v for (t, _, d), v in delta.items() if t == "ssd" and d == "read")
    assert strategy.prediction.ssd_write_bytes == sum(v for (t, _, d), v in delta.items() if t == "ssd" and d == "write")


def test_memory_plans_count_only_what_exists():
    from snake_strategy.config import StorageConfig
    from snake_strategy.planning.memory_model import MemoryInputs, host_plan, ssd_plan

    storage = StorageConfig(ssd_dir="/tmp/x", weights="ssd", optimizer="ssd", gradients="ssd")
    full = MemoryInputs(unit_params=(40960,) * 4, nonlayer_params=1000, compute_bytes=4, master_bytes=4,
                        device_is_cpu=True, storage=storage, alpha=0.25)
    lora = MemoryInputs(unit_params=(40960,) * 4, nonlayer_params=0, compute_bytes=4, master_bytes=4,
                        device_is_cpu=True, storage=storage, alpha=0.25, unit_trainable=(4096,) * 4,
                        nonlayer_frozen=1000)
    assert ssd_plan(lora)["weights"] == ssd_plan(full)["weights"]
    assert ssd_plan(lora)["optimizer_moments"] == ssd_plan(full)["optimizer_moments"] // 10
    assert host_plan(lora)["nonlayer_params_and_state"] == 1000 * 4
    assert host_plan(lora)["gradient_buffers"] == host_plan(full)["gradient_buffers"] // 10


def test_lora_resume_is_bitwise_and_needs_the_same_base(tmp_path):
    # Epochs of 2 steps: the run resumed after step 2 starts a fresh epoch with the same data order.
    straight, _, _ = run_snake("lora_gpt", tmp_path / "a", precision="32-true", steps=4, only_last=True, epoch_steps=2)
    ckpts = tmp_path / "ckpts"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=2, save_top_k=-1)
    run_snake("lora_gpt", tmp_path / "b", precision="32-true", steps=2, callbacks=[saver],
              epoch_steps=2)
    path = ckpts / "epoch=0-step=2.ckpt"
    units = sorted(p.name for p in (path / "units").iterdir())
    manifest = snake_strategy.checkpoint.read_manifest(path)
    # The checkpoint holds the adapters' state, not the base weights: each unit file is its trainable part.
    assert all(u["numel"] == 4096 for u in manifest["units"]) and len(units) == 3 * SMALL_GPT.num_layers
    assert all(u["frozen"]["names"] for u in manifest["units"]) and manifest["frozen_nonlayer"]
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert not [k for k in meta["state_dict"] if k.startswith(("wte", "wpe", "lm_head"))]
    resumed, _, _ = run_snake("lora_gpt", tmp_path / "c", precision="32-true", steps=4, only_last=True,
                              ckpt_path=str(path), epoch_steps=2)
    for name in straight[-1]:
        assert torch.equal(straight[-1][name], resumed[-1][name]), name

    other = build("lora_gpt", torch.float32)
    with torch.no_grad():
        other.blocks[1].mlp_in.weight.add_(1.0)  # another base model
    with pytest.raises(ValueError, match=r"frozen \(base\) weights.*blocks\.1\."):
        run_snake("lora_gpt", tmp_path / "d", precision="32-true", steps=4, module=other, ckpt_path=str(path),
                  epoch_steps=2)


def test_adapter_saved_during_and_after_fit_loads_with_peft(tmp_path):
    saved = {}

    class Save(L.Callback):
        def on_train_end(self, trainer, module):
            save_adapter(module.peft_model[0], tmp_path / "during")
            saved["during"] = True

    got, _, module = run_snake("lora_llama", tmp_path / "ssd", callbacks=[Save()], only_last=True)
    assert saved
    module.peft_model[0].save_pretrained(str(tmp_path / "after"))  # teardown gave the trained weights back
    trained = {n: v for n, v in got[-1].items() if "lora_" in n}
    for directory in ("during", "after"):
        base = build("lora_llama")
        torch.manual_seed(0)
        fresh = HFCausalLM(LLAMA)
        fresh.configure_model()
        fresh.double()
        loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / directory))
        params = dict(loaded.base_model.model.named_parameters())
        for name, value in trained.items():
            assert torch.equal(params[name].detach(), value), (directory, name)
        for name, p in base.named_parameters():
            if "lora_" not in name:
                assert torch.equal(params[name].detach(), p.detach()), name


def test_bf16_true_keeps_frozen_weights_in_bf16_only(tmp_path):
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen["layout"] = trainer.strategy.engine.storage_layout()

    module = build("lora_gpt", torch.float32)
    base = {n: p.detach().to(torch.bfloat16) for n, p in module.named_parameters() if not p.requires_grad}
    got, _, _ = run_snake("lora_gpt", tmp_path / "ssd", precision="bf16-true", module=module, only_last=True,
                          callbacks=[Look()], storage={"weights": "ssd", "master": "ssd", "optimizer": "ssd"})
    for unit in seen["layout"]:
        assert not unit["weights_is_master"]
        assert unit["master_ssd"] == round_up(unit["train_end"] * 4) < unit["weights_ssd"]  # fp32: adapters only
    for name, value in base.items():
        assert got[-1][name].dtype == torch.bfloat16 and torch.equal(got[-1][name], value), name
    first = build("lora_gpt", torch.float32)
    assert any(not torch.equal(got[-1][n].float(), p.detach().float()) for n, p in first.named_parameters()
               if p.requires_grad)


def test_merged_lora_export_streams_units_and_loads_with_from_pretrained(tmp_path):
    """export_merged_hf during fit (weights in the engine's tiers) and after it writes the state of peft's
    merge_and_unload, bitwise, as a HF directory that from_pretrained loads."""
    import copy

    from transformers import AutoModelForCausalLM

    from snake_strategy.hf import export_merged_hf

    class Export(L.Callback):
        def on_train_end(self, trainer, module):
            export_merged_hf(module.peft_model[0], tmp_path / "during", dtype=torch.float64)

    _, strategy, module = run_snake("lora_llama", tmp_path / "ssd", callbacks=[Export()], only_last=True)
    export_merged_hf(module, tmp_path / "after", dtype=torch.float64)  # the wrapped HFCausalLM works too
    merged = copy.deepcopy(module.peft_model[0]).merge_and_unload().state_dict()
    base = build("lora_llama").state_dict()
    q_proj = "model.layers.0.self_attn.q_proj."
    assert not torch.equal(merged[q_proj + "weight"], base[q_proj + "base_layer.weight"])  # the adapters merged in
    for directory in ("during", "after"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / directory, dtype=torch.float64).state_dict()
        assert set(loaded) == set(merged), sorted(set(loaded) ^ set(merged))
        for name, value in merged.items():
            assert torch.equal(loaded[name], value), (directory, name)


def test_merged_export_refuses_dora(tmp_path):
    from snake_strategy.hf import export_merged_hf

    torch.manual_seed(0)
    module = HFCausalLM(LLAMA)
    module.configure_model()
    peft_model = peft.get_peft_model(module, peft.LoraConfig(**LORA_LLAMA, use_dora=True))
    with pytest.raises(ValueError, match="DoRA.*save_adapter"):
        export_merged_hf(peft_model, tmp_path / "out")
