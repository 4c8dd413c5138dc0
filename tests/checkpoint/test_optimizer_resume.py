"""Checkpoints of any optimizer: the state in its own slots and dtypes, the scalar state (step counts, NAdam's
mu_product, ASGD's eta/mu), and the optimizer class recorded; a resume continues bitwise, and a resume with
another optimizer class is refused naming both."""
import importlib.util
import os

import pytest

from tests.exactness.test_any_optimizer import module_class
from tests.helpers import assert_bitwise, fit_resumable

CASES = (["nadam", "asgd", "adafactor", "muon", "fast_adamw8bit"]
         + (["adamw8bit"] if importlib.util.find_spec("bitsandbytes") else []))


@pytest.mark.parametrize("name", CASES)
def test_resume_mid_run_is_bitwise(name, tmp_path):
    cls = module_class(name)
    precision = "32-true"
    straight = fit_resumable(6, tmp_path / "ssd_a", module_cls=cls, precision=precision).last
    fit_resumable(3, tmp_path / "ssd_b", module_cls=cls, precision=precision, ckpt_dir=tmp_path / "ckpts")
    (saved,) = os.listdir(tmp_path / "ckpts")
    run = fit_resumable(6, tmp_path / "ssd_c", module_cls=cls, precision=precision,
                        ckpt_path=str(tmp_path / "ckpts" / saved))
    assert run.trainer.global_step == 6
    assert_bitwise(run.last, straight)


def test_resume_with_another_optimizer_is_refused(tmp_path):
    fit_resumable(3, tmp_path / "ssd_a", module_cls=module_class("sgd_nesterov"), ckpt_dir=tmp_path / "ckpts")
    (saved,) = os.listdir(tmp_path / "ckpts")
    with pytest.raises(ValueError) as err:
        fit_resumable(6, tmp_path / "ssd_b", module_cls=module_class("nadam"), ckpt_path=str(tmp_path / "ckpts" / saved))
    message = str(err.value)
    assert "torch.optim.sgd.SGD" in message and "torch.optim.nadam.NAdam" in message and "momentum_buffer" in message
