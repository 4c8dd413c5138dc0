"""The tiny HF models and padded batches the hf tests (and the evaluation tests) share; nothing is downloaded."""
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: E402
from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig  # noqa: E402

from snake_strategy.hf import HFCausalLM  # noqa: E402

VOCAB, SEQ = 128, 12


def tiny_config(family: str):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        return GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, **common)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **common)
    if family == "llama":
        return LlamaConfig(**llama_like)
    if family == "mistral":  # a window shorter than the sequence, so the sliding mask matters
        return MistralConfig(sliding_window=5, **llama_like)
    if family == "qwen2":  # mixed layers: the first full, the others sliding
        return Qwen2Config(use_sliding_window=True, sliding_window=5, max_window_layers=1, **llama_like)
    if family == "qwen3":  # tied embeddings, q/k norms
        return Qwen3Config(head_dim=8, tie_word_embeddings=True, **llama_like)
    # Mixture of experts: 4 experts, top 2, so every token leaves two experts out.
    if family == "mixtral":
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **llama_like)
    if family == "qwen3_moe":  # experts narrower than the dense MLP would be, q/k norms
        return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                              **llama_like)
    if family == "olmoe":
        return OlmoeConfig(num_experts=4, num_experts_per_tok=2, **llama_like)
    raise AssertionError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]
MOE_FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The raw HF model in float64; MoE families run their experts eagerly (grouped matmuls have no float64 kernel)."""
    torch.manual_seed(seed)
    options = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    return AutoModelForCausalLM.from_config(tiny_config(family), **options).double()


def batches(num: int, size: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Right-padded samples of different lengths; labels ignore the padding and each sample's first two tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(3, VOCAB, (size, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (size,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


class Samples(Dataset):
    def __init__(self, micro_batches):
        self.rows = [{k: v[i] for k, v in b.items()} for b in micro_batches for i in range(len(b["input_ids"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def built(config_or_dir) -> HFCausalLM:
    module = HFCausalLM(config_or_dir)
    module.configure_model()
    return module
