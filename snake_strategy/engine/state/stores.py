"""The training state the engine owns: per-unit tiered tensors and the non-layer parameters' optimizer state.

Each object owns its tensors and knows how to step, save and restore itself; the step runner and the
optimizer overlap only call these methods.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from snake_strategy.engine.state.half_weights import checked
from snake_strategy.optimizers.kind import slot_span
from snake_strategy.optimizers.spec import OptimizerSpec
from snake_strategy.optimizers.stepping import ShadowOptimizer
from snake_strategy.precision import DtypePolicy
from snake_strategy.storage import TieredTensor
from snake_strategy.storage.io_engine import Ticket
from snake_strategy.units import UnitLayout, WeightFormat, named_tensors


@dataclass
class UnitStore:
    """Every offloaded state of one unit."""

    layout: UnitLayout
    weights: TieredTensor
    master: TieredTensor  # the same object as ``weights`` when the compute dtype is the master dtype
    # The optimizer's state by slot name (optimizers/spec.py: ``exp_avg``, ``momentum_buffer``, ``state1`` ...).
    state: dict[str, TieredTensor]
    grads: TieredTensor
    forward_end: int  # forward part = [0, forward_end), backward part = [forward_end, train_end): the alpha cut
    # Half-precision weight storage (mixed precision, engine/state/half_weights.py): the layout of ``weights``
    # and the full-precision tail; None when ``weights`` holds the layout's elements in one dtype.
    fmt: WeightFormat | None = None
    tail: TieredTensor | None = None
    checked: bool = False  # the half-stored weights' first forward has been checked
    # Optimizers stepped per tensor: per slot, where each trainable parameter's piece starts in it (page
    # aligned); a slot not listed is indexed like the unit's elements (element-wise state).
    slot_offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Partitioned optimizer state (engine/parallel/partition.py): the elements [lo, hi) this rank steps and
    # keeps the state of; None: all trainable ones. Kept here, not read off a slot: an optimizer may keep none.
    shard: tuple[int, int] | None = None

    def slot_range(self, name: str, lo: int, hi: int) -> tuple[int, int]:
        """The elements of slot ``name`` that hold the state of unit elements [lo, hi) (parameter bounds
        when the slot is per tensor)."""
        offsets = self.slot_offsets.get(name)
        if offsets is None:
            return lo, hi
        return slot_span(offsets, self.state[name].numel, self.layout, lo, hi)

    @property
    def train_end(self) -> int:
        """[0, train_end): the elements with a master copy, moments and gradients; the rest is frozen."""
        return self.layout.train_end

    @property
    def buffer_numel(self) -> int:
        """Elements (of ``weights.dtype``) of a working buffer that holds this unit's compute weights."""
        return self.fmt.buffer_numel if self.fmt is not None else self.weights.numel

    def leaves(self, main: Tensor, tail: Tensor | None) -> list[Tensor]:
        """One grad-ready leaf per parameter, views into the fetched main vector (and tail)."""
        if self.fmt is None:
            return self.layout.leaves(main)
        return self.fmt.leaves(self.layout, main, tail)

    def forward(self, params: list[Tensor] | Tensor, hidden: Tensor, side: dict | None,
                check: Callable[[object, int], object] | None = None, outputs: list[Tensor] | None = None) -> Tensor:
        """The unit's blocks on ``hidden`` (``UnitLayout.forward``). The first run of half-stored weights is
        watched (UseCheck): a weight reaching an op autocast keeps in full precision is refused before any update."""
        if self.fmt is None or self.checked:
            return self.layout.forward(params, hidden, side, check, outputs)
        assert isinstance(params, list), "half-stored weights come as leaves"
        names = [(f"blocks.{self.layout.first_block + s.block}.{s.name}", p)
                 for s, half, p in zip(self.layout.slots, self.fmt.half, params) if half]
        with checked(names, self.fmt.dtype, hidden.device.type):
            out = self.layout.forward(params, hidden, side, check, outputs)
        self.checked = True
        return out

    def start_refresh(self, master: Tensor, lo: int, hi: int, scratch: Tensor) -> list[Ticket]:
        """Write the compute copy of elements [lo, hi) from their updated master values (separate master
        only): rounded into ``scratch`` (the main vector's dtype), plus the tail's full-precision pieces."""
        compute = scratch[:hi - lo]
        compute.copy_(master)
        tickets = [self.weights.start_evict(compute, lo, hi)]
        if self.fmt is not None:
            for offset, numel, t in self.fmt.tail_pieces:
                a, b = max(lo, offset), min(hi, offset + numel)
                if a < b:
                    tickets.append(self.tail.start_evict(master[a - lo:b - lo], t + a - offset, t + b - offset))
        return tickets

    def store_weights(self, flat: Tensor) -> None:
        """Put a unit's full-precision flat vector into the compute-weight stores (materialization)."""
        if self.fmt is None:
            self.weights.evict(flat.to(self.weights.dtype))
            return
        main, tail = self.fmt.store(flat)
        self.weights.evict(main)
        self.tail.evict(tail)

    def load_trainable_weights(self, values: Tensor) -> None:
        """Refresh the compute copy of [0, train_end) from full-precision values (a separate master only)."""
        t = self.train_end
        self.weights.evict(values.to(self.weights.dtype), 0, t)
        if self.fmt is not None:
            self.tail.evict(self.fmt.tail_values(values))

    def read_frozen(self) -> Tensor:
        """The frozen elements [train_end, numel) as stored (the compute dtype), a fresh CPU copy."""
        lo, hi = (self.train_end, self.layout.numel) if self.fmt is None else self.fmt.frozen_range()
        if hi == lo:
            return torch.empty(0, dtype=self.weights.dtype if self.fmt is None else self.fmt.full)
        flat = self.weights.fetch(self.weights.new_buffer(hi - lo), lo, hi).cpu()
        return flat if self.fmt is None else flat.view(self.fmt.full)

    def storage_bytes(self) -> dict[str, int]:
        """Elements, the end of the forward part, and the bytes each state keeps on the SSD (and the weights on
        the host)."""
        w = self.weights
        return {"numel": self.layout.numel, "train_end": self.train_end, "forward_end": self.forward_end,
                "weights_ssd": w.ssd_bytes, "weights_host": (w.host_end - w.device_end) * w.elem_bytes,
                "weights_is_master": self.weights is self.master, "master_ssd": self.master.ssd_bytes,
                "grads_ssd": self.grads.ssd_bytes, **{f"{name}_ssd": t.ssd_bytes for name, t in self.state.items()}}

    @property
    def frozen_dtype(self) -> torch.dtype:
        """The dtype frozen parameters are stored and given back in (``read_frozen``)."""
        return self.weights.dtype if self.fmt is None else self.fmt.full

    def named_values(self, blocks_prefix: str) -> dict[str, Tensor]:
        """The unit's parameters by module name (fresh CPU copies): trainable ones from the master copy,
        frozen ones as stored (their only copy)."""
        t = self.train_end
        views = {**named_tensors(self.master.read_copy(0, t), self.layout.slot_rows(blocks_prefix, trainable=True)),
                 **named_tensors(self.read_frozen(), self.layout.slot_rows(blocks_prefix, trainable=False), base=t)}
        # Copies, not views of the unit's vector: a saved view would carry the whole vector's storage.
        return {name: value.clone() for name, value in views.items()}

    def value_specs(self, blocks_prefix: str) -> list[tuple[str, torch.dtype, torch.Size]]:
        """(module name, dtype, shape) of what ``named_values`` returns, in its order, without reading it."""
        return [(name, dtype, torch.Size(s.shape)) for trainable, dtype in ((True, self.master.dtype),
                                                                          (False, self.frozen_dtype))
                for name, s in self.layout.named_slots(blocks_prefix, trainable)]


