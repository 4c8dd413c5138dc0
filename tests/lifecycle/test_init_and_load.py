"""Big-model init and pretrained streaming: meta init equals normal init bitwise; a streamed load of
a saved state dict equals the original."""
import lightning as L
import torch

from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, fit_snake, token_loader


def _snake_state_after_setup(module, **strategy_kw):
    captured = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module):
            captured.update(trainer.strategy.engine.state_dict())
            trainer.should_stop = True  # stop before any step

    # seed=None: the module's init runs inside fit, from the RNG state its test set.
    fit_snake(module, token_loader(8, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=1,
              storage={"weights": "ssd", "optimizer": "ssd"}, schedule={"num_micro_batches": 4}, callbacks=[Capture()],
              record=None, seed=None, **strategy_kw)
    return captured


def test_meta_init_equals_normal_init_bitwise():
    torch.manual_seed(123)
    normal = GPTModule(SMALL_GPT)
    normal.configure_model()  # in memory, on the CPU
    expected = {n: p.detach().clone() for n, p in normal.named_parameters()}
    torch.manual_seed(123)
    got = _snake_state_after_setup(GPTModule(SMALL_GPT))  # meta device, materialized unit by unit
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_streamed_load_of_saved_state_dict_equals_original(tmp_path):
    torch.manual_seed(7)
    original = GPTModule(SMALL_GPT)
    original.configure_model()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(torch.randn_like(p))  # not the init: the values must come from the file
    path = tmp_path / "weights.pt"
    torch.save(original.state_dict(), path)
    torch.manual_seed(0)
    got = _snake_state_after_setup(GPTModule(SMALL_GPT), pretrained=str(path))
    for name, p in original.named_parameters():
        assert torch.equal(got[name], p.detach()), name


def test_pretrained_errors_name_the_file(tmp_path):
    import pytest

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="could not be read"):
        _snake_state_after_setup(GPTModule(SMALL_GPT), pretrained=str(bad))
    with pytest.raises(ValueError, match="is not a file"):
        _snake_state_after_setup(GPTModule(SMALL_GPT), pretrained=str(tmp_path / "missing.pt"))
