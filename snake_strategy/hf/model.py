"""HuggingFace causal LMs as layered modules: Llama, Mistral, Qwen2, Qwen3, GPT-2 and the mixture-of-experts
families Mixtral, Qwen3-MoE and OLMoE, with no user glue.

``HFCausalLM`` builds the HF model from its config (on the meta device under greedysnake), keeps the HF
modules themselves and drives them stage by stage:

    pre_stage:  input_ids -> token (+ position) embedding; the side inputs every layer needs (attention
                masks, rotary cos/sin, position ids), computed once per micro-batch
    blocks:     the HF decoder layers, called as ``layer(hidden, **side)``
    post_stage: final norm -> lm_head -> logits

The families agree on that layout and differ only in attribute names and in where positions enter,
which the small ``FAMILIES`` table records. Parameter names are exactly the HF checkpoint's
(``model.layers.3.mlp.up_proj.weight``, ``transformer.h.0.attn.c_attn.weight``, ...): the trunk's
children are registered under the same attribute names, so ``state_dict()``, ``pretrained=<HF dir>``
and ``export_hf`` need no key map.

The blocks are the HF layer objects with their class swapped for a subclass (``SideInputLayer`` + the
HF class): the parameters and names stay the HF layer's own, while the subclass picks the right mask
for sliding-window layers and always returns one tensor. Rotary embeddings stay in ``pre_stage`` (their
``inv_freq`` buffer would be a block buffer otherwise).

No download ever: configs come as objects, dicts or local directories.
"""
from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
except ImportError as err:  # the adapter is an optional extra
    raise ImportError("snake_strategy.hf needs transformers>=5 and safetensors: pip install -e '.[hf]'") from err

from snake_strategy.hf.checkpoint_keys import CheckpointKeys
from snake_strategy.hf.generation import greedy_generate
from snake_strategy.hf.router_loss import router_loss_of
from snake_strategy.module import LayeredModule
from snake_strategy.sources.lora_init import adapter_initializer, adapter_parameter_ids
from snake_strategy.sources.pretrained import PretrainedSource

IGNORE_INDEX = -100  # HF's label value for "no loss here" (padding, prompts)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # transformers' kernels for a layer's 3-D experts


@dataclass(frozen=True)
class Family:
    """Where a family keeps its pieces (attribute names inside the HF causal-LM class)."""

    trunk: str  # child of the causal LM holding embeddings, layers and final norm
    embed: str
    layers: str
    norm: str
    positions: str | None = None  # learned absolute position embedding, added in pre_stage
    rotary: str | None = None  # rotary embedding module: its cos/sin go to every layer
    dropout: str | None = None  # embedding dropout, applied in pre_stage
    sliding_without_layer_types: bool = False  # config.sliding_window set => every layer is sliding


_LLAMA_LIKE = Family("model", "embed_tokens", "layers", "norm", rotary="rotary_emb")
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": Family("model", "embed_tokens", "layers", "norm", rotary="rotary_emb", sliding_without_layer_types=True),
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    # Mixture-of-experts families: the same layout; a layer's experts are 3-D parameters of its MLP.
    "mixtral": Family("model", "embed_tokens", "layers", "norm", rotary="rotary_emb", sliding_without_layer_types=True),
    "qwen3_moe": _LLAMA_LIKE,
    "olmoe": _LLAMA_LIKE,
    "gpt2": Family("transformer", "wte", "h", "ln_f", positions="wpe", dropout="drop"),
}


