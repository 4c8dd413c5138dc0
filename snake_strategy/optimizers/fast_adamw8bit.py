"""``FastAdamW8bit``: AdamW with 8-bit moments (2.03 B/param) whose host step is one compiled kernel.

bitsandbytes' blockwise dynamic code finds each value's 8-bit code by a search over 256 map values, and that
search is what makes ``FusedAdamW8bit`` step ~60 M params/s per core. This class keeps one scale per block
of 256 values but uses codes that are arithmetic to encode:

- the first moment, linear: ``m = code * absmax / 127`` (int8, round to nearest), ``absmax`` the block's
  largest ``|m|`` after the step;
- the second moment, linear in its square root (the quantity Adam divides by): ``sqrt(v) = code *
  root_max / 255`` (uint8), rounded *up*, ``root_max`` the block's largest ``sqrt(v)``, so a stored
  denominator is never smaller than the true one and a small ``v`` never rounds to zero under a nonzero
  ``m`` (which would step by ``m / eps``).

One step of a parameter dequantizes both moments, runs the AdamW update in fp32 and requantizes against the
new block maxima in a single pass over memory: ``torch.compile`` turns ``_step_rows`` into one loop per block
(the maxima, then the codes and the parameter), compiled once per process for every row count (rows are a
dynamic dimension) and cached on disk by inductor. Where no C++ compiler is found the same function runs
eagerly (slower, and its last bits may differ from the compiled kernel's; the choice is made once per
process, so two runs in one process always agree). Measured in benchmarks/lowbit_step.py (against torch's
fused AdamW, taking turns) and benchmarks/optimizer_kernels.py.

Its math is its own: neither bitsandbytes' nor torchao's AdamW8bit. greedysnake never substitutes it for
the user's class; a user returns it from ``configure_optimizers`` and plain Lightning trains it the same way
(greedysnake steps it whole tensor by whole tensor, the per-tensor kind). Tensors under ``min_8bit_size``
elements keep fp32 moments and step with torch's fused AdamW.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam

BLOCK = 256  # values per scale
M_LEVELS = 127.0  # int8 codes -127..127
V_LEVELS = 255.0  # uint8 codes 0..255
_TINY = 1e-30  # a block of zeros keeps scale 0 without dividing by it
# Rows per kernel call: its new codes (2 x 1 MiB) are copied into the state while still in cache, and
# allocations of that size are recycled by malloc (whole-parameter outputs would be fresh pages every step,
# whose page faults cost about half the step).
CHUNK_ROWS = 4096


def _step_rows(p: Tensor, g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor, v_root_max: Tensor,
               hp: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One AdamW step of ``p`` ([rows, BLOCK], updated in place) with gradient ``g``; returns the new
    (m codes, m absmax, v codes, v root max). ``m_absmax`` / ``v_root_max`` are [rows, 1]; ``hp`` holds
    (1 - lr * weight_decay, beta1 / 127, 1 - beta1, beta2, 1 - beta2, lr / bias_correction1,
    1 / sqrt(bias_correction2), eps). Everything is computed in ``p``'s dtype.

    The per-block scalars are what the kernel's inner loop recomputes for every 16 values (its code stores
    may alias any input, so the compiler cannot hoist them): they are kept free of divisions and square
    roots on the decode side (beta1 / 127 comes in ``hp``; the second moment's scale is kept as the root of
    its maximum, which is the maximum of its roots), which is ~20% of the step."""
    decay, m_decode, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps = hp.unbind()
    m = m_codes.to(p.dtype) * (m_absmax * m_decode) + one_minus_beta1 * g
    root_v = v_codes.to(p.dtype) * (v_root_max * (1.0 / V_LEVELS))
    v = beta2 * (root_v * root_v) + one_minus_beta2 * (g * g)
    root_v = torch.sqrt(v)
    p.copy_(p * decay - step_size * m / (root_v * inv_sqrt_bc2 + eps))
    m_absmax = m.abs().amax(dim=1, keepdim=True)
    v_root_max = root_v.amax(dim=1, keepdim=True)
    m_codes = torch.round(m * (M_LEVELS / torch.clamp(m_absmax, min=_TINY))).to(torch.int8)
    # The block's largest value lands on 255 up to rounding: the clamp keeps a 255.00001 from wrapping to 0.
    v_codes = torch.ceil(torch.clamp(root_v * (V_LEVELS / torch.clamp(v_root_max, min=_TINY)), max=V_LEVELS))
    v_codes = v_codes.to(torch.uint8)
    return m_codes, m_absmax, v_codes, v_root_max


