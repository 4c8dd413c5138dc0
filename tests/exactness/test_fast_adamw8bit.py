"""``FastAdamW8bit``'s format against a reference written here from its docstring: per block of 256 values,
int8 codes of the first moment against its absmax (round to nearest) and uint8 codes of the second moment's
square root against the root of its max (rounded up), the AdamW update in between."""
import math

import pytest
import torch

from snake_strategy.optimizers import FastAdamW8bit
from snake_strategy.optimizers.fast_adamw8bit import BLOCK, CHUNK_ROWS

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


def _reference_step(p, g, m_codes, m_absmax, v_codes, v_root_max, step):
    """One step on flat fp64 tensors padded to whole blocks, block by block, as the docstring states it."""
    b1, b2 = BETAS
    out_p, out_mc, out_ma, out_vc, out_vm = p.clone(), [], [], [], []
    for r in range(m_codes.shape[0]):
        sl = slice(r * BLOCK, (r + 1) * BLOCK)
        m_old = m_codes[r].double() * m_absmax[r] / 127
        root_old = v_codes[r].double() * v_root_max[r] / 255
        m = b1 * m_old + (1 - b1) * g[sl]
        v = b2 * root_old ** 2 + (1 - b2) * g[sl] ** 2
        denom = v.sqrt() / math.sqrt(1 - b2 ** step) + EPS
        out_p[sl] = p[sl] * (1 - LR * WD) - LR / (1 - b1 ** step) * m / denom
        amax, vmax = m.abs().max().item(), v.max().item()
        out_mc.append(torch.round(m * 127 / amax) if amax > 0 else torch.zeros_like(m))
        out_vc.append(torch.ceil(v.sqrt() * 255 / math.sqrt(vmax)).clamp(max=255) if vmax > 0 else torch.zeros_like(v))
        out_ma.append(amax)
        out_vm.append(math.sqrt(vmax))
    return (out_p, torch.stack(out_mc), torch.tensor(out_ma, dtype=torch.float64), torch.stack(out_vc),
            torch.tensor(out_vm, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(64, 256), (37, 300)])  # whole blocks; a padded last block