class NonLayerState:
    """The embedding/head parameters (``pre_stage``/``post_stage``): on the device, stepped in place.

    ``params`` are the module's own trainable Parameter objects (in the compute dtype); ``master`` is a
    separate fp32 copy only when the compute dtype differs (bf16-true); the optimizer state and gradients
    are in the master dtype. ``frozen`` ones (requires_grad=False) are only converted to the compute dtype:
    no master copy, no optimizer state, no gradient. ``used`` marks the parameters that received a gradient
    this step (an unused one is not stepped, as torch's optimizers skip parameters whose ``grad`` is None).
    Each parameter's state is the dict the optimizer's kind keeps for a whole tensor (``states``; torch's own
    layout, the step count included), stepped by the kind as the units' state is (``StepKind.step_params``).
    """

    def __init__(self, names: list[str], params: list[nn.Parameter], groups: list[int], dtypes: DtypePolicy,
                 spec: OptimizerSpec, optimizer: torch.optim.Optimizer,
                 frozen: list[tuple[str, nn.Parameter]] = ()) -> None:
        self.names, self.params, self.groups = names, params, groups
        self.frozen_names, self.frozen = [n for n, _ in frozen], [p for _, p in frozen]
        for p in self.frozen:
            if p.dtype != dtypes.compute:
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtypes.compute), requires_grad=False))
        self.master = [p if p.dtype == dtypes.master and dtypes.compute == dtypes.master
                       else p.detach().to(dtypes.master, copy=True) for p in params]
        for p in params:
            if p.dtype != dtypes.compute:
                # swap_tensors keeps the Parameter object that the optimizer and tied modules refer to.
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtypes.compute), p.requires_grad))
        self.kind = spec.kind
        self.shadow = None if self.kind.own_kernel else ShadowOptimizer(optimizer)  # the context kinds step in
        self.states: list[dict[str, Any] | None] = [self.kind.initial_state(m) for m in self.master]
        self.grads = [torch.zeros_like(m) for m in self.master]
        self.used = [False] * len(params)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        """Bytes a checkpoint holds of this state: the master weights and the optimizer's tensors."""
        scalars = [v for s in self.states if s for v in s.values() if isinstance(v, Tensor) and v.dim() == 0]
        return sum(t.numel() * t.element_size() for t in [*self.master, *scalars]) + self.state_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (a parameter not yet stepped by a class that creates its state
        at the first step holds none yet); its scalars (``step``, even as a 0-d tensor) are a few bytes, not
        counted, as the units' scalars are not."""
        tensors = [v for s in self.states if s for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors)

    def zero_grads(self) -> None:
        for g in self.grads:
            g.zero_()
        self.used = [False] * len(self.params)

    def accumulate(self, grads: tuple[Tensor | None, ...]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.grads[i].add_(g)
                self.used[i] = True

    def used_grads(self) -> list[Tensor]:
        return [g for g, used in zip(self.grads, self.used) if used]

    @torch.no_grad()
    def step(self, hps: list[dict[str, Any]]) -> None:
        for group, hp in enumerate(hps):
            idx = [i for i, g in enumerate(self.groups) if g == group and self.used[i]]
            if not idx:
                continue
            after = self.kind.step_params(self, hp, [self.master[i] for i in idx], [self.grads[i] for i in idx],
                                          [self.states[i] for i in idx])
            for i, state in zip(idx, after):
                self.states[i] = state
                if self.params[i] is not self.master[i]:
                    self.params[i].copy_(self.master[i])

    def state_dict(self) -> dict[str, Any]:
        """The master weights and optimizer state on the CPU, for checkpoints: the live tensors themselves
        on a CPU run (a save writes them before training goes on: no copy, 1.2 GB for gpt_1b), copies from
        a GPU. The kind's state vectors (Adam's moments) as lists beside the master weights, with the step
        counts; any other state as each parameter's dict."""
        def cpu(tensors: list[Tensor]) -> list[Tensor]:
            return [t.detach().cpu() for t in tensors]

        out = {"names": list(self.names), "master": cpu(self.master)}
        if self.kind.nonlayer_vectors:
            out.update({key: cpu([s[key] for s in self.states]) for key in self.kind.nonlayer_vectors})
            out["steps"] = [int(s["step"]) for s in self.states]
            return out
        out["optimizer_states"] = [None if s is None else {k: v.detach().cpu() if isinstance(v, Tensor) else v
                                                           for k, v in s.items()} for s in self.states]
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["names"] != self.names:
            raise ValueError(f"checkpoint non-layer parameters {state['names']} do not match the model's {self.names}")
        for i, p in enumerate(self.params):
            self.master[i].copy_(state["master"][i])
            if "optimizer_states" in state:
                saved = state["optimizer_states"][i]
                self.states[i] = None if saved is None else {
                    k: v.to(self.master[i].device) if isinstance(v, Tensor) else v for k, v in saved.items()}
            else:
                # A checkpoint without per-parameter counts stepped every parameter at every step.
                steps = int(state["steps"][i]) if "steps" in state else int(state.get("step_count", 0))
                vectors = [key for key in ("exp_avg", "exp_avg_sq") if key in state]
                self.states[i] = {"step": steps, **{k: state[k][i].to(self.master[i].device).clone() for k in vectors}}
            if p is not self.master[i]:
                p.copy_(self.master[i])
