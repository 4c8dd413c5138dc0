"""The fine-tuning cases the hf tests share: frozen parameters anywhere and LoRA through peft, each model built
for real (seeded) before fit, and its runs with greedysnake and with plain Lightning (tests/helpers.py)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from snake_strategy.gpt import GPTConfig, GPTModule
from tests.helpers import SMALL_GPT, fit_lightning, fit_snake, token_data

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from snake_strategy.hf import HFCausalLM  # noqa: E402

STEPS, MICRO, MICRO_SIZE, SEQ, VOCAB = 4, 4, 2, 16, 64
UNTIED = GPTConfig(vocab_size=VOCAB, d_model=32, num_layers=4, num_heads=4, context_len=SEQ, tied_head=False)
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LORA_GPT = dict(r=8, lora_alpha=16, target_modules=["qkv", "attn_out"], lora_dropout=0.0)
LORA_LLAMA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _freeze(module, names):
    for name, p in module.named_parameters():
        if any(name.startswith(prefix) or f".{prefix}" in name for prefix in names):
            p.requires_grad_(False)
    return module


def _lora(module, config):
    peft_model = peft.get_peft_model(module, peft.LoraConfig(**config))
    # B starts at zero: make it non-zero so every adapter parameter gets a gradient from step 1.
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    module.peft_model = [peft_model]  # a list: not registered as a submodule
    return module


def build(case, dtype=torch.float64):
    """The model of ``case``, built for real (seeded), cast to ``dtype`` and frozen as the case says."""
    torch.manual_seed(0)
    if case == "lora_llama":
        module = HFCausalLM(LLAMA, learning_rate=1e-2)
    else:
        module = GPTModule(UNTIED if case == "embed_head" else SMALL_GPT, learning_rate=1e-2, warmup_steps=1,
                           max_steps=STEPS)
    module.configure_model()
    module.to(dtype)
    if case == "embed_head":  # embedding, position embedding and an untied head
        return _freeze(module, ["wte.", "wpe.", "lm_head."])
    if case == "lower_half":  # embeddings (tied head) and blocks 0-1: units 0-1 need no backward at all
        return _freeze(module, ["wte.", "wpe.", "blocks.0.", "blocks.1."])
    if case == "middle":  # blocks 1-2 only: they pass the input gradient through, no weight gradient
        return _freeze(module, ["blocks.1.", "blocks.2."])
    if case == "part_of_block":  # the first LayerNorm and the MLP input bias of every block
        return _freeze(module, ["ln_1.", "mlp_in.bias"])
    if case == "lora_gpt":
        return _lora(module, LORA_GPT)
    if case == "lora_llama":
        return _lora(module, LORA_LLAMA)
    raise AssertionError(case)


def data(steps=STEPS):
    x, y = token_data(steps * MICRO * MICRO_SIZE, SEQ, VOCAB)
    return TensorDataset(x, y)


def run_reference(case, precision="64-true", clip=None):
    """Plain Lightning on the frozen model of ``case``: the parameters after every step."""
    module = build(case, torch.float64 if precision == "64-true" else torch.float32)
    return fit_lightning(module, DataLoader(data(), batch_size=MICRO_SIZE), steps=STEPS, precision=precision,
                         accumulate=MICRO, trainer_extra={"gradient_clip_val": clip}).states


def run_snake(case, ssd_dir, kind="vertical", precision="64-true", clip=None, storage=None, schedule=None,
              steps=STEPS, callbacks=(), only_last=False, module=None, ckpt_path=None, epoch_steps=STEPS):
    """greedysnake on the frozen model of ``case`` (or ``module``): (recorded states, strategy, module)."""
    module = module or build(case, torch.float64 if precision == "64-true" else torch.float32)
    run = fit_snake(module, DataLoader(data(epoch_steps), batch_size=MICRO * MICRO_SIZE), steps=steps,
                    storage=dict(storage or {"weights": "ssd", "optimizer": "ssd", "gradients": "host"},
                                 ssd_dir=str(ssd_dir)),
                    schedule=dict({"kind": kind, "num_micro_batches": MICRO, "alpha": 0.25}, **(schedule or {})),
                    precision=precision, callbacks=callbacks, record="last" if only_last else "step",
                    ckpt_path=ckpt_path, trainer_extra={"gradient_clip_val": clip})
    return run.states, run.strategy, module


REFERENCES = {}


def reference(case, clip=None):
    if (case, clip) not in REFERENCES:
        REFERENCES[(case, clip)] = run_reference(case, clip=clip)
    return REFERENCES[(case, clip)]


CASES = ["embed_head", "lower_half", "middle", "part_of_block", "lora_gpt", "lora_llama"]
