"""Optimizers stepped per tensor (Adafactor, Muon) on matrices larger than a page (4096 elements): the alpha
split raw falls inside a matrix and must move to a parameter start, and a small ``storage.optimizer_chunk_elems``
(one page) must still step every matrix whole. Against plain Lightning with the same optimizer, element-wise
(float64, atol 1e-10). No biases: Adafactor turns the rounding noise of a zero true gradient (the attention's
key bias) into steps of its own, a spread tests/exactness/test_any_optimizer.py measures apart."""
import pytest

from snake_strategy.gpt import GPTConfig
from snake_strategy.units import build_layouts
from tests.exactness.test_any_optimizer import module_class
from tests.helpers import assert_steps_close, max_abs_diff, run_reference, run_snake

WIDE = GPTConfig(vocab_size=64, d_model=80, num_layers=2, num_heads=4, context_len=16, bias=False)
STEPS, MICRO, MICRO_SIZE = 3, 2, 2
ALPHA = 0.3


def test_the_raw_alpha_cut_falls_inside_a_matrix():
    """The test's premise: every matrix is larger than a page, and the unit's raw alpha cut is inside one."""
    module = module_class("muon")(WIDE)
    module.configure_model()
    (layout, *_), = [build_layouts(module.blocks, 2, {id(p): 0 for p in module.parameters()}, align_params=True)]
    matrices = [s for s in layout.trainable_slots if len(s.shape) == 2]
    assert matrices and all(s.numel > 4096 for s in matrices)
    cut = round(ALPHA * layout.train_end / 4096) * 4096
    assert any(s.offset < cut < s.offset + s.numel for s in layout.trainable_slots)


@pytest.mark.parametrize("chunk_elems", [4096, 8192 * 4096], ids=["one_page_chunks", "default_chunks"])
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_per_tensor_optimizer_with_an_alpha_cut_inside_a_matrix(name, chunk_elems, tmp_path):
    cls = module_class(name)
    ref = run_reference(WIDE, STEPS, MICRO, MICRO_SIZE, "64-true", module_cls=cls)
    assert max_abs_diff(ref[0], ref[-1]) > 1e-4
    got, strategy = run_snake(WIDE, STEPS, MICRO, MICRO_SIZE, "64-true", module_cls=cls, blocks_per_unit=2,
                              storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host",
                                       "optimizer_chunk_elems": chunk_elems, "ssd_dir": str(tmp_path / "ssd")},
                              schedule_extra={"alpha": ALPHA})
    assert_steps_close(got, ref, "64-true", steps=STEPS)
