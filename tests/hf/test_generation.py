"""HFCausalLM.generate: greedy decoding with a KV cache in host memory, the tokens of transformers'
``generate(do_sample=False)`` (left-padded batches, EOS stopping), and under greedysnake one read of
every unit's weights per generated token (the public traffic counters), nothing written.
"""
import pytest

pytest.importorskip("transformers")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import snake_strategy  # noqa: E402
from snake_strategy.hf import HFCausalLM  # noqa: E402
from tests.helpers import trainer_kwargs  # noqa: E402
from tests.hf.models import VOCAB, built, hf_model, tiny_config  # noqa: E402

PROMPT, NEW = 7, 8


@pytest.fixture(autouse=True)
def _fp64_by_default(float64_default):
    """fp64 models: argmax ties between the two implementations are then out of reach."""


def left_padded(rows: int = 3, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of PROMPT, PROMPT - 3, PROMPT - 5 real tokens, padded on the left with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 5][:rows]):
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def pair(family: str):
    hf = hf_model(family).eval()
    module = built(tiny_config(family))
    module.load_state_dict(hf.state_dict(), strict=False)
    return hf, module


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_tokens_equal_transformers_generate(family):
    hf, module = pair(family)
    ids, mask = left_padded()
    free = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert free.shape == (3, PROMPT + NEW)
    assert torch.equal(module.generate(ids, NEW, attention_mask=mask, eos_token_id=[]), free)

    # EOS: the first row's third token ends it; the others go on (padded once finished, as HF pads).
    eos = int(free[0, PROMPT + 2])
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    got = module.generate(ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    assert (got[0, PROMPT + 3:] == 0).all()

    # Every sequence finished: generation stops early.
    single = hf.generate(ids[:1], max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = module.generate(ids[:1], NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, single) and got.shape[1] <= PROMPT + 3


def test_generate_refuses_right_padding_and_overlong_requests():
    _, module = pair("llama")
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="left-padded"):
        module.generate(ids, 2, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        module.generate(ids, 100)


class Prompts(Dataset):
    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


class GeneratingLM(HFCausalLM):
    def predict_step(self, batch, batch_idx):
        return self.generate(batch["input_ids"], NEW, attention_mask=batch["attention_mask"], eos_token_id=[])


class UnitBytes(L.Callback):
    """The bytes one pass reads from the SSD: every unit's SSD share of the weights, page-rounded."""

    def on_predict_start(self, trainer, pl_module):
        self.per_pass = sum(unit.weights.ssd_bytes for unit in trainer.strategy.engine.units)


def test_generate_under_greedysnake_reads_each_unit_once_per_token(tmp_path):
    hf = hf_model("llama").eval()
    hf.save_pretrained(tmp_path / "start")
    ids, mask = left_padded()
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
    units = UnitBytes()
    strategy = snake_strategy.GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                                                  schedule={"num_micro_batches": 2})
    trainer = L.Trainer(strategy=strategy, precision="64-true", callbacks=[units], **trainer_kwargs())
    (got,) = trainer.predict(GeneratingLM(tmp_path / "start"), DataLoader(Prompts(ids, mask), batch_size=3))
    assert torch.equal(got, expected)
    # NEW passes (the prompt, then one per new token but the last), each reading every unit once.
    assert units.per_pass > 0
    assert strategy.eval_traffic["ssd/weights/read"] == NEW * units.per_pass
    assert not any(key.endswith("/write") for key in strategy.eval_traffic)


@pytest.mark.parametrize("strategy", ["greedysnake", "auto"])
def test_generate_in_predict_without_a_predict_step(strategy, tmp_path):
    """HFCausalLM(dir, generate_in_predict={...}): trainer.predict returns transformers' generate tokens,
    with no hand-written predict_step, under greedysnake (weights streamed from the SSD) and plain."""
    hf = hf_model("llama").eval()
    hf.save_pretrained(tmp_path / "start")
    ids, mask = left_padded()
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
    if strategy == "greedysnake":
        strategy = snake_strategy.GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                                                      schedule={"num_micro_batches": 2})
    trainer = L.Trainer(strategy=strategy, precision="64-true", **trainer_kwargs())
    module = HFCausalLM(tmp_path / "start", generate_in_predict={"max_new_tokens": NEW, "eos_token_id": []})
    (got,) = trainer.predict(module, DataLoader(Prompts(ids, mask), batch_size=3))
    assert torch.equal(got, expected)
    if not isinstance(strategy, str):
        assert strategy.eval_traffic["ssd/weights/read"] > 0
    assert module.hparams["generate_in_predict"] == {"max_new_tokens": NEW, "eos_token_id": []}
    with pytest.raises(ValueError, match="max_new_tokens required"):
        HFCausalLM(tmp_path / "start", generate_in_predict={"temperature": 0.7})
