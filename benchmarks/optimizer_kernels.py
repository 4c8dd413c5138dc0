"""Which optimizer kernel can step an SSD-offloaded model fast enough: the step throughput of each
optimizer candidate on this CPU, the bytes of state each stores per parameter, whether each honours
state handed to it as views into a bigger flat buffer, and the step time each implies at gpt_1b/gpt_4b.

    python benchmarks/optimizer_kernels.py                          # the whole table (~5-10 min, 2 cores)
    python benchmarks/optimizer_kernels.py --sets matrix --threads 1 --candidates adamw_fused,bnb_adamw8bit

Candidates (``--candidates``, default all):

- ``adamw_fused`` / ``adamw_foreach`` / ``adamw_forloop``: ``torch.optim.AdamW``, fp32 moments (8 B/param);
- ``bnb_adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` (blockwise 8-bit moments, 256-element blocks);
- ``torchao_adamw8bit_eager``: ``torchao.optim.AdamW8bit`` with ``torch.compiler.set_stance("force_eager")``
  (torchao compiles its per-parameter step by default);
- ``torchao_adamw8bit_compiled``: the same under its own ``torch.compile`` (the first step, which
  compiles, is timed apart as ``compile_s``);
- ``byok8_bnb`` / ``byok8_torchao`` / ``byok8_torchao_compiled``: "bring your own kernel": 8-bit blockwise
  moments dequantized chunk by chunk into fp32 scratch, stepped by torch's fused AdamW kernel, quantized
  back (with bitsandbytes' C quantizer, torchao's primitives eager, or those under torch.compile, or
  ``lut_compiled``: torchao's format and rounding found by a 64 Ki-entry table on the float's top 16 bits
  instead of torchao's 8-step binary search, under torch.compile). This is
  not the math of either library's class (different rounding order), so it can only be an opt-in;
- ``sgd_momentum`` (foreach), ``adafactor`` (``torch.optim.Adafactor``), ``muon`` (``torch.optim.Muon``,
  2-D only: timed on a ``--muon-shape`` proxy matrix because Newton-Schulz on 2048-wide matrices takes
  seconds per step on this CPU; its cost per parameter grows with the matrix's smaller side, so the
  implied rows scale the proxy rate by ``proxy_min_side / 2048``).

Parameter sets (``--sets``): ``matrix`` is one 2048x8192 fp32 tensor; ``unit`` is the parameters of one
gpt_1b transformer block (qkv, attention out, MLP in/out, their biases and the LayerNorms).

Per candidate and thread count (``torch.set_num_threads``: 1 is the engine's worker while compute owns the
other core): the median of ``--steps`` timed steps after ``--warmup`` untimed ones, M params/s, state bytes
per parameter as stored (tensor subclasses counted by their inner tensors), and for one parameter the
state's names, dtypes and shapes. The "views" check steps a fresh optimizer whose ``state[p]`` was filled
with views into flat per-dtype buffers after one normal step, and compares parameters and state after
two more steps bitwise with an uninterrupted run. The "drift" is the largest distance of the parameters
from fp32 fused AdamW's after 20 steps, in units of lr * steps.

The disk: ``--disk-gib`` GiB written with write + fsync, then read after ``posix_fadvise(DONTNEED)`` (no
O_DIRECT: the engine's own IO is measured in benchmarks/io_bench.py). The implied step at gpt_1b/gpt_4b
is max(optimizer compute on 1 thread, SSD time) with SSD bytes per parameter read 4 + S + 4 (master, state,
gradient) and written 4 + S + 4 (master, state, weights): every state on the SSD, the byte floor.

Writes ``benchmarks/results/optimizer_kernels/optimizer_kernels.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import results_dir  # noqa: E402

GPT_PARAMS = {"gpt_1b": 1.3e9, "gpt_4b": 4.2e9}
BLOCK_ELEMENTS = 256  # the blockwise 8-bit formats of bitsandbytes and torchao both use 256-element blocks
CHUNK_ELEMENTS = 1 << 20  # the BYOK step's fp32 scratch: 2 x 4 MiB, stays in L2/L3 between dequant and quant
LR = 1e-3
CANDIDATES = ["adamw_fused", "adamw_foreach", "adamw_forloop", "bnb_adamw8bit", "torchao_adamw8bit_eager",
              "torchao_adamw8bit_compiled", "byok8_bnb", "byok8_torchao", "byok8_torchao_compiled", "byok8_lut_compiled",
              "fast_adamw8bit", "fused_adamw8bit", "bf16_moments_compiled", "sgd_momentum", "adafactor", "muon"]
COMPILED = ("_compiled", "fast_adamw8bit")  # candidates whose first step compiles


# ------------------------------------------------------------------------------ the BYOK candidate
class _Codec:
    """Blockwise 8-bit quantization of a flat fp32 chunk into (uint8 codes, fp32 absmax per block)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        if backend == "bnb":
            import bitsandbytes.functional as bnbf
            self.qmaps = {True: bnbf.create_dynamic_map(signed=True), False: bnbf.create_dynamic_map(signed=False)}
        elif backend == "lut_compiled":
            from torchao.optim import quant_utils as qu
            self.qmaps = {s: torch.tensor(qu.create_dynamic_map(signed=s), dtype=torch.float32) for s in (True, False)}
            self.luts = {s: _floor_code_table(q) for s, q in self.qmaps.items()}
            self._dequant = torch.compile(_dequant_take, dynamic=False)
            self._quant = torch.compile(_quant_lut, dynamic=False)
        else:
            from torchao.optim import quant_utils as qu
            self.qmaps = {s: torch.tensor(qu.create_dynamic_map(signed=s), dtype=torch.float32) for s in (True, False)}
            dequant, quant = qu.dequant_with_qmap, self._torchao_quant
            if backend == "torchao_compiled":
                dequant = torch.compile(dequant, dynamic=False)
                quant = torch.compile(quant, dynamic=False)
            self._dequant, self._quant = dequant, quant

    @staticmethod
    def _torchao_quant(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torchao.optim import quant_utils as qu
        scaled, scale = qu.scale_tensor(x, BLOCK_ELEMENTS)
        return qu.quantize_8bit_with_qmap(scaled, qmap), scale

    def dequant_into(self, out: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
        if self.backend == "bnb":
            out.copy_(torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, self.qmaps[signed],
                                                                  BLOCK_ELEMENTS, torch.float32))
        else:
            out.copy_(self._dequant(codes, self.qmaps[signed], absmax))

    def quant_from(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
        if self.backend == "bnb":
            c, a = torch.ops.bitsandbytes.quantize_blockwise(x, self.qmaps[signed], BLOCK_ELEMENTS)
        elif self.backend == "lut_compiled":
            c, a = self._quant(x, self.qmaps[signed], self.luts[signed])
        else:
            c, a = self._quant(x, self.qmaps[signed])
        codes.copy_(c)
        absmax.copy_(a)


def _floor_code_table(qmap: torch.Tensor) -> torch.Tensor:
    """For each value of a float32's top 16 bits (sign, exponent, 7 mantissa bits): the largest code whose
    qmap value is at or below the smallest float with those bits. The dynamic map's codes are at least 1/128
    apart in relative terms inside [-1, 1], so each such interval holds at most one code value: one compare
    finds the floor code, a second one rounds to the nearest, without torchao's 8-step binary search."""
    keys = torch.arange(1 << 16, dtype=torch.int64)
    ends = torch.stack([(keys << 16).to(torch.int32).view(torch.float32),
                        ((keys << 16) | 0xFFFF).to(torch.int32).view(torch.float32)])
    low, high = ends.amin(0), ends.amax(0)
    floor = (torch.searchsorted(qmap, low, right=True) - 1).clamp(0, qmap.numel() - 2)
    within = (low >= -1) & (high <= 1)
    codes_inside = torch.searchsorted(qmap, high, right=True) - 1 - floor
    assert int(codes_inside[within].max()) <= 1, "a qmap denser than 7 mantissa bits: the table needs more bits"
    return floor.to(torch.int32)


def _quant_lut(x: torch.Tensor, qmap: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's blockwise 8-bit quantization (absmax per 256, nearest code, ties up), by table lookup."""
    blocks = x.view(-1, BLOCK_ELEMENTS)
    absmax = blocks.abs().amax(-1).clamp(1e-12)
    y = (blocks / absmax.view(-1, 1)).view(-1)
    code = table[(y.view(torch.int32) >> 16) & 0xFFFF]
    code = (code + (y >= qmap[code + 1]).int()).clamp(max=qmap.numel() - 2)
    down, up = qmap[code], qmap[code + 1]
    code = code + ((y - down) >= (up - down) * 0.5).int()
    return code.to(torch.uint8), absmax


def _dequant_take(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    return (qmap[codes.int()].view(-1, BLOCK_ELEMENTS) * absmax.view(-1, 1)).view(-1)


class Byok8bitAdamW(torch.optim.Optimizer):
    """AdamW with 8-bit blockwise moments stepped by torch's fused fp32 kernel on dequantized chunks.

    State per parameter: ``step`` (fp32 scalar tensor, as torch's fused path keeps it), ``m_codes`` /
    ``v_codes`` (uint8, the parameter's numel), ``m_absmax`` / ``v_absmax`` (fp32, numel / 256). Parameters
    whose numel is not a multiple of 256 are refused: the engine's units pad to whole blocks.
    """

    def __init__(self, params, backend: str, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.codec = _Codec(backend)
        self._m32 = torch.empty(CHUNK_ELEMENTS)
        self._v32 = torch.empty(CHUNK_ELEMENTS)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                n = p.numel()
                assert n % BLOCK_ELEMENTS == 0, f"{n} elements: not whole {BLOCK_ELEMENTS}-element blocks"
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    for name, signed in (("m", True), ("v", False)):
                        state[f"{name}_codes"] = torch.empty(n, dtype=torch.uint8)
                        state[f"{name}_absmax"] = torch.empty(n // BLOCK_ELEMENTS)
                        self.codec.quant_from(torch.zeros(n), state[f"{name}_codes"], state[f"{name}_absmax"], signed)
                state["step"] += 1
                flat_p, flat_g = p.view(-1), p.grad.view(-1)
                mc, ma = state["m_codes"].view(-1), state["m_absmax"]
                vc, va = state["v_codes"].view(-1), state["v_absmax"]
                for start in range(0, n, CHUNK_ELEMENTS):
                    end = min(n, start + CHUNK_ELEMENTS)
                    b0, b1 = start // BLOCK_ELEMENTS, end // BLOCK_ELEMENTS
                    m32, v32 = self._m32[: end - start], self._v32[: end - start]
                    self.codec.dequant_into(m32, mc[start:end], ma[b0:b1], True)
                    self.codec.dequant_into(v32, vc[start:end], va[b0:b1], False)
                    torch._fused_adamw_([flat_p[start:end]], [flat_g[start:end]], [m32], [v32], [], [state["step"]],
                                        lr=group["lr"], beta1=beta1, beta2=beta2,
                                        weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                        maximize=False)
                    self.codec.quant_from(m32, mc[start:end], ma[b0:b1], True)
                    self.codec.quant_from(v32, vc[start:end], va[b0:b1], False)


# ------------------------------------------------------------------------------ the bf16-moment reference
def _bf16_moment_step(p, g, m, v, hp):
    decay, beta1, beta2, step_size, inv_sqrt_bc2, eps = hp.unbind()
    m32 = beta1 * m.float() + (1 - beta1) * g
    v32 = beta2 * v.float() + (1 - beta2) * g * g
    p.copy_(p * decay - step_size * m32 / (torch.sqrt(v32) * inv_sqrt_bc2 + eps))
    return m32.to(torch.bfloat16), v32.to(torch.bfloat16)


class Bf16MomentsAdamW(torch.optim.Optimizer):
    """A reference point, not a product: AdamW with bf16 moments (4 B/param, no block scales, no search),
    one compiled dequantize-update-round loop per parameter."""

    def __init__(self, params) -> None:
        super().__init__(params, dict(lr=LR, weight_decay=1e-2, betas=(0.9, 0.999), eps=1e-8))
        self._kernel = torch.compile(_bf16_moment_step, dynamic=None)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p, dtype=torch.bfloat16),
                              v=torch.zeros_like(p, dtype=torch.bfloat16))
                st["step"] += 1
                b1, b2 = group["betas"]
                lr, t = group["lr"], st["step"]
                hp = torch.tensor([1 - lr * group["weight_decay"], b1, b2, lr / (1 - b1 ** t),
                                   (1 - b2 ** t) ** -0.5, group["eps"]])
                args = (p.view(-1), p.grad.view(-1), st["m"].view(-1), st["v"].view(-1))
                for a in args:
                    torch._dynamo.mark_dynamic(a, 0)
                m, v = self._kernel(*args, hp)
                st["m"], st["v"] = m.view_as(p), v.view_as(p)


def cached_first_step_s(name: str) -> float:
    """The first step of a compiled candidate in a fresh process, its kernels already in inductor's on-disk
    cache (the one-time compile is the first row's ``compile_s``)."""
    code = ("import sys, time, torch; sys.path.insert(0, %r); import optimizer_kernels as k; torch.set_num_threads(1); "
            "ps = k.make_params([(1024, 1024)], 0); o = k.make_optimizer(%r, ps); t = time.perf_counter(); o.step(); "
            "print(time.perf_counter() - t)") % (str(Path(__file__).resolve().parent), name)
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ candidates
def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name.startswith("adamw_"):
        kind = name.removeprefix("adamw_")
        flags = dict(fused=kind == "fused", foreach=kind == "foreach")
        return torch.optim.AdamW(params, lr=LR, weight_decay=1e-2, **flags)
    if name == "bnb_adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=1e-2)
    if name.startswith("torchao_adamw8bit"):
        from torchao.optim import AdamW8bit
        return AdamW8bit(params, lr=LR, weight_decay=1e-2)
    if name.startswith("byok8_"):
        return Byok8bitAdamW(params, backend=name.removeprefix("byok8_"))
    if name == "fast_adamw8bit":
        from snake_strategy.optimizers import FastAdamW8bit
        return FastAdamW8bit(params, lr=LR, weight_decay=1e-2)
    if name == "fused_adamw8bit":
        from snake_strategy.optimizers import FusedAdamW8bit
        return FusedAdamW8bit(params, lr=LR, weight_decay=1e-2)
    if name == "bf16_moments_compiled":
        return Bf16MomentsAdamW(params)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=LR)
    if name == "muon":
        return torch.optim.Muon(params, lr=LR)
    raise ValueError(f"unknown candidate {name!r}; known: {', '.join(CANDIDATES)}")


def stance(name: str):
    """torchao's AdamW8bit calls torch.compile itself: its eager row forces the compiled call eager."""
    return torch.compiler.set_stance("force_eager") if name == "torchao_adamw8bit_eager" else contextlib.nullcontext()


def param_shapes(set_name: str, candidate: str, muon_shape: tuple[int, int]) -> list[tuple[int, ...]]:
    if candidate == "muon":  # 2-D only, and Newton-Schulz is O(numel * min side): a smaller proxy matrix
        return [muon_shape]
    if set_name == "matrix":
        return [(2048, 8192)]
    d, hidden = 2048, 8192  # gpt_1b: d_model 2048, mlp_ratio 4
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (hidden, d), (hidden,), (d, hidden), (d,)]


def make_params(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def _tensors_of(value) -> dict[str, torch.Tensor]:
    """The plain tensors a state value is stored as: a tensor subclass (torchao's OptimState8bit) by its
    inner tensors, named ``<key>.<inner>``."""
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return {n: getattr(value, n) for n in names}
    return {"": value} if isinstance(value, torch.Tensor) else {}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for v in st.values()
               for t in _tensors_of(v).values())


def state_layout(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    layout = {}
    for key, value in opt.state[p].items():
        inner = _tensors_of(value)
        if not inner:
            layout[key] = {"python": type(value).__name__, "value": value}
        for sub, t in inner.items():
            layout[f"{key}.{sub}" if sub else key] = {"type": type(value).__name__ if sub else "Tensor",
                                                      "dtype": str(t.dtype), "shape": list(t.shape)}
    return layout


def time_steps(name: str, shapes, threads: int, warmup: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    params = make_params(shapes, seed=0)
    numel = sum(p.numel() for p in params)
    opt = make_optimizer(name, params)
    with stance(name):
        start = time.perf_counter()
        opt.step()  # initialises the state (and compiles, for the compiled candidates)
        first_s = time.perf_counter() - start
        for _ in range(max(0, warmup - 1)):
            opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    median_s = statistics.median(times)
    big = max(params, key=lambda p: p.numel())
    small = min(params, key=lambda p: p.numel())
    row = dict(candidate=name, threads=threads, shapes=[list(s) for s in shapes], params=numel,
               step_s=times, median_step_s=median_s, m_params_per_s=numel / median_s / 1e6,
               first_step_s=first_s, state_bytes_per_param=state_bytes(opt) / numel,
               state_layout_largest=state_layout(opt, big))
    if small.numel() != big.numel():
        row["state_layout_smallest"] = state_layout(opt, small)
    if name.endswith(COMPILED):
        row["compile_s"] = first_s - median_s  # the first step's time beyond a steady step
    return row


# ------------------------------------------------------------------------------ state handed in as views
def _pack_state(state: dict) -> tuple[dict, dict[torch.dtype, torch.Tensor]]:
    """Copy every state tensor into one flat buffer per dtype and return state made of views into them
    (subclasses rebuilt around views of their inner tensors), as the engine hands state loaded from tiers."""
    flat = {k: t for key, v in state.items() for k, t in ((f"{key}.{s}", t) for s, t in _tensors_of(v).items())}
    sizes: dict[torch.dtype, int] = {}
    for t in flat.values():
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel() + 64  # a gap: each view starts at an offset
    buffers = {dt: torch.full((n,), 7, dtype=dt) for dt, n in sizes.items()}
    cursor = {dt: 64 for dt in sizes}
    views = {}
    for k, t in flat.items():
        at = cursor[t.dtype]
        views[k] = buffers[t.dtype][at:at + t.numel()].view(t.shape).copy_(t)
        cursor[t.dtype] = at + t.numel()
    packed = {}
    for key, v in state.items():
        inner = _tensors_of(v)
        if not inner:
            packed[key] = v  # a Python scalar (bitsandbytes' int step) travels as itself
        elif "" in inner:
            packed[key] = views[f"{key}."]
        else:
            names, meta = v.__tensor_flatten__()
            packed[key] = type(v).__tensor_unflatten__({n: views[f"{key}.{n}"] for n in names}, meta, None, None)
    return packed, buffers


def views_check(name: str) -> dict:
    """Three steps uninterrupted against one step, then the state moved into flat-buffer views and handed to
    a fresh optimizer, then two steps: parameters and state must be bitwise equal, and stay views."""
    torch.set_num_threads(1)
    shapes = [(512, 1024), (1024,), (64, 64)] if name != "muon" else [(256, 512), (128, 256)]
    grads = [make_params(shapes, seed=10 + k) for k in range(3)]
    ref = make_params(shapes, seed=0)
    with stance(name):
        ref_opt = make_optimizer(name, ref)
        for k in range(3):
            for p, g in zip(ref, grads[k]):
                p.grad = g.grad
            ref_opt.step()
        first = make_params(shapes, seed=0)
        opt = make_optimizer(name, first)
        for p, g in zip(first, grads[0]):
            p.grad = g.grad
        opt.step()
        buffers = []
        fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
        fresh = make_optimizer(name, fresh_params)
        for old, new in zip(first, fresh_params):
            packed, bufs = _pack_state(opt.state[old])
            fresh.state[new] = packed
            buffers.append((packed, bufs))
        for k in (1, 2):
            for p, g in zip(fresh_params, grads[k]):
                p.grad = g.grad
            fresh.step()
    params_equal = all(torch.equal(a, b) for a, b in zip(ref, fresh_params))
    state_equal, still_views = True, True
    for p_ref, p_new, (packed, bufs) in zip(ref, fresh_params, buffers):
        for key, v_ref in ref_opt.state[p_ref].items():
            v_new = fresh.state[p_new][key]
            a, b = _tensors_of(v_ref), _tensors_of(v_new)
            if not a:
                state_equal &= v_ref == v_new
                continue
            state_equal &= all(torch.equal(a[s], b[s]) for s in a)
            held = _tensors_of(packed[key])
            for s, t in b.items():  # the step wrote into the engine's buffers, not into new tensors
                still_views &= t.data_ptr() == held[s].data_ptr() and any(
                    t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for buf in bufs.values())
    return dict(bitwise_equal=bool(params_equal and state_equal), params_equal=bool(params_equal),
                state_equal=bool(state_equal), state_stays_in_views=bool(still_views),
                state_keys=sorted(fresh.state[fresh_params[0]]))


def drift(name: str, steps: int = 20) -> float:
    """max |p - p_fp32_fused_adamw| after ``steps`` steps of the same gradients, in units of lr * steps."""
    torch.set_num_threads(1)
    shapes = [(256, 1024)]
    runs = {}
    for cand in ("adamw_fused", name):
        params = make_params(shapes, seed=0)
        opt = make_optimizer(cand, params)
        with stance(cand):
            for k in range(steps):
                params[0].grad = make_params(shapes, seed=100 + k)[0].grad
                opt.step()
        runs[cand] = params[0].detach()
    return float((runs[name] - runs["adamw_fused"]).abs().max() / (LR * steps))


# ------------------------------------------------------------------------------ the disk
def disk_bandwidth(directory: str | None, size_gib: float) -> dict:
    block = 64 << 20
    count = max(1, int(size_gib * (1 << 30)) // block)
    payload = torch.randint(0, 256, (block,), dtype=torch.uint8).numpy().tobytes()  # random: no zero short-cuts
    fd, path = tempfile.mkstemp(prefix="optk-disk-", dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(count):
            os.write(fd, payload)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, block):
            pass
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(path)
    size = count * block
    return dict(path_dir=directory or tempfile.gettempdir(), bytes=size, write_s=write_s, read_s=read_s,
                write_gb_per_s=size / write_s / 1e9, read_gb_per_s=size / read_s / 1e9,
                method="os.write of 64 MiB blocks + fsync; posix_fadvise(DONTNEED) then os.read")


# ------------------------------------------------------------------------------ the implied step
def implied(rows: list[dict], disk: dict, muon_side: int) -> list[dict]:
    """Per candidate at 1 thread (the largest set measured): the step at gpt_1b/gpt_4b when every state
    sits on the SSD = max(compute, SSD time), and its speed-up over fp32 fused AdamW."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("threads") == 1 and "m_params_per_s" in r:
            if r["candidate"] not in best or r["params"] > best[r["candidate"]]["params"]:
                best[r["candidate"]] = r
    out = []
    for name, r in best.items():
        rate = r["m_params_per_s"] * 1e6
        if name == "muon":  # Newton-Schulz per parameter ~ the smaller side: gpt_1b's matrices are 2048 wide
            rate *= min(r["shapes"][0]) / muon_side
        s = r["state_bytes_per_param"]
        row = dict(candidate=name, rate_m_params_per_s=rate / 1e6, state_bytes_per_param=s,
                   ssd_read_bytes_per_param=8 + s, ssd_write_bytes_per_param=8 + s)
        for model, n in GPT_PARAMS.items():
            compute_s = n / rate
            disk_s = n * ((8 + s) / (disk["read_gb_per_s"] * 1e9) + (8 + s) / (disk["write_gb_per_s"] * 1e9))
            row[model] = dict(compute_s=compute_s, ssd_s=disk_s, step_s=max(compute_s, disk_s),
                              bound="compute" if compute_s > disk_s else "ssd")
        out.append(row)
    base = next((r for r in out if r["candidate"] == "adamw_fused"), None)
    for r in out:
        for model in GPT_PARAMS:
            r[model]["speedup_vs_adamw_fused"] = base[model]["step_s"] / r[model]["step_s"] if base else None
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if "m_params_per_s" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    width = 0.8 / max(1, len(threads))
    for i, t in enumerate(threads):
        vals = [max((r["m_params_per_s"] for r in rows if r["candidate"] == n and r["threads"] == t), default=0)
                for n in names]
        a.bar([k + i * width for k in range(len(names))], vals, width, label=f"{t} thread(s)")
    a.set_xticks([k + width * (len(threads) - 1) / 2 for k in range(len(names))], names, rotation=60,
                 fontsize=7, ha="right")
    a.set_yscale("log")
    a.set_ylabel("M params / s (largest set)")
    a.legend()
    imp = report["implied"]
    x = range(len(imp))
    b.bar([k - 0.2 for k in x], [r["gpt_1b"]["step_s"] for r in imp], 0.4, label="gpt_1b")
    b.bar([k + 0.2 for k in x], [r["gpt_4b"]["step_s"] for r in imp], 0.4, label="gpt_4b")
    b.set_xticks(list(x), [r["candidate"] for r in imp], rotation=60, fontsize=7, ha="right")
    b.set_yscale("log")
    b.set_ylabel("implied s / step: max(compute 1 thread, SSD)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--sets", default="matrix,unit", help="matrix (one 2048x8192), unit (one gpt_1b block)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--muon-shape", default="1024x4096")
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--disk-dir", default=None, help="where the disk test file goes (default: TMPDIR)")
    ap.add_argument("--out", default=str(results_dir("optimizer_kernels") / "optimizer_kernels.json"))
    args = ap.parse_args()
    muon_shape = tuple(int(v) for v in args.muon_shape.split("x"))
    assert args.steps >= 5, "the table's medians are of at least 5 timed steps"
    import bitsandbytes
    import torchao
    report = dict(machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                               torch=torch.__version__, bitsandbytes=bitsandbytes.__version__,
                               torchao=torchao.__version__),
                  args=vars(args), rows=[], checks={})
    start = time.perf_counter()
    for name in args.candidates.split(","):
        for set_name in args.sets.split(","):
            if name == "muon" and set_name != args.sets.split(",")[0]:
                continue  # one proxy matrix whatever the set
            for threads in (int(t) for t in args.threads.split(",")):
                try:
                    row = time_steps(name, param_shapes(set_name, name, muon_shape), threads, args.warmup, args.steps)
                    row["set"] = "muon_proxy" if name == "muon" else set_name
                except Exception as exc:  # a candidate that cannot run here is a result, not a crash
                    row = dict(candidate=name, set=set_name, threads=threads,
                               error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
                report["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k in ("candidate", "set", "threads",
                      "m_params_per_s", "state_bytes_per_param", "compile_s", "error")}), flush=True)
        try:
            check = views_check(name)
            if name not in ("adamw_fused", "adamw_foreach", "adamw_forloop", "sgd_momentum", "adafactor", "muon"):
                check["drift_vs_adamw_fused_lr_steps"] = drift(name)
        except Exception as exc:
            check = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        if name.endswith(COMPILED):
            try:
                check["first_step_s_cached_compile"] = cached_first_step_s(name)
            except Exception as exc:
                check["first_step_s_cached_compile"] = f"{type(exc).__name__}: {exc}"
        report["checks"][name] = check
        print(name, "views:", json.dumps({k: v for k, v in check.items() if k != "traceback"}), flush=True)
    report["disk"] = disk_bandwidth(args.disk_dir, args.disk_gib)
    print("disk:", json.dumps(report["disk"]), flush=True)
    report["implied"] = implied(report["rows"], report["disk"], muon_side=2048)
    report["total_s"] = time.perf_counter() - start
    for r in report["implied"]:
        print(f"{r['candidate']:28s} {r['rate_m_params_per_s']:9.1f} M/s {r['state_bytes_per_param']:5.2f} B/param "
              f"gpt_1b {r['gpt_1b']['step_s']:7.1f} s ({r['gpt_1b']['speedup_vs_adamw_fused']:.2f}x) "
              f"gpt_4b {r['gpt_4b']['step_s']:7.1f} s ({r['gpt_4b']['speedup_vs_adamw_fused']:.2f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    plot(report, out.with_suffix(".png"))
    print("wrote", out)


if __name__ == "__main__":
    main()
