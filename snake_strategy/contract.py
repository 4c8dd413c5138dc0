"""The layered-model contract: what a module must declare so the strategy can stream it, the checks of
what its stages return, the Trainer and DataLoader settings a fit refuses, and the splitting of a batch
into micro-batches. No Lightning import (the Trainer and loader are read by attribute).

The strategy never calls a monolithic ``forward`` during training. It drives the model stage by stage:

    batch --pre_stage--> hidden [, side] --blocks[0](hidden, **side)--> ... --> hidden --post_stage--> outputs
    outputs, batch --compute_loss--> scalar loss (mean over the micro-batch)

``pre_stage`` and ``post_stage`` (embedding, final norm, head) are "non-layer" parameters that stay on
the device; the ``blocks`` are the offloaded part. ``pre_stage`` may also return side inputs, a dict of
keyword arguments every block receives (rotary tables, attention masks, position ids): computed once per
micro-batch, kept for the recompute, never offloaded. Every block maps a hidden tensor to a hidden
tensor of the same shape, has no buffers, and keeps no state between calls (the strategy re-runs blocks
to recompute activations).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

CONTRACT_DOC = (
    "A LightningModule trained with strategy='greedysnake' must declare its layers: "
    "`blocks` (an nn.ModuleList of blocks, hidden -> hidden), `pre_stage(batch) -> hidden` or "
    "`(hidden, side_inputs_dict)` (the embedding), `post_stage(hidden) -> outputs` (final norm + head) and "
    "`compute_loss(outputs, batch) -> scalar`. Subclass snake_strategy.LayeredModule to get "
    "forward/training_step/validation_step for free (see docs/guide/model-contract.md)."
)


def contract_violations(module: nn.Module) -> list[str]:
    """Return a human-readable list of what ``module`` lacks to follow the contract (empty if it follows it)."""
    problems = []
    blocks = getattr(module, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        problems.append("attribute `blocks` must be an nn.ModuleList of the repeated layers "
                        f"(found {type(blocks).__name__})")
    elif len(blocks) == 0:
        problems.append("`blocks` is empty: build the layers in __init__ or configure_model()")
    for name in ("pre_stage", "post_stage", "compute_loss"):
        if not callable(getattr(module, name, None)):
            problems.append(f"method `{name}` is missing")
    return problems


def check_contract(module: nn.Module) -> None:
    """Raise ValueError that names every missing piece if ``module`` does not follow the contract."""
    problems = contract_violations(module)
    if problems:
        raise ValueError(
            f"{type(module).__name__} does not follow the layered-model contract: "
            + "; ".join(problems) + ". " + CONTRACT_DOC
        )


def unpack_pre_stage(out: Any) -> tuple[Tensor, dict[str, Any]]:
    """``pre_stage``'s return value as (hidden, side inputs), checked."""
    if isinstance(out, Tensor):
        return out, {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor) and isinstance(out[1], Mapping):
        side = dict(out[1])
        trained = [k for k, v in side.items()
                   if any(t.requires_grad for t in batch_tensors(v))]
        if trained:
            raise ValueError(f"pre_stage returned side inputs {trained} that require grad; side inputs are not "
                             "trained through (compute them from buffers or the batch, or .detach() them)")
        return out[0], side
    raise ValueError(f"pre_stage must return the hidden Tensor or a tuple (hidden, dict of side inputs); it returned "
                     f"{_describe(out)}")


def check_not_empty(batch: Any, batch_idx: int | None, module: Any) -> None:
    """Refuse a training batch of 0 samples by its index (and ``module.trainer``'s epoch), before the
    engine touches the step. Refused, not skipped: a skipped step would put
    global_step, LR schedules and checkpoint cadence one off the loader (and, with several ranks, leave
    the others waiting in a collective); nothing of the step has run, checkpoints saved so far stand."""
    if batch_size(batch) == 0:
        raise ValueError(f"training batch {batch_idx} of epoch {module.trainer.current_epoch} holds 0 samples; "
                         "strategy='greedysnake' cannot take an optimizer step on an empty batch. Remove empty "
                         "batches in the DataLoader (a filtering collate_fn or sampler), or set drop_last=True "
                         "when a last partial batch comes out empty")