class SideInputLayer(nn.Module):
    """Mixed in before a HF decoder-layer class: ``layer(hidden, **side) -> hidden``, or ``(hidden, router
    logits)`` when the loss adds the router's load-balancing loss.

    ``side`` carries both masks when a model mixes full and sliding-window layers; each layer takes
    the one its attention type needs (``snake_sliding``) and passes the rest through unchanged.
    ``snake_router``: (path of the layer's router module, index of the logits in its output), as HF's own
    output recorder reads them, when the loss needs them; the logits come back as (samples, tokens, experts).
    """

    snake_sliding = False
    snake_router: tuple[str, int] | None = None

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                sliding_attention_mask: Tensor | None = None, **side: Any) -> Tensor | tuple[Tensor, Tensor]:
        mask = sliding_attention_mask if self.snake_sliding else attention_mask
        if self.snake_router is None:
            out = super().forward(hidden_states, attention_mask=mask, **side)
            # Older HF layers return (hidden, attention weights, ...); the contract wants one tensor.
            return out[0] if isinstance(out, tuple) else out
        path, index = self.snake_router
        captured: list[Tensor] = []
        hook = self.get_submodule(path).register_forward_hook(lambda _m, _a, output: captured.append(output[index]))
        try:
            out = super().forward(hidden_states, attention_mask=mask, **side)
        finally:
            hook.remove()
        hidden = out[0] if isinstance(out, tuple) else out
        assert len(captured) == 1, f"the router of a layer ran {len(captured)} times"
        return hidden, captured[0].view(hidden.shape[0], hidden.shape[1], -1)


@functools.cache
def side_input_class(layer_class: type) -> type:
    return type(f"Snake{layer_class.__name__}", (SideInputLayer, layer_class), {"__module__": __name__})


def resolve_config(config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike
                   ) -> tuple[PretrainedConfig, str | None]:
    """(a private copy of the config, the directory its weights are in or None). Never downloads."""
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config), None
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs 'model_type' (one of " + ", ".join(FAMILIES) + ")")
        return AutoConfig.for_model(model_type, **fields), None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model path '{path}' is not a local model directory with a config.json; "
                             "snake_strategy.hf never downloads: save_pretrained the model to a directory first")
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        has_weights = any(os.path.isfile(os.path.join(path, f))
                          for f in ("model.safetensors", "model.safetensors.index.json"))
        return cfg, path if has_weights else None
    raise ValueError(f"config must be a transformers PretrainedConfig, a dict with 'model_type' or a local model "
                     f"directory; got {type(config).__name__}")


def family_of(config: PretrainedConfig) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"model_type '{config.model_type}' is not supported by snake_strategy.hf; supported: "
                         f"{', '.join(FAMILIES)} (transformers {transformers.__version__})")
    return family


