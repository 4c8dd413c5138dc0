"""A GPT-2 style decoder written against the layered-model contract.

The model is split the way the greedysnake strategy streams it:

    pre_stage  : token embedding + position embedding + dropout      (stays on the device)
    blocks     : ``num_layers`` pre-norm transformer blocks          (offloaded, streamed)
    post_stage : final LayerNorm + language-model head               (stays on the device)

Blocks own parameters only (no buffers): the strategy runs them through
``torch.func.functional_call`` with a parameter dict, so the causal mask comes from
``scaled_dot_product_attention(is_causal=True)`` rather than from a registered mask buffer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from snake_strategy.module import LayeredModule


@dataclass
class GPTConfig:
    """Shape of a GPT model. The defaults are the ``tiny`` preset.

    vocab_size: number of token ids (256 for raw bytes, 50257 for the GPT-2 BPE vocabulary).
    d_model: width of the residual stream, in features.
    num_layers: number of transformer blocks.
    num_heads: attention heads per block; ``d_model`` must split evenly across them.
    context_len: longest sequence the position embedding covers, in tokens.
    tied_head: share the LM-head weight with the token embedding (GPT-2 does).
    dropout: probability used for embedding, attention and residual dropout.
    mlp_ratio: MLP hidden width as a multiple of ``d_model``.
    bias: give the block Linear layers and all LayerNorms a bias (the LM head never has one).
    num_experts: 0 for a dense MLP; else each block's MLP is a mixture of this many expert MLPs (each
        ``mlp_ratio * d_model`` wide), separate modules, and a router that sends each token to
        ``experts_per_token`` of them (softmax gate, renormalised over the chosen ones). An expert no
        token of a step chose gets no gradient and sits the step out.
    experts_per_token: experts each token runs through (top-k routing).
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    context_len: int = 64
    tied_head: bool = True
    dropout: float = 0.0
    mlp_ratio: int = 4
    bias: bool = True
    num_experts: int = 0
    experts_per_token: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "context_len", "mlp_ratio"):
            value = getattr(self, name)
            # bool is an int subclass; GPTConfig(d_model=True) is surely a mistake.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"pick num_heads among the divisors of d_model (e.g. {_nearby_divisor(self.d_model, self.num_heads)})"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("tied_head", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"GPTConfig.num_experts must be 0 (a dense MLP) or a positive integer, "
                             f"got {self.num_experts!r}")
        if self.num_experts and not (isinstance(self.experts_per_token, int)
                                     and 1 <= self.experts_per_token <= self.num_experts):
            raise ValueError(f"GPTConfig.experts_per_token must be an integer in [1, num_experts={self.num_experts}], "
                             f"got {self.experts_per_token!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def block_params(self, active: bool = False) -> int:
        """Exact parameter count of one ``Block``; ``active``: of the part one token runs through (its
        ``experts_per_token`` experts and the router, for a mixture of experts)."""
        d, hidden, b = self.d_model, self.mlp_ratio * self.d_model, int(self.bias)
        layer_norms = 2 * (d + b * d)
        attention = (d * 3 * d + b * 3 * d) + (d * d + b * d)
        mlp = (d * hidden + b * hidden) + (hidden * d + b * d)
        if self.num_experts:
            mlp = d * self.num_experts + (self.experts_per_token if active else self.num_experts) * mlp
        return layer_norms + attention + mlp

    def num_params(self) -> int:
        """Exact parameter count of a ``GPTModule`` built from this config (a tied head counted once)."""
        d, b = self.d_model, int(self.bias)
        embeddings = self.vocab_size * d + self.context_len * d
        final_norm = d + b * d
        head = 0 if self.tied_head else self.vocab_size * d
        return embeddings + self.num_layers * self.block_params() + final_norm + head

    @classmethod
    def from_any(cls, config: "GPTConfig | dict | str") -> "GPTConfig":
        """Accept a GPTConfig, a dict of its fields (e.g. from Hydra) or a preset name."""
        if isinstance(config, GPTConfig):
            return config
        if isinstance(config, str):
            return preset(config)
        if isinstance(config, dict) or hasattr(config, "keys"):
            config = dict(config)
            unknown = sorted(set(config) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(
                    f"unknown GPTConfig field(s) {unknown}; valid fields are "
                    f"{[f.name for f in dataclasses.fields(cls)]}"
                )
            return cls(**config)
        raise ValueError(f"config must be a GPTConfig, a dict of its fields or a preset name, got {type(config).__name__}")


def _nearby_divisor(d_model: int, num_heads: int) -> int:
    divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
    return min(divisors, key=lambda h: abs(h - num_heads))


GPT2_VOCAB = 50257

# Named shapes used by tests, examples and benchmarks (exact sizes: GPT_PRESETS[name].num_params()).
GPT_PRESETS: dict[str, GPTConfig] = {
    # Byte-level toy model for unit tests and smoke runs.
    "tiny": GPTConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=4, context_len=64, tied_head=True),
    "small": GPTConfig(vocab_size=256, d_model=384, num_layers=6, num_heads=6, context_len=128, tied_head=True),
    # GPT-2 vocabulary with an untied head: the non-layer (always resident) part is large.
    "r1": GPTConfig(vocab_size=GPT2_VOCAB, d_model=768, num_layers=6, num_heads=12, context_len=128, tied_head=False),
    # Wide layers and short sequences: little compute per byte of weights, so transfers dominate.
    "io_bound": GPTConfig(vocab_size=256, d_model=1024, num_layers=12, num_heads=16, context_len=32, tied_head=True),
    "gpt_1b": GPTConfig(vocab_size=GPT2_VOCAB, d_model=2048, num_layers=24, num_heads=16, context_len=512, tied_head=True),
    "gpt_4b": GPTConfig(vocab_size=GPT2_VOCAB, d_model=3072, num_layers=36, num_heads=24, context_len=512, tied_head=True),
    # Mixture of experts at gpt_1b's width: 1.1B parameters, 8 experts of d_model width per block, top-2
    # (about 0.4B active per token). Experts are separate modules, so an expert no token chose sits out.
    "gpt_1b_moe": GPTConfig(vocab_size=GPT2_VOCAB, d_model=2048, num_layers=12, num_heads=16, context_len=512,
                            tied_head=True, mlp_ratio=1, num_experts=8, experts_per_token=2),
}


def preset(name: str) -> GPTConfig:
    """Return a fresh copy of the named preset config (safe to modify)."""
    if name not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; known presets: {', '.join(sorted(GPT_PRESETS))}")
    return dataclasses.replace(GPT_PRESETS[name])


class ResidualProjection(nn.Linear):
    """A Linear that writes into the residual stream; GPT-2 scales its initial weights down.

    A type rather than a registry of module identities, so the answer survives deepcopy (the strategy
    initialises copies of meta blocks)."""


class Block(nn.Module):
    """GPT-2 pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    Holds parameters only (no buffers), so ``functional_call(block, params, (hidden,))`` is a complete
    description of the computation.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden = config.d_model, config.mlp_ratio * config.d_model
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.ln_1 = nn.LayerNorm(d, bias=config.bias)
        self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        self.attn_out = ResidualProjection(d, d, bias=config.bias)
        self.ln_2 = nn.LayerNorm(d, bias=config.bias)
        self.experts_per_token = config.experts_per_token
        if config.num_experts:
            self.router = nn.Linear(d, config.num_experts, bias=False)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(d, hidden, bias=config.bias), nn.GELU(),
                              ResidualProjection(hidden, d, bias=config.bias))
                for _ in range(config.num_experts))
        else:
            self.mlp_in = nn.Linear(d, hidden, bias=config.bias)
            self.act = nn.GELU()
            self.mlp_out = ResidualProjection(hidden, d, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def attention(self, x: Tensor) -> Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # [B, T, d] -> [B, heads, T, head_dim], the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, time, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, time, width)
        return self.resid_drop(self.attn_out(y))

    def mlp(self, x: Tensor) -> Tensor:
        if not hasattr(self, "experts"):
            return self.resid_drop(self.mlp_out(self.act(self.mlp_in(x))))
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(tokens), dim=-1).topk(self.experts_per_token, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():  # an expert no token chose is not run: its parameters get no gradient
                out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return self.resid_drop(out.view_as(x))

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = hidden + self.attention(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class WarmupCosineSchedule:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine from 1.0 down to ``final_ratio``.

    Without ``max_steps`` the multiplier stays at 1.0 after warmup. A class (not a closure) so that
    ``LambdaLR.state_dict()`` records its settings.
    """

    def __init__(self, warmup_steps: int, max_steps: int | None, final_ratio: float = 0.1) -> None:
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.final_ratio = final_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            # (step + 1) so the very first optimizer step already moves the weights.
            return (step + 1) / self.warmup_steps
        if self.max_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.final_ratio + (1.0 - self.final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(LayeredModule):
    """GPT-2 style language model trainable with ``strategy="auto"`` or ``strategy="greedysnake"``.

    Batches are ``(inputs, targets)`` int64 tensors of shape [B, T]; outputs are logits [B, T, vocab].
    Modules are built in ``configure_model`` so a strategy can create them on the meta device.
    """

    independent_samples = True  # attention and LayerNorm stay within a sample: batched passes are exact

    def __init__(
        self,
        config: GPTConfig | dict | str = "tiny",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps: int | None = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.config = GPTConfig.from_any(config)
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), e.g. (0.9, 0.95); got {betas!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps <= warmup_steps):
            raise ValueError(
                f"max_steps must be None (no decay) or an integer > warmup_steps={warmup_steps}, got {max_steps!r}"
            )
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.save_hyperparameters()
        # Store the config as a plain dict so checkpoints reload without unpickling a custom class.
        self.hparams["config"] = dataclasses.asdict(self.config)
        self.hparams["betas"] = tuple(betas)
        # Created here (not in configure_model) so validation can rely on it whatever the build path.
        self.val_perplexity = Perplexity()

    # ------------------------------------------------------------------ building
    def configure_model(self) -> None:
        if getattr(self, "blocks", None) is not None:
            return  # already built: Lightning and the strategy may both call this
        cfg = self.config
        # Where the caller wants the weights: "meta" under greedysnake (it materializes them unit by
        # unit), the CPU or GPU otherwise.
        target = torch.empty(0).device
        # Always construct on meta: the layers' default constructors would otherwise draw random
        # numbers, and the seeded result would differ from the strategy's unit-by-unit init.
        # Registration order matters: the strategy walks modules in this order when it materializes
        # and initialises them, and it must match self.apply(self.init_module_weights).
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.context_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if target.type != "meta":
            for child in (self.wte, self.wpe, self.blocks, self.ln_f, self.lm_head):
                child.to_empty(device=target)
        if cfg.tied_head:
            # Tie after to_empty: it gives each module its own new tensor, which would untie them.
            self.lm_head.weight = self.wte.weight
        # nn.init on meta tensors does nothing and draws no random numbers, so this is safe there too.
        self.apply(self.init_module_weights)

    def init_module_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if isinstance(module, ResidualProjection):
                # GPT-2: the residual stream receives 2 writes per layer; scale so its variance stays O(1).
                std = 0.02 / math.sqrt(2 * self.config.num_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ contract
    def pre_stage(self, batch: Any) -> Tensor:
        inputs = batch[0]
        time = inputs.shape[-1]
        if time > self.config.context_len:
            raise ValueError(
                f"sequence length {time} exceeds GPTConfig.context_len={self.config.context_len}; "
                "shorten the data module's context_len or enlarge the model's"
            )
        positions = torch.arange(time, device=inputs.device)
        return self.drop(self.wte(inputs) + self.wpe(positions))

    def post_stage(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden))

    def compute_loss(self, outputs: Tensor, batch: Any) -> Tensor:
        targets = batch[1]
        # Float32 softmax: under bf16/fp16 autocast the log-sum-exp over 50k logits loses precision.
        return F.cross_entropy(outputs.float().reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits = self(batch)
        loss = self.compute_loss(logits, batch)
        self.val_perplexity.update(logits.float(), batch[1])
        self.log("val_loss", loss, prog_bar=True)
        # Logging the metric object makes Lightning compute it over the whole epoch, then reset it.
        self.log("val_ppl", self.val_perplexity)
        return loss

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        # named_parameters() yields a tied weight once, so it lands in exactly one group.
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]  # matmul weights and embeddings
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm gains
        # torch's fused kernel when the parameters are real (plain Lightning); on the meta device (under
        # greedysnake, which only reads the hyper-parameters and steps with its own fused kernel) the
        # fused flag would be refused.
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            fused=fused or None,
        )
        if hp.warmup_steps == 0 and hp.max_steps is None:
            return optimizer
        schedule = WarmupCosineSchedule(hp.warmup_steps, hp.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ accounting
    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B style:

            6 * N_matmul + 12 * num_layers * d_model * seq_len

        N_matmul counts the block parameters (their LayerNorm gains and biases are well under 1% and kept
        for simplicity; of a mixture of experts, the active ones: the router and ``experts_per_token``
        experts) plus the LM-head weight (vocab x d). The head is counted even when tied, because the d x vocab matmul runs either
        way; the token/position embeddings are lookups and cost no FLOPs. The second term is the
        attention score (QK^T) and weighted-sum (AV) matmuls, 2 * 2 * seq_len * d_model per layer in
        the forward pass, times 3 for forward + backward, at full (non-causal-discounted) length.
        ``seq_len`` defaults to ``context_len``.
        """
        cfg = self.config
        seq_len = cfg.context_len if seq_len is None else seq_len
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        n_matmul = cfg.num_layers * cfg.block_params(active=True) + cfg.vocab_size * cfg.d_model
        return 6 * n_matmul + 12 * cfg.num_layers * cfg.d_model * seq_len