def check_fit_settings(trainer: Any, module: Any) -> tuple[str, float] | None:
    """Refuse the Trainer and module settings of a fit that the strategy cannot honour; return the gradient
    clipping it applies itself: ``(algorithm, value)``, or None."""
    if not module.automatic_optimization:
        raise ValueError("strategy='greedysnake' runs the backward itself and needs automatic optimization; "
                         "remove `self.automatic_optimization = False` from the LightningModule")
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not used with "
            "strategy='greedysnake': one Lightning batch is one optimizer step, split into "
            "schedule.num_micro_batches micro-batches. Set accumulate_grad_batches=1 and make the "
            "DataLoader batch size the global batch (micro-batch size x num_micro_batches)"
        )
    if not trainer.gradient_clip_val:
        return None
    algorithm = str(trainer.gradient_clip_algorithm or "norm").lower().split(".")[-1]
    if algorithm not in ("norm", "value"):
        raise ValueError(f"Trainer(gradient_clip_algorithm='{algorithm}') is not supported by "
                         "strategy='greedysnake'; use 'norm' or 'value'")
    return algorithm, float(trainer.gradient_clip_val)


def loader_batch_size(loader: Any, num_micro_batches: int) -> int | None:
    """The global batch size a training DataLoader declares (None when it declares none, e.g. a batch
    sampler), refused before step 1 when it can never split into ``num_micro_batches`` equal micro-batches.
    Known up front, it lets a short last batch be recognised as such."""
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int):
        return None
    if size % num_micro_batches:
        raise ValueError(
            f"DataLoader batch_size={size} does not split into schedule.num_micro_batches="
            f"{num_micro_batches} equal micro-batches; make it a multiple of "
            f"{num_micro_batches} (micro-batch size x num_micro_batches)")
    return size


def _meta(t: Tensor) -> Tensor:
    return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def nonlayer_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The parameters and buffers outside ``module.blocks`` (embedding, final norm, head), by name."""
    block_ids = {id(t) for t in (*module.blocks.parameters(), *module.blocks.buffers())}
    return {n: t for n, t in (*module.named_parameters(), *module.named_buffers()) if id(t) not in block_ids}


def meta_pre_stage(module: nn.Module, micro_batch: Any) -> tuple[Tensor, dict[str, Any]] | None:
    """``pre_stage`` of a micro-batch on meta copies of it and of the non-layer parameters (no FLOP, no
    memory): the hidden state's shape and dtype (one activation checkpoint) and the side inputs; None when
    the model cannot run on the meta device. The contract's own refusals of what it returns propagate."""

    class _PreStage(nn.Module):  # functional_call calls forward: this forward is pre_stage
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, batch: Any) -> Any:
            return self.inner.pre_stage(batch)

    nonlayer = {f"inner.{n}": _meta(t) for n, t in nonlayer_tensors(module).items()}
    batch = apply_to_collection(micro_batch, Tensor, lambda t: t.to("meta"))
    try:
        out = torch.func.functional_call(_PreStage(), nonlayer, (batch,))
    except Exception:  # noqa: BLE001 - not runnable on meta: the first batch checks the same contract
        return None
    return unpack_pre_stage(out)


def micro_batch_tokens(micro_batch: Any) -> int:
    """Tokens of a micro-batch: its largest integer tensor (the token ids), else its first tensor's rows."""
    tensors = batch_tensors(micro_batch)
    return max((t.numel() for t in tensors if not t.is_floating_point()), default=0) or tensors[0].shape[0]


def head_linears(module: nn.Module) -> list[nn.Linear]:
    """The output projections: the Linear layers outside the blocks (their matmul runs for every token)."""
    block_ids = {id(p) for p in module.blocks.parameters()}
    return [m for m in module.modules() if isinstance(m, nn.Linear) and id(m.weight) not in block_ids]


def head_params(module: nn.Module) -> int:
    """Parameters of the output projections (a tied weight once)."""
    return sum({id(m.weight): m.weight.numel() for m in head_linears(module)}.values())