def layer_kinds(config: PretrainedConfig, family: Family) -> list[str]:
    """'full_attention' or 'sliding_attention' per decoder layer, as the HF model decides it."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types[:n])
    if family.sliding_without_layer_types and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class HFCausalLM(LayeredModule):
    """A HF causal LM (Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral, Qwen3-MoE, OLMoE) for ``strategy="greedysnake"``
    and plain Lightning.

    Args:
        config: a ``transformers.PretrainedConfig``, a dict with ``model_type``, or a local model
            directory (config.json + model.safetensors or shards). A directory's weights are loaded:
            directly under plain strategies, and under greedysnake by setting the strategy's
            ``pretrained`` to the directory when it is unset (streamed in unit by unit).
        learning_rate, weight_decay, betas, eps: ``torch.optim.AdamW`` settings (one group).
        attn_implementation: "sdpa" or "eager" (both take the materialized masks of the side inputs).
        experts_implementation: for the mixture-of-experts families, how a layer runs its stacked experts:
            "eager" (a loop over the experts hit, any dtype), "grouped_mm" or "batched_mm"; None (the default)
            is transformers' choice (grouped_mm where it can dispatch). Plain references in float64 need
            "eager" (grouped matmuls have no float64 kernel); the strategy runs whatever is chosen here.
        path: a local model directory, the same as passing it as ``config`` (for Hydra's ``model.path=``).
        generate_in_predict: keyword arguments of ``generate`` (``max_new_tokens`` required; ``eos_token_id``,
            ``pad_token_id``): ``trainer.predict`` then returns generated tokens (prompt + new tokens, the
            tensor ``generate`` returns) for each batch's ``input_ids`` and ``attention_mask`` (left-padded
            prompts), under greedysnake as under plain strategies. None (the default): ``predict_step``
            returns the logits.
        ignore_unexpected_keys: load the weights although the directory (or the strategy's ``pretrained``)
            holds tensors this model has no parameter for, e.g. a config with fewer layers than the
            checkpoint (``num_hidden_layers=2`` of a 32-layer model): they are skipped. False (the
            default) refuses such a checkpoint with a ValueError naming the unexpected keys.

    The constructor builds the module structure on the meta device, as ``from_pretrained`` does before
    it loads: ``peft.get_peft_model(HFCausalLM(dir), LoraConfig(...))`` works directly and allocates no
    base weight. ``configure_model`` (called by Lightning) materializes it, or under greedysnake leaves
    the weights to be streamed in unit by unit.

    Batches: dicts with ``input_ids``, optional ``attention_mask`` (1 = token, 0 = padding; right
    padding) and optional ``labels`` (-100 ignored; without labels, ``input_ids`` with padding set to
    -100). HF shifts labels inside the loss: position t predicts label t+1. The project's own
    ``(input_ids, next_token_targets)`` tuples (TextDataModule) are accepted too, targets unshifted.

    Loss normalisation: ``compute_loss`` returns the token-mean cross entropy of ONE micro-batch (HF's
    ``ForCausalLMLoss`` without ``num_items_in_batch``), in float32 or better (float64 stays float64,
    where HF would round the logits to float32). With gradient accumulation the step's gradient is the
    mean of the micro-batch means, which is what plain Lightning + the HF model +
    ``accumulate_grad_batches=M`` computes (each micro-batch loss divided by M); the strategy's mean
    over its micro-batches equals it. It is not the token-mean over the whole global batch when
    micro-batches hold different numbers of valid tokens (HF Trainer's ``num_items_in_batch``).
    """

    # Every supported family's decoder layer computes a sample from that sample alone (attention within the
    # sequence, per-token norms and MLPs; the masks are per sample): auto may batch the micro-batches.
    independent_samples = True

    def __init__(self, config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike | None = None,
                 learning_rate: float = 1e-4, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, attn_implementation: str = "sdpa", path: str | os.PathLike | None = None,
                 generate_in_predict: Mapping[str, Any] | None = None, ignore_unexpected_keys: bool = False,
                 experts_implementation: str | None = None) -> None:
        super().__init__()
        if (config is None) == (path is None):
            raise ValueError("HFCausalLM needs exactly one of config=<PretrainedConfig or dict> or path=<local model "
                             "directory> (Hydra: model.path=/dir/with/config.json)")
        config = path if config is None else config
        if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation='{attn_implementation}' is not supported; use one of "
                             f"{ATTENTION_IMPLEMENTATIONS} (the side inputs carry materialized masks)")
        if experts_implementation is not None and experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(f"experts_implementation='{experts_implementation}' is not supported; use one of "
                             f"{EXPERTS_IMPLEMENTATIONS} or None (transformers' choice)")
        self.hf_config, self.weights_dir = resolve_config(config)
        self.family = family_of(self.hf_config)
        self.attn_implementation = attn_implementation
        self.experts_implementation = experts_implementation
        self.ignore_unexpected_keys = bool(ignore_unexpected_keys)
        self.learning_rate, self.weight_decay, self.betas, self.eps = learning_rate, weight_decay, tuple(betas), eps
        self.generate_in_predict = _generation_kwargs(generate_in_predict)
        # A dict config keeps load_from_checkpoint working; the weights come from the checkpoint then.
        self.save_hyperparameters({"config": self.hf_config.to_dict(), "learning_rate": learning_rate,
                                   "weight_decay": weight_decay, "betas": list(betas), "eps": eps,
                                   "attn_implementation": attn_implementation,
                                   "generate_in_predict": self.generate_in_predict,
                                   "ignore_unexpected_keys": self.ignore_unexpected_keys,
                                   "experts_implementation": experts_implementation})
        self._build_on_meta()

    # ------------------------------------------------------------------ building
    @property
    def blocks(self) -> nn.ModuleList:
        return getattr(self.trunk, self.family.layers)

    @property
    def trunk(self) -> nn.Module:
        return self._modules[self.family.trunk]

    def _build_on_meta(self) -> None:
        """The module structure with every parameter on the meta device, as ``from_pretrained`` builds it
        before loading: names, shapes and modules exist (``get_peft_model`` can wrap them), no weight is
        allocated and no random number drawn. ``configure_model`` materializes it or leaves it to the strategy."""
        # from_config builds in the config's dtype when it names one (a saved directory's config.json does),
        # else in the default dtype: configure_model applies the same rule in its own context.
        dtype = self.hf_config.dtype
        self._config_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        # Always construct on meta: HF's constructors would otherwise draw (and waste) random numbers.
        with torch.device("meta"):
            options = {} if self.experts_implementation is None else {"experts_implementation": self.experts_implementation}
            hf = AutoModelForCausalLM.from_config(self.hf_config, attn_implementation=self.attn_implementation,
                                                  **options)
        self.hf_config = hf.config
        fam = self.family
        hf_trunk = getattr(hf, fam.trunk)
        if list(hf_trunk.named_parameters(recurse=False)):
            raise ValueError(f"{type(hf_trunk).__name__} has parameters of its own; snake_strategy.hf cannot "
                             "place them (not a supported layout)")
        # A plain container under the HF attribute name keeps the HF parameter names; HF's trunk forward
        # (which would run all layers at once) is not needed.
        trunk = nn.Module()
        for name, child in hf_trunk.named_children():
            trunk.add_module(name, child)
        self.router_loss = router_loss_of(hf)
        # The loss then reads every layer's router logits: each block returns them (contract: block outputs).
        self.loss_reads_block_outputs = self.router_loss is not None
        for layer, kind in zip(getattr(trunk, fam.layers), layer_kinds(self.hf_config, fam)):
            layer.__class__ = side_input_class(type(layer))
            layer.snake_sliding = kind == "sliding_attention"
            if self.router_loss is not None:
                routers = [name for name, m in layer.named_modules() if isinstance(m, self.router_loss.router_class)]
                assert len(routers) == 1, f"a decoder layer with {len(routers)} routers"
                layer.snake_router = (routers[0], self.router_loss.index)
        if fam.rotary is not None:
            # inv_freq is computed, not trained: build it for real (a few floats) while everything else is meta.
            with torch.device("cpu"):
                setattr(trunk, fam.rotary, type(getattr(trunk, fam.rotary))(config=self.hf_config))
        self.add_module(fam.trunk, trunk)
        self.lm_head = hf.lm_head
        self._tied = hf.lm_head.weight is getattr(trunk, fam.embed).weight
        self._hf_init_weights = hf._init_weights  # HF's per-module init (uses the config's ranges)
        self._checkpoint_keys = CheckpointKeys(hf)  # the files' layout where it differs from the module's
        self._layer_kinds = set(layer_kinds(self.hf_config, fam))
        # Keys from_pretrained itself ignores in a checkpoint (not UNEXPECTED): the class's own patterns (old
        # GPT-2 files' attention-mask buffers) and, as transformers adds them, the buffers older versions saved.
        ignored = set(getattr(type(hf), "_keys_to_ignore_on_load_unexpected", None) or ())
        buffers = [name for name, _ in hf.named_buffers()]
        if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
            ignored.add(r"rotary_emb\.inv_freq")
        if any(name.endswith("position_ids") for name in buffers):
            ignored.add(r"(^|\.)position_ids$")
        self.ignored_checkpoint_keys = tuple(sorted(ignored))

    def configure_model(self) -> None:
        """Materialize the meta-built structure on the current default device and dtype (the strategy's
        context: the CPU/GPU under plain strategies, the meta device under greedysnake, which streams the
        weights in itself). Idempotent: Lightning and the strategy may both call it."""
        if not any(p.is_meta for p in self.parameters()):
            return  # already materialized (a second call, or weights given back after a fit)
        dtype = self._config_dtype or torch.get_default_dtype()
        # Meta tensors change dtype for free: the structure takes the dtype a build inside configure_model
        # would (transformers' rule: the config's, else the precision plugin's default). Parameters only (the
        # rotary inv_freq stays as HF computes it).
        for module in self.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta and p.is_floating_point() and p.dtype != dtype:
                    module.register_parameter(name, nn.Parameter(p.to(dtype), requires_grad=p.requires_grad))
        fam, trunk = self.family, self.trunk
        if self._tied:  # the conversion gave lm_head its own tensor: tie it again
            _head_linear(self.lm_head).weight = getattr(trunk, fam.embed).weight
        target = torch.empty(0).device  # "meta" under greedysnake, the CPU/GPU otherwise
        if target.type == "meta":
            if self.weights_dir is not None:
                self._hand_weights_dir_to_strategy()
            return
        for name, child in self.named_children():
            if name != fam.trunk:
                child.to_empty(device=target)
        for name, child in trunk.named_children():
            if name != fam.rotary:
                child.to_empty(device=target)
        if self._tied:  # after to_empty, which gives every module its own new tensor
            _head_linear(self.lm_head).weight = getattr(trunk, fam.embed).weight
        self.apply(self.init_module_weights)
        adapters = adapter_initializer(self)  # peft wrapped the meta structure: its init for the adapters
        if adapters is not None:
            self.apply(adapters)
        if self.weights_dir is not None:
            self._load_weights_dir()

    @torch.no_grad()
    def _load_weights_dir(self) -> None:
        source = PretrainedSource(self.weights_dir, self)
        try:
            source.check_unexpected(self)
            fresh = adapter_parameter_ids(self)
            for name, p in self.named_parameters():
                if id(p) in fresh and name not in source:
                    continue  # a peft adapter (the base directory has none): initialised above
                p.copy_(source.tensor(name, p.shape))
        finally:
            source.close()

    def _hand_weights_dir_to_strategy(self) -> None:
        if self._trainer is None:
            return  # a meta build for inspection (shapes, names): nothing to load into
        strategy = self._trainer.strategy
        if not hasattr(strategy, "pretrained"):
            raise ValueError(f"HFCausalLM('{self.weights_dir}') was built on the meta device by "
                             f"{type(strategy).__name__}, which cannot stream its weights in; use "
                             "Trainer(strategy='greedysnake') or a strategy that builds on a real device")
        if strategy.pretrained is None:
            strategy.pretrained = self.weights_dir  # the engine streams it in unit by unit at setup

    def checkpoint_conversion(self, file_keys: list[str]) -> dict[str, Any]:
        """The parameters a HF directory stores in another layout (per-expert matrices of a mixture-of-experts
        layer) and how to build each from the files' tensors: read by ``PretrainedSource``."""
        return self._checkpoint_keys.convert(file_keys)

    def init_module_weights(self, module: nn.Module) -> None:
        init = self.__dict__.get("_hf_init_weights")
        if init is not None:
            init(module)
        else:
            super().init_module_weights(module)

    # ------------------------------------------------------------------ stages
    @staticmethod
    def _inputs(batch: Any) -> tuple[Tensor, Tensor | None]:
        if isinstance(batch, Mapping):
            if "input_ids" not in batch:
                raise ValueError(f"HFCausalLM batches need 'input_ids' (got keys {sorted(batch)})")
            return batch["input_ids"], batch.get("attention_mask")
        if isinstance(batch, (tuple, list)):
            return batch[0], None
        if isinstance(batch, Tensor):
            return batch, None
        raise ValueError(f"HFCausalLM takes dict batches with input_ids/attention_mask/labels, "
                         f"(input_ids, targets) tuples or an input_ids tensor; got {type(batch).__name__}")

    def pre_stage(self, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        input_ids, padding_mask = self._inputs(batch)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.embed_stage(input_ids, positions, padding_mask)

    def embed_stage(self, input_ids: Tensor, positions: Tensor, padding_mask: Tensor | None = None,
                    cache: Any = None) -> tuple[Tensor, dict[str, Any]]:
        """``pre_stage`` at given ``positions``: the hidden state and the side inputs every layer takes.

        With a HF ``cache`` (generation), ``padding_mask`` covers the cached tokens and these, the masks
        are built for the cached length, and every layer appends its keys/values to the cache."""
        fam, trunk = self.family, self.trunk
        embeds = getattr(trunk, fam.embed)(input_ids)
        hidden = embeds
        if fam.positions is not None:
            hidden = hidden + getattr(trunk, fam.positions)(positions)
        if fam.dropout is not None:
            hidden = getattr(trunk, fam.dropout)(hidden)
        side: dict[str, Any] = {"position_ids": positions}
        mask_args = dict(config=self.hf_config, inputs_embeds=embeds, attention_mask=padding_mask, cache=cache,
                         position_ids=positions, allow_is_causal_skip=False)
        # Always materialized (no is_causal shortcut): every micro-batch then has the same side keys,
        # whether or not it holds padding, and the strategy can concatenate them.
        if "full_attention" in self._layer_kinds:
            side["attention_mask"] = create_causal_mask(**mask_args)
        if "sliding_attention" in self._layer_kinds:
            side["sliding_attention_mask"] = create_sliding_window_causal_mask(**mask_args)
        if fam.rotary is not None:
            side["position_embeddings"] = tuple(getattr(trunk, fam.rotary)(hidden, positions))
        if cache is not None:
            side.update(cache=cache, use_cache=True)
        return hidden, side

    def post_stage(self, hidden: Tensor) -> Tensor:
        return self.lm_head(getattr(self.trunk, self.family.norm)(hidden))

    def compute_loss(self, outputs: Tensor, batch: Any, block_outputs: list[Tensor] | None = None) -> Tensor:
        """Token-mean cross entropy of this micro-batch (see the class docstring for why per micro-batch),
        plus the router's load-balancing loss over ``block_outputs`` (every layer's router logits) when the
        config enables it, as HF's forward adds it."""
        logits = outputs if outputs.dtype in (torch.float32, torch.float64) else outputs.float()
        if isinstance(batch, (tuple, list)):
            targets = batch[1]  # already the next tokens
        else:
            input_ids, padding_mask = self._inputs(batch)
            labels = batch.get("labels") if isinstance(batch, Mapping) else None
            if labels is None:
                labels = input_ids if padding_mask is None else input_ids.masked_fill(padding_mask == 0, IGNORE_INDEX)
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten().to(logits.device), ignore_index=IGNORE_INDEX)
        if self.router_loss is None:
            return loss
        assert block_outputs is not None and len(block_outputs) == len(self.blocks), "every layer's router logits"
        rl = self.router_loss
        padding_mask = None if isinstance(batch, (tuple, list)) else self._inputs(batch)[1]
        aux = rl.function(tuple(o.flatten(0, 1) for o in block_outputs), rl.num_experts, rl.top_k, padding_mask)
        return loss + rl.coefficient * aux.to(loss.device)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay)

    # ------------------------------------------------------------------ inference
    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The logits, or with ``generate_in_predict`` the generated tokens of the batch's prompts."""
        if self.generate_in_predict is None:
            return super().predict_step(batch, batch_idx)
        input_ids, attention_mask = self._inputs(batch)
        return self.generate(input_ids, attention_mask=attention_mask, **self.generate_in_predict)

    def generate(self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> Tensor:
        """Greedy decoding with a KV cache in host memory, the tokens of transformers'
        ``generate(do_sample=False)``: left-padded prompts with their ``attention_mask``, EOS stopping
        (``eos_token_id``/``pad_token_id`` default to the config's; ``eos_token_id=[]`` never stops).
        Under greedysnake each generated token streams every unit's weights once. See generation.py."""
        return greedy_generate(self, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id)


def _head_linear(head: nn.Module) -> nn.Module:
    """The ``nn.Linear`` of the output head, inside a peft wrapper when the head was adapted."""
    return getattr(head, "base_layer", head)


def _generation_kwargs(given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise ValueError(f"generate_in_predict must be a dict of generate() arguments, e.g. {{'max_new_tokens': 32}}; "
                         f"got {given!r}")
    allowed = ("max_new_tokens", "eos_token_id", "pad_token_id")
    unknown = sorted(set(given) - set(allowed))
    if unknown or "max_new_tokens" not in given:
        raise ValueError(f"generate_in_predict={dict(given)!r}: it takes {allowed} (max_new_tokens required)"
                         + (f"; unknown: {unknown}" if unknown else ""))
    return dict(given)