# Compiler flags for this kernel only: contracting multiply-adds and letting the compiler reassociate cut
# its instructions by ~5%. The last bits then follow the compiled code, which both plain Lightning and
# greedysnake run, so the two still agree bitwise.
COMPILE_OPTIONS = {"cpp.enable_unsafe_math_opt_flag": True, "cpp.enable_floating_point_contract_flag": "fast"}


class _Kernel:
    """``_step_rows`` compiled once per process (or eager where compiling fails, decided at the first call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fn: Any = None
        self.compiled: bool | None = None  # None until the first step

    def __call__(self, *args: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if args[0].is_meta:  # a planner finding the state's layout: shapes only, and no say in compiling
            return _step_rows(*args)
        if self.compiled is None:
            with self._lock:  # the first call compiles; later callers (the engine's worker) reuse it
                if self.compiled is None:
                    self._first_call(args)
                    return self._last
        return self._fn(*args)  # compiled with rows dynamic: any row count reuses it

    def _first_call(self, args: tuple[Tensor, ...]) -> None:
        p_before = args[0].clone()
        try:
            compiled = torch.compile(_step_rows, dynamic=None, fullgraph=True, options=COMPILE_OPTIONS)
        except RuntimeError:  # an inductor without these flags (torch before ~2.6) names them unknown
            compiled = torch.compile(_step_rows, dynamic=None, fullgraph=True)
        for t in args[:-1]:
            torch._dynamo.mark_dynamic(t, 0)
        try:
            self._last = compiled(*args)
            self._fn, self.compiled = compiled, True
        except torch._dynamo.exc.BackendCompilerFailed as error:
            warnings.warn(f"FastAdamW8bit: torch.compile could not build its step ({error.__class__.__name__}: "
                          f"{str(error).splitlines()[0][:200]}); stepping eagerly (same math, slower)")
            args[0].copy_(p_before)
            self._last = _step_rows(*args)
            self._fn, self.compiled = _step_rows, False


KERNEL = _Kernel()


class FastAdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are 8-bit codes plus one fp32 scale per 256 values.

    State of a parameter of ``min_8bit_size`` elements or more: ``exp_avg_codes`` (int8) and ``exp_avg_sq_codes``
    (uint8), [ceil(numel / 256), 256] each; ``exp_avg_absmax`` (the block's largest |m|) and
    ``exp_avg_sq_root_max`` (the block's largest sqrt(v)), fp32, one per block; ``step``. Smaller ones keep
    ``exp_avg`` / ``exp_avg_sq`` in the parameter's dtype. Parameters are fp32 (fp64 also steps, with fp64
    scales: the exactness tests' precision)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096) -> None:
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"FastAdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        if min_8bit_size < BLOCK:
            raise ValueError(f"FastAdamW8bit: min_8bit_size={min_8bit_size} is under one block ({BLOCK} values); "
                             f"pass min_8bit_size >= {BLOCK}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      min_8bit_size=min_8bit_size))
        self.register_load_state_dict_post_hook(_root_of_saved_maxima)

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            small = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in (torch.float32, torch.float64) or p.grad.dtype != p.dtype:
                    raise ValueError(f"FastAdamW8bit steps fp32 parameters, got {p.dtype} (gradient {p.grad.dtype}); "
                                     "keep fp32 weights (Lightning's precision='bf16-mixed' does)")
                if p.numel() < group["min_8bit_size"]:
                    small.append(p)
                else:
                    self._step_8bit(group, p, self.state[p])
            if small:
                self._step_fp32(group, small, [self.state[p] for p in small])
        return loss

    @staticmethod
    def _step_fp32(group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]) -> None:
        """The group's tensors under ``min_8bit_size``, in one call of torch's fused kernel (one call per
        tensor cost ~30 us each: a model's biases and norms would take longer than its matrices)."""
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        functional_adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True,
                        amsgrad=False, beta1=beta1, beta2=beta2, lr=float(group["lr"]),
                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                        decoupled_weight_decay=True)

    @staticmethod
    def _step_8bit(group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        rows = -(-p.numel() // BLOCK)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg_codes"] = torch.zeros(rows, BLOCK, dtype=torch.int8, device=p.device)
            state["exp_avg_absmax"] = torch.zeros(rows, dtype=p.dtype, device=p.device)
            state["exp_avg_sq_codes"] = torch.zeros(rows, BLOCK, dtype=torch.uint8, device=p.device)
            state["exp_avg_sq_root_max"] = torch.zeros(rows, dtype=p.dtype, device=p.device)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        hp = torch.tensor([1 - lr * wd, beta1 / M_LEVELS, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step),
                           1 / math.sqrt(1 - beta2 ** step), group["eps"]], dtype=p.dtype, device=p.device)
        # A non-contiguous parameter steps a contiguous copy; a contiguous one steps in place, its whole blocks
        # directly and a last partial block in a scratch (zeros change no maximum and step to zero). Detached:
        # the compiled kernel would otherwise be guarded on requires_grad and built twice.
        weights = p.detach().contiguous().view(-1)
        grad = p.grad.reshape(-1)
        whole_rows = p.numel() // BLOCK
        states = tuple(state[key].view(rows, -1) for key in _8BIT_KEYS)  # codes [rows, BLOCK], maxima [rows, 1]
        if whole_rows == rows <= CHUNK_ROWS:
            # One kernel call: the state takes its new tensors instead of a copy of them (the copy was ~7% of a
            # 768 x 768 step); the old ones go back to malloc, which hands them to the next step's outputs.
            new = KERNEL(*(_plain(t) for t in (weights.view(rows, BLOCK), grad.view(rows, BLOCK), *states)), hp)
            for key, value in zip(_8BIT_KEYS, new):
                state[key] = value.view(state[key].shape)
        else:
            _step_blocks(weights[:whole_rows * BLOCK].view(whole_rows, BLOCK),
                         grad[:whole_rows * BLOCK].view(whole_rows, BLOCK), [s[:whole_rows] for s in states], hp)
        if whole_rows < rows:
            # Two rows, the second all zeros: a one-row call would compile a second kernel (torch specializes
            # a dimension of size 1).
            tail = p.numel() - whole_rows * BLOCK
            tail_weights, tail_grad = p.new_zeros(2, BLOCK), p.new_zeros(2, BLOCK)
            tail_weights[0, :tail], tail_grad[0, :tail] = weights[whole_rows * BLOCK:], grad[whole_rows * BLOCK:]
            tail_states = [torch.cat([s[whole_rows:], torch.zeros_like(s[whole_rows:])]) for s in states]
            _step_blocks(tail_weights, tail_grad, tail_states, hp)
            weights[whole_rows * BLOCK:] = tail_weights[0, :tail]
            for held, value in zip(states, tail_states):
                held[whole_rows:].copy_(value[:1])
        if not p.is_contiguous():
            p.copy_(weights.view_as(p))


_8BIT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_root_max")  # the kernel's outputs


def _root_of_saved_maxima(optimizer: torch.optim.Optimizer) -> None:
    """A state saved in this class's earlier format holds ``exp_avg_sq_max``, the block's largest v; the
    kernel reads its root (the same block's largest sqrt(v)), so such a state loads and trains on."""
    for state in optimizer.state.values():
        if "exp_avg_sq_max" in state:
            state["exp_avg_sq_root_max"] = state.pop("exp_avg_sq_max").sqrt()


def _step_blocks(weights: Tensor, grad: Tensor, states: list[Tensor], hp: Tensor) -> None:
    """Step ``weights`` ([rows, BLOCK], in place) and write the new codes and maxima into ``states`` (the
    state's rows for them), CHUNK_ROWS rows per kernel call."""
    for a in range(0, weights.shape[0], CHUNK_ROWS):
        b = min(weights.shape[0], a + CHUNK_ROWS)
        new = KERNEL(*(_plain(t[a:b]) for t in (weights, grad, *states)), hp)
        for held, value in zip(states, new):
            held[a:b].copy_(value)


def _plain(view: Tensor) -> Tensor:
    """``view`` as a tensor of its own over the same memory: torch.compile guards a view on its base's storage
    offset, so the slices of one flat buffer (the engine's chunks) would each compile a kernel."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