def loss_head_bytes(module: nn.Module, micro_batch: Any) -> int:
    """The loss head's output of one micro-batch, fp32 (the loss is taken in fp32): what the host plan counts."""
    return micro_batch_tokens(micro_batch) * sum(m.out_features for m in head_linears(module)) * 4


def checkpoint_bytes_from_shapes(module: nn.Module, micro_batch: Any) -> int:
    """Bytes of one activation checkpoint (a unit input) of ``micro_batch``, from ``pre_stage`` on meta copies
    (0 when the model cannot run on the meta device)."""
    staged = meta_pre_stage(module, micro_batch)
    return 0 if staged is None else staged[0].numel() * staged[0].element_size()


def check_outputs_on_meta(module: nn.Module, batch: Any, num_micro_batches: int) -> bool:
    """Run ``pre_stage`` and every block once on meta copies of the first micro-batch of ``batch`` and of
    the parameters (no FLOP, no memory) and check what they return, so a tuple-returning block or a
    malformed ``pre_stage`` is refused at setup, before any weight is materialized. Best effort: no batch
    (None), one that never splits (refused later by the check that names it), or a model that cannot run
    on the meta device (a kernel without a meta implementation, a table built on the CPU inside
    ``pre_stage``) is left to the same checks at the first batch. Returns whether the check ran."""
    if batch is None:
        return False
    try:
        micro_batch = split_micro_batches(batch, num_micro_batches)[0]
    except ValueError:
        return False
    staged = meta_pre_stage(module, micro_batch)
    if staged is None:
        return False
    hidden, side = staged
    for i, block in enumerate(module.blocks):
        tensors = {n: _meta(t) for n, t in (*block.named_parameters(), *block.named_buffers())}
        try:
            out = torch.func.functional_call(block, tensors, (hidden,), side)
        except Exception:  # noqa: BLE001 - as above
            return False
        out = check_block_output(out, i, reads_block_outputs(module))
        hidden = out[0] if isinstance(out, tuple) else out
    return True


def reads_block_outputs(module: Any) -> bool:
    """Whether ``module``'s loss reads an output of every block besides the hidden state (``LayeredModule.
    loss_reads_block_outputs``): each block then returns ``(hidden, output)``."""
    return bool(getattr(module, "loss_reads_block_outputs", False))