def test_matches_the_format_it_documents(shape):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
    optimizer = FastAdamW8bit([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=BLOCK)
    rows = -(-param.numel() // BLOCK)
    p = torch.zeros(rows * BLOCK, dtype=torch.float64)
    p[:param.numel()] = param.detach().reshape(-1)
    mc, vc = torch.zeros(rows, BLOCK), torch.zeros(rows, BLOCK)
    ma, vm = torch.zeros(rows, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64)
    for step in range(1, 6):
        grad = torch.randn(shape, dtype=torch.float64) * torch.logspace(-4, 0, shape[-1], dtype=torch.float64)
        param.grad = grad
        optimizer.step()
        g = torch.zeros(rows * BLOCK, dtype=torch.float64)
        g[:param.numel()] = grad.reshape(-1)
        p, mc, ma, vc, vm = _reference_step(p, g, mc, ma, vc, vm, step)
        state = optimizer.state[param]
        torch.testing.assert_close(param.detach().reshape(-1), p[:param.numel()], rtol=0, atol=1e-12)
        torch.testing.assert_close(state["exp_avg_absmax"], ma, rtol=1e-14, atol=0)
        torch.testing.assert_close(state["exp_avg_sq_root_max"], vm, rtol=1e-14, atol=0)
        # A value within rounding of a code boundary may land on either side: codes agree to one step, and
        # all but a handful exactly.
        for got, want in ((state["exp_avg_codes"].double(), mc), (state["exp_avg_sq_codes"].double(), vc)):
            assert (got - want).abs().max() <= 1 and (got != want).sum() <= 2, (step, (got != want).sum())


def test_a_parameter_stepped_in_chunks_equals_its_rows_stepped_as_parameters_bitwise():
    """Blocks are independent: a parameter longer than one kernel call (its new codes copied into the state
    chunk by chunk) steps exactly as its rows split into parameters of one call each (whose state takes the
    kernel's new tensors)."""
    torch.manual_seed(0)
    rows = CHUNK_ROWS + 3
    whole = torch.nn.Parameter(torch.randn(rows, BLOCK) * 0.02)
    parts = [torch.nn.Parameter(rows_.clone()) for rows_ in whole.detach().split([CHUNK_ROWS, 3])]
    one = FastAdamW8bit([whole], lr=LR, weight_decay=WD, min_8bit_size=BLOCK)
    split = FastAdamW8bit(parts, lr=LR, weight_decay=WD, min_8bit_size=BLOCK)
    for _ in range(3):
        grad = torch.randn(rows, BLOCK) * torch.logspace(-4, 0, BLOCK)
        whole.grad, parts[0].grad, parts[1].grad = grad, grad[:CHUNK_ROWS].clone(), grad[CHUNK_ROWS:].clone()
        one.step()
        split.step()
    assert torch.equal(whole.detach(), torch.cat([q.detach() for q in parts]))
    for key in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_root_max"):
        assert torch.equal(one.state[whole][key], torch.cat([split.state[q][key] for q in parts])), key


def test_the_largest_value_of_a_block_keeps_the_top_code():
    """The block's largest sqrt(v) lands on 255 up to rounding; rounded up past 255 it would wrap to code 0
    (a denominator of eps under the block's largest moment)."""
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(4096 * 8))
    optimizer = FastAdamW8bit([param], lr=LR)
    for _ in range(4):
        param.grad = torch.randn_like(param) * torch.rand(param.shape[0] // BLOCK, 1).expand(-1, BLOCK).reshape(-1)
        optimizer.step()
        state = optimizer.state[param]
        assert (state["exp_avg_sq_codes"].amax(dim=1) == 255).all()
        assert (state["exp_avg_codes"].abs().amax(dim=1) == 127).all()


def test_the_stored_denominator_is_never_below_the_true_one():
    """Rounding sqrt(v) up: a step never divides by less than its unrounded second moment."""
    torch.manual_seed(2)
    param = torch.nn.Parameter(torch.randn(64, 256, dtype=torch.float64))
    optimizer = FastAdamW8bit([param], lr=LR, betas=BETAS, min_8bit_size=BLOCK)
    param.grad = torch.randn_like(param)
    optimizer.step()
    for _ in range(3):
        state = optimizer.state[param]
        root_old = state["exp_avg_sq_codes"].double() * (state["exp_avg_sq_root_max"] / 255)[:, None]
        grad = torch.randn_like(param) * torch.logspace(-6, 0, 256, dtype=torch.float64)
        true_v = BETAS[1] * root_old ** 2 + (1 - BETAS[1]) * grad ** 2
        param.grad = grad
        optimizer.step()
        stored = state["exp_avg_sq_codes"].double() * (state["exp_avg_sq_root_max"] / 255)[:, None]
        assert (stored >= true_v.sqrt() * (1 - 1e-12)).all()
        assert (stored[true_v > 0] > 0).all(), "a nonzero second moment never stores zero"


def test_state_bytes_and_the_small_tensor_path():
    big, small = torch.nn.Parameter(torch.randn(4096, 64)), torch.nn.Parameter(torch.randn(64))
    optimizer = FastAdamW8bit([big, small], lr=LR)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    optimizer.step()
    state = optimizer.state[big]
    stored = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    assert stored / big.numel() <= 2.1, stored / big.numel()
    assert {k: t.dtype for k, t in state.items() if k != "step"} == {
        "exp_avg_codes": torch.int8, "exp_avg_absmax": torch.float32, "exp_avg_sq_codes": torch.uint8,
        "exp_avg_sq_root_max": torch.float32}
    assert optimizer.state[small]["exp_avg"].dtype == torch.float32  # under min_8bit_size: fp32, torch's fused step


def test_a_state_saved_with_the_largest_v_per_block_loads_and_trains_on():
    """The earlier format kept each block's largest v (``exp_avg_sq_max``); loaded, it continues the run as the
    current format (its root) does."""
    torch.manual_seed(3)
    start = torch.randn(16, 256, dtype=torch.float64)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [FastAdamW8bit([p], lr=LR, min_8bit_size=BLOCK) for p in params]
    for step in range(3):
        grad = torch.randn(16, 256, dtype=torch.float64)
        for p in params:
            p.grad = grad.clone()
        if step == 1:
            saved = optimizers[1].state_dict()
            for s in saved["state"].values():
                s["exp_avg_sq_max"] = s.pop("exp_avg_sq_root_max").square()
            optimizers[1] = FastAdamW8bit([params[1]], lr=LR, min_8bit_size=BLOCK)
            optimizers[1].load_state_dict(saved)
            assert "exp_avg_sq_max" not in optimizers[1].state[params[1]]
        for o in optimizers:
            o.step()
    torch.testing.assert_close(params[1], params[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(optimizers[1].state[params[1]]["exp_avg_sq_root_max"],
                               optimizers[0].state[params[0]]["exp_avg_sq_root_max"], rtol=1e-14, atol=0)


def test_tensors_under_min_8bit_size_step_as_torch_fused_adamw_bitwise():
    """The small tensors of a group (biases, norms) keep fp32 moments and step in one call of torch's fused
    kernel: the same numbers as ``torch.optim.AdamW(fused=True)``, bit for bit, beside an 8-bit matrix."""
    torch.manual_seed(4)
    shapes = [(64,), (33,), (8, 16), (4096, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours[:3]]
    fast = FastAdamW8bit(ours, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    torch_adamw = torch.optim.AdamW(theirs, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    for _ in range(3):
        for i, p in enumerate(ours):
            p.grad = torch.randn_like(p)
            if i < 3:
                theirs[i].grad = p.grad.clone()
        fast.step()
        torch_adamw.step()
    for mine, reference in zip(ours[:3], theirs):
        assert torch.equal(mine, reference)
        assert torch.equal(fast.state[mine]["exp_avg_sq"], torch_adamw.state[reference]["exp_avg_sq"])
    assert "exp_avg_codes" in fast.state[ours[3]]


def test_refusals():
    with pytest.raises(ValueError, match="min_8bit_size"):
        FastAdamW8bit([torch.nn.Parameter(torch.randn(4))], min_8bit_size=16)
    half = torch.nn.Parameter(torch.randn(4096, 2, dtype=torch.bfloat16))
    half.grad = torch.randn_like(half)
    with pytest.raises(ValueError, match="fp32"):
        FastAdamW8bit([half]).step()


def test_a_step_on_meta_tensors_does_not_decide_against_compiling():
    """A planner steps the optimizer on meta tensors to read its state's layout; torch.compile cannot build the
    kernel there, and that must not leave the process stepping eagerly. Own process: the choice is per process."""
    import shutil
    import subprocess
    import sys
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernel steps eagerly anyway")
    code = ("import torch; from snake_strategy.optimizers import FastAdamW8bit; "
            "from snake_strategy.optimizers.fast_adamw8bit import KERNEL\n"
            "for device in ('meta', 'cpu'):\n"
            "    p = torch.nn.Parameter(torch.zeros(64, 256, device=device)); p.grad = torch.ones_like(p)\n"
            "    FastAdamW8bit([p], min_8bit_size=256).step()\n"
            "print(KERNEL.compiled)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