def check_block_output(out: Any, block_index: int, with_output: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """A block's return value, checked: the hidden Tensor, or with ``with_output`` the pair ``(hidden,
    output)`` whose output has the micro-batch's samples as dim 0 (it is cut per micro-batch like hidden)."""
    if not with_output:
        if not isinstance(out, Tensor):
            raise ValueError(f"blocks[{block_index}] returned {_describe(out)}; every block must return the hidden "
                             "Tensor alone (wrap layers that return tuples, e.g. `return layer(x, **kw)[0]`), or "
                             "the module sets loss_reads_block_outputs = True and every block returns (hidden, "
                             "output)")
        return out
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
        raise ValueError(f"blocks[{block_index}] returned {_describe(out)}; with loss_reads_block_outputs = True "
                         "every block returns (hidden, output), two Tensors")
    hidden, output = out
    if output.dim() == 0 or output.shape[0] != hidden.shape[0]:
        raise ValueError(f"blocks[{block_index}] returned an output of shape {tuple(output.shape)} for a hidden state "
                         f"of {hidden.shape[0]} samples; a block's output for the loss has the samples as dim 0 "
                         "(the strategy cuts it per micro-batch, as the hidden state)")
    return out


def stack_side_inputs(sides: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """One side-input dict for a batched pass over micro-batches of ``sizes`` samples.

    Tensors whose dim 0 is the micro-batch size are per-sample and get concatenated; anything else must
    be the same object or equal in every micro-batch (e.g. a shared rotary table) and is passed once.
    """
    if len(sides) == 1:
        return sides[0]
    keys = set(sides[0])
    if any(set(s) != keys for s in sides):
        raise ValueError("pre_stage returned different side-input keys for different micro-batches")

    def merge(values: list[Any], key: str) -> Any:
        first = values[0]
        if isinstance(first, Tensor):
            if first.dim() and all(v.shape[0] == n for v, n in zip(values, sizes)):
                return torch.cat(values)
            if all(v is first or (v.shape == first.shape and torch.equal(v, first)) for v in values):
                return first
            raise ValueError(f"side input '{key}' differs between micro-batches but is not per-sample (dim 0 "
                             "is not the micro-batch size); a batched pass cannot combine it")
        if isinstance(first, (tuple, list)):
            return type(first)(merge([v[i] for v in values], key) for i in range(len(first)))
        if all(v == first for v in values):
            return first
        raise ValueError(f"side input '{key}' differs between micro-batches; a batched pass cannot combine it")

    return {k: merge([s[k] for s in sides], k) for k in sides[0]}


def split_micro_batches(batch: Any, num_micro_batches: int) -> list[Any]:
    """Split a (nested) batch along dim 0 into ``num_micro_batches`` equal micro-batches.

    Tensors are sliced; lists/tuples of non-tensors whose length is the batch size (string ids, say) are
    per-sample and sliced with them; other non-tensor values (scalars, None) go to every micro-batch.
    """
    size = batch_size(batch)
    if size % num_micro_batches != 0:
        raise ValueError(
            f"global batch of {size} samples does not split into schedule.num_micro_batches="
            f"{num_micro_batches} equal micro-batches; make the DataLoader batch_size a multiple of "
            f"{num_micro_batches} (micro-batch size x num_micro_batches)"
        )
    step = size // num_micro_batches
    return [_slice(batch, i * step, (i + 1) * step, size, "batch") for i in range(num_micro_batches)]


def slice_batch(batch: Any, lo: int, hi: int) -> Any:
    """Samples [lo, hi) of a (nested) batch, split the way ``split_micro_batches`` splits it."""
    return _slice(batch, lo, hi, batch_size(batch), "batch")


def batch_size(batch: Any) -> int:
    """The common dim 0 of every tensor in a batch (ValueError when they disagree or there are none)."""
    sizes = {t.shape[0] for t in batch_tensors(batch) if t.dim()}
    if not sizes:
        raise ValueError("the batch holds no tensors to split into micro-batches")
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on dim 0 (sizes {sorted(sizes)}); cannot split into micro-batches")
    return sizes.pop()


def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in a (nested) batch, in order."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def _slice(value: Any, lo: int, hi: int, size: int, where: str) -> Any:
    if isinstance(value, Tensor):
        return value[lo:hi] if value.dim() else value
    if isinstance(value, Mapping):
        return type(value)({k: _slice(v, lo, hi, size, f"{where}['{k}']") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        if value and not any(batch_tensors(v) for v in value):
            # A per-sample list (ids, strings): it must have one entry per sample to be split.
            if len(value) != size:
                raise ValueError(f"{where} is a list of {len(value)} non-tensor values in a batch of {size} samples; "
                                 "per-sample lists must have one entry per sample (or make it a tensor)")
            return value[lo:hi]
        items = [_slice(v, lo, hi, size, f"{where}[{i}]") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in value]}"
    return f"a {type(value).__name__}"


def check_trainable(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Refuse what the engine cannot train exactly; return id(parameter) -> optimizer param-group index."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    # Frozen parameters (requires_grad=False) are only ever read: they need no optimizer group.
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("every parameter has requires_grad=False: there is nothing to train. Unfreeze some "
                         "parameters (or add adapters, e.g. peft.get_peft_model) before Trainer.fit")
    missing = [n for n, p in trainable if id(p) not in group_of]
    if missing:
        raise ValueError(f"parameters {missing} are not in the optimizer; configure_optimizers must cover every "
                         "parameter with requires_grad=True (or freeze them with requires_grad_(False))")
    for i, block in enumerate(module.blocks):
        for mod_name, mod in block.named_modules():
            persistent = [b for b in mod._buffers if b not in mod._non_persistent_buffers_set and mod._buffers[b] is not None]
            if persistent:
                where = f"blocks[{i}]{'.' + mod_name if mod_name else ''}"
                raise ValueError(
                    f"{where} has buffers {persistent}: blocks must keep no state. Buffers that change in forward "
                    "(BatchNorm running statistics) would be updated twice per micro-batch by the recompute. Use "
                    "LayerNorm/GroupNorm, or register constant tables with persistent=False")
    return group_of
