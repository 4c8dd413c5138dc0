"""A model bigger than the machine, first step to last, at toy scale (issue 22): the real memory limit
(a fake cgroup tree), the trained weights after fit at any size (a mapped safetensors file), clean
modules after failures in every phase, and a dead run's ssd_dir reclaimed.

The budgets here (a hard one, or a fake cgroup) are smaller than the weights (6.4 MB) and larger than the
working set of a few units, as a 4B model's are on a 16 GiB machine.
"""
from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.engine import EngineHooks
from snake_strategy.engine.state.weights_file import map_weights_file, mapped_parameters
from snake_strategy.gpt import GPTConfig, GPTModule
from snake_strategy.planning.machine import (CGROUP_HEADROOM_SHARE, SOURCE_AVAILABLE, SOURCE_CGROUP, SOURCE_GIVEN,
                                             cgroup_headroom, host_budget)
from snake_strategy.progress import Progress
from snake_strategy.sources.safetensors_io import ShardedSafetensorsWriter
from snake_strategy.storage import SsdDirectory
from tests.helpers import fit_snake, token_data, trainer_kwargs

CFG = GPTConfig(vocab_size=64, d_model=64, num_layers=32, num_heads=4, context_len=16)  # 6.4 MB of fp32 weights
BUDGET_BYTES = 3 * 2**20  # holds a few units, not the weights
HEADROOM_BYTES = 7 * 2**19  # a fake cgroup's limit - usage: 0.9 x 3.5 MiB, about the hard budget above
SSD_STATES = {"weights": "ssd", "optimizer": "ssd", "gradients": "ssd"}


def _loader(num_samples: int = 16, batch: int = 4) -> DataLoader:
    x, y = token_data(num_samples, CFG.context_len, CFG.vocab_size)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _fake_cgroup(root, limit_bytes: int, usage_bytes: int) -> None:
    """A cgroup tree mirroring this process's own membership (``/proc/self/cgroup``), with one limit."""
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            where, files = root / path.lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            where, files = root / "memory" / path.lstrip("/"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        where.mkdir(parents=True, exist_ok=True)
        (where / files[0]).write_text(f"{limit_bytes}\n")
        (where / files[1]).write_text(f"{usage_bytes}\n")


def _fit(root, steps: int = 2, module: GPTModule | None = None, budget: int | None = None, hooks=None,
         callbacks=(), progress=None, **storage) -> tuple[GPTModule, snake_strategy.GreedySnakeStrategy]:
    run = fit_snake(module if module is not None else (lambda: GPTModule(CFG)), _loader(), steps=steps,
                    storage={"ssd_dir": str(root / "ssd"), **SSD_STATES, "host_budget_bytes": budget, **storage},
                    schedule={"num_micro_batches": 2}, hooks=hooks, progress=progress, callbacks=callbacks,
                    record=None, trainer_extra={"default_root_dir": str(root)})
    return run.module, run.strategy


def _values(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


# ---------------------------------------------------------------------- item 1: the real memory limit
def test_host_budget_is_the_tightest_of_given_memavailable_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 100 kB\nMemAvailable: {10 * 2**20} kB\n")  # 10 GiB available
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{4 * 2**30}\n")  # the parent's limit binds the child too
    (v2 / "job" / "memory.current").write_text(f"{2**30}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (v2 / "job" / "step" / "memory.current").write_text(f"{2**29}\n")
    membership = tmp_path / "self_cgroup"
    membership.write_text("0::/job/step\n")
    headroom = cgroup_headroom(str(v2), str(membership))
    assert headroom.headroom_bytes == 3 * 2**30 and headroom.path.endswith("job")
    # Reclaimable page cache is not usage: the kernel drops it before it would kill anything.
    (v2 / "job" / "memory.stat").write_text(f"anon 1000\ninactive_file {2**29}\nactive_file 10\n")
    assert cgroup_headroom(str(v2), str(membership)).headroom_bytes == 3 * 2**30 + 2**29
    (v2 / "job" / "memory.stat").unlink()
    kw = dict(cgroup_root=str(v2), self_cgroup_path=str(membership), meminfo_path=str(meminfo))
    budget = host_budget(None, **kw)
    assert (budget.source, budget.budget_bytes, budget.hard) == (SOURCE_CGROUP, int(CGROUP_HEADROOM_SHARE * 3 * 2**30), False)
    assert "memory.max" not in budget.detail and "limit 4.00 GiB" in budget.detail
    assert host_budget(None, processes_per_node=2, **kw).budget_bytes == int(CGROUP_HEADROOM_SHARE * 3 * 2**30 / 2)
    given = host_budget(2**30, **kw)
    assert (given.source, given.budget_bytes, given.hard) == (SOURCE_GIVEN, 2**30, True)
    # A given budget replaces the MemAvailable estimate (6 GiB here) but not the cgroup's limit.
    v2_free = host_budget(7 * 2**30, meminfo_path=str(meminfo), self_cgroup_path=str(tmp_path / "none"))
    assert (v2_free.source, v2_free.budget_bytes) == (SOURCE_GIVEN, 7 * 2**30)
    # An explicit budget larger than what the cgroup allows is bounded by the cgroup (and stays the hard cap).
    assert host_budget(8 * 2**30, **kw).source == SOURCE_CGROUP
    # cgroup v1: the memory controller's own hierarchy; its "no limit" is a huge number.
    v1 = tmp_path / "v1"
    (v1 / "memory" / "a").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1\n")
    (v1 / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{2 * 2**30}\n")
    (v1 / "memory" / "a" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    membership.write_text("4:memory:/a\n1:cpu:/\n0::/\n")
    v1_budget = host_budget(None, cgroup_root=str(v1), self_cgroup_path=str(membership), meminfo_path=str(meminfo))
    assert (v1_budget.source, v1_budget.budget_bytes) == (SOURCE_CGROUP, int(CGROUP_HEADROOM_SHARE * 2**30))
    # No limited cgroup: MemAvailable.
    (v1 / "memory" / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    plain = host_budget(None, cgroup_root=str(v1), self_cgroup_path=str(membership), meminfo_path=str(meminfo))
    assert (plain.source, plain.budget_bytes) == (SOURCE_AVAILABLE, int(0.6 * 10 * 2**30))


# ---------------------------------------------------------------------- item 2: the weights after fit
@pytest.fixture(scope="module")
def mapped_run(tmp_path_factory):
    """One run in memory (no budget) and the same run under a fake cgroup smaller than the weights."""
    root = tmp_path_factory.mktemp("mapped")
    reference, _ = _fit(root / "reference")
    expected = _values(reference)
    cgroup = root / "cgroup"
    # Headroom 3.5 MiB: the automatic budget (0.9 x 3.5 MiB) holds the working set, not the 6.4 MB of weights.
    _fake_cgroup(cgroup, limit_bytes=64 * 2**20, usage_bytes=64 * 2**20 - HEADROOM_BYTES)
    mp = pytest.MonkeyPatch()
    mp.setenv("SNAKE_CGROUP_ROOT", str(cgroup))
    try:
        module, strategy = _fit(root / "mapped")
    finally:
        mp.undo()
    return root, reference, expected, module, strategy


def test_weights_over_a_cgroup_budget_are_mapped_from_a_file(mapped_run):
    root, _, expected, module, strategy = mapped_run
    assert strategy.plan.host_budget_source == SOURCE_CGROUP
    assert strategy.plan.host_budget_bytes == int(CGROUP_HEADROOM_SHARE * HEADROOM_BYTES)
    assert "bounded by cgroup" in strategy.plan.describe()
    # No export_dir: where the SSD tier lives (the run's ssd_dir), under a name of its own that is already gone.
    assert os.path.dirname(strategy.weights_file) == str(root / "mapped" / "ssd")
    assert os.path.basename(strategy.weights_file).startswith("greedysnake-weights-pid")
    assert not os.path.exists(strategy.weights_file)
    assert set(mapped_parameters(module).values()) == {strategy.weights_file}
    assert set(mapped_parameters(module)) == {n for n, _ in module.named_parameters()}
    # Mapped shared (the kernel's "s" flag): a private writable map is charged whole against the commit limit,
    # which refuses one larger than the machine's RAM (a 7B model's 27 GB on 24 GiB).
    with open("/proc/self/maps") as maps:
        flags = {line.split()[1] for line in maps if strategy.weights_file in line}
    assert flags and all(f.endswith("s") for f in flags), flags
    _assert_equal(_values(module), expected)  # bitwise the weights an in-memory export gives
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    _assert_equal(torch.load(buffer), expected)


@pytest.mark.slow  # several fits of a 32-unit model (about a minute on 2 loaded cores)
def test_mapped_weights_validate_and_train_again_like_in_memory_ones(mapped_run, tmp_path):
    root, reference, _, module, strategy = mapped_run
    val = _loader(8, 4)

    def validate(m):
        trainer = L.Trainer(strategy=snake_strategy.GreedySnakeStrategy(), **trainer_kwargs(limit_val_batches=2))
        return trainer.validate(m, val, verbose=False)[0]["val_loss"]

    assert validate(module) == validate(reference)
    assert set(mapped_parameters(module).values()) == {strategy.weights_file}  # evaluation keeps the map
    # A second fit of each, from the first fit's weights: the mapped one under the same small budget.
    _fit(tmp_path / "again_ref", module=reference)
    _, again = _fit(tmp_path / "again", module=module, budget=BUDGET_BYTES)
    _assert_equal(_values(module), _values(reference))
    assert again.weights_file != strategy.weights_file
    assert set(mapped_parameters(module).values()) == {again.weights_file}


def test_export_log_line_names_the_file_and_its_size(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="snake_strategy.weights_handback"):
        _, strategy = _fit(tmp_path, budget=BUDGET_BYTES, export_dir=str(tmp_path / "exported"))
    size = os.path.getsize(strategy.weights_file)  # kept: export_dir names a place for it
    assert strategy.weights_file == str(tmp_path / "exported" / "greedysnake-weights.safetensors")
    assert any(strategy.weights_file in r.message and f"{size} bytes" in r.message for r in caplog.records)


def test_checkpoint_directory_holds_only_the_checkpoints(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1, save_last=True)
    module, strategy = _fit(tmp_path / "root", budget=BUDGET_BYTES, callbacks=[ckpt])
    assert set(mapped_parameters(module).values()) == {strategy.weights_file}
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_export_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="storage.export_dir=.*a_file' is a file, not a directory"):
        snake_strategy.StorageConfig(export_dir=str(tmp_path / "a_file"))
    with pytest.raises(ValueError, match="storage.export_dir='' must be a directory path"):
        snake_strategy.StorageConfig(export_dir="")


# A fit whose weights exceed the budget, with a temporary SSD tier (no ssd_dir): the module maps the weights
# file after fit, reads it after teardown removed the tier's directory, and equals the engine's last state.
_MAPPED_FIT = """
import json, logging, os, sys
import torch
from snake_strategy.engine.state.weights_file import mapped_parameters
from snake_strategy.gpt import GPTModule
from tests.helpers import fit_snake
from tests.lifecycle.test_weights_after_fit import BUDGET_BYTES, CFG, SSD_STATES, _loader

logging.basicConfig(level=logging.INFO)
run = fit_snake(lambda: GPTModule(CFG), _loader(), steps=2, storage={**SSD_STATES, "host_budget_bytes": BUDGET_BYTES},
                schedule={"num_micro_batches": 2}, record="last", trainer_extra={"default_root_dir": sys.argv[1]})
module, strategy, trained = run.module, run.strategy, run.last
state = module.state_dict()
print(json.dumps({
    "weights_file": strategy.weights_file, "exists": os.path.exists(strategy.weights_file),
    "tier_dir_exists": os.path.exists(os.path.dirname(strategy.weights_file)),
    "all_mapped": set(mapped_parameters(module).values()) == {strategy.weights_file}
                  and set(mapped_parameters(module)) == {n for n, _ in module.named_parameters()},
    "names_equal": {n for n, _ in module.named_parameters()} == set(trained),
    "different": sorted(n for n in trained if not torch.equal(state[n], trained[n]))}))
"""


def test_weights_over_the_budget_leave_nothing_behind_the_process(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _MAPPED_FIT, str(root)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # While alive: every parameter mapped from the file, every weight the trained one, the name already gone.
    assert seen["all_mapped"] and seen["names_equal"] and seen["different"] == []
    assert not seen["exists"] and not seen["tier_dir_exists"]
    assert not seen["weights_file"].startswith(str(root))
    assert "goes away with this process" in done.stderr
    # After: default_root_dir holds nothing (no checkpoints or logs were asked for), the file is gone.
    assert list(root.rglob("*")) == []
    assert not os.path.exists(seen["weights_file"])


def test_a_file_of_mixed_dtypes_maps_and_saves(tmp_path):
    values = {"a": torch.randn(3, 5, dtype=torch.float64), "b": torch.randn(7).bfloat16(),
              "c": torch.randn(2, 3), "d": torch.randn(5).half()}
    writer = ShardedSafetensorsWriter(tmp_path, [(k, v.dtype, v.shape) for k, v in values.items()])
    for k, v in values.items():
        writer.write(k, v)
    writer.close()
    mapped = map_weights_file(str(tmp_path / "model.safetensors"))
    _assert_equal(mapped, values)
    buffer = io.BytesIO()
    torch.save(mapped, buffer)  # one storage per dtype: torch.save refuses two dtypes over one storage
    buffer.seek(0)
    _assert_equal(torch.load(buffer), values)


@pytest.mark.slow  # several fits of a 32-unit model (about a minute on 2 loaded cores)
def test_export_hf_after_a_mapped_fit(tmp_path):
    transformers = pytest.importorskip("transformers")
    from snake_strategy.hf import HFCausalLM, export_hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    x, _ = token_data(8, 16, 64)
    loader = DataLoader([{"input_ids": row, "labels": row} for row in x], batch_size=4)

    def fit(budget, root):
        torch.manual_seed(0)
        module = HFCausalLM(config, learning_rate=1e-2)
        strategy = snake_strategy.GreedySnakeStrategy(
            storage={"ssd_dir": str(root / "ssd"), **SSD_STATES, "host_budget_bytes": budget},
            schedule={"num_micro_batches": 2})
        L.Trainer(strategy=strategy, max_steps=2, **trainer_kwargs(default_root_dir=str(root))).fit(module, loader)
        return module, strategy

    reference, _ = fit(None, tmp_path / "a")
    module, strategy = fit(BUDGET_BYTES, tmp_path / "b")  # 4.8 MB of weights
    assert strategy.weights_file is not None and mapped_parameters(module)
    export_hf(module, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, value in reference.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


# ---------------------------------------------------------------------- item 3: clean modules after failures
class Boom(RuntimeError):
    pass


def _raise_on_call(n: int):
    calls = {"n": 0}

    def hook(*args):
        calls["n"] += 1
        if calls["n"] == n:
            raise Boom(f"injected failure at call {n}")
    return hook


def test_setup_failure_of_a_meta_built_module_names_the_failure(tmp_path):
    torch.manual_seed(0)
    module = GPTModule(CFG)  # its blocks are built on the meta device inside fit: there are no pre-fit weights
    with pytest.raises(Boom):
        _fit(tmp_path, module=module, hooks=EngineHooks(before_ssd_transfer=_raise_on_call(20)))
    with pytest.raises(ValueError, match="fit failed during setup.*Boom: injected failure at call 20"):
        module.state_dict()


@pytest.mark.parametrize("first_budget", [None, BUDGET_BYTES], ids=["in_memory", "mapped"])
def test_setup_failure_gives_the_pre_fit_weights_back(tmp_path, first_budget):
    module, _ = _fit(tmp_path / "first", budget=first_budget)
    before = _values(module)
    with pytest.raises(Boom):  # the original exception, raised mid-materialization (units already moved)
        _fit(tmp_path / "second", module=module, hooks=EngineHooks(before_ssd_transfer=_raise_on_call(20)))
    assert not any(p.is_meta for p in module.parameters())
    _assert_equal(_values(module), before)


def _fail_at_step(step: int):
    """A hook that fails the optimizer worker once ``state['armed']`` is set (by a callback at ``step``)."""
    state = {"armed": False}

    class Arm(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            state["armed"] = batch_idx + 1 == step

    def hook(unit):
        if state["armed"]:
            raise Boom(f"injected failure in step {step}")
    return EngineHooks(before_optimizer_chunk=hook), Arm()


class FailAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx + 1 == self.step:
            raise Boom(f"injected failure in step {self.step}")


def test_step_failure_over_the_budget_starts_no_export(tmp_path, monkeypatch):
    events = []
    cgroup = tmp_path / "cgroup"
    _fake_cgroup(cgroup, limit_bytes=64 * 2**20, usage_bytes=64 * 2**20 - HEADROOM_BYTES)
    monkeypatch.setenv("SNAKE_CGROUP_ROOT", str(cgroup))  # the automatic budget, which main did not read
    torch.manual_seed(0)
    module = GPTModule(CFG)
    with pytest.raises(Boom, match="injected failure in step 2"):
        _fit(tmp_path, module=module, callbacks=[FailAtStep(2)], progress=Progress(listeners=[events.append]))
    assert "export" not in {e.phase for e in events}
    assert not (tmp_path / "greedysnake-weights.safetensors").exists()
    with pytest.raises(ValueError, match="fit failed \\(Boom: injected failure in step 2\\).*multi-GB export"):
        module.state_dict()


@pytest.mark.slow  # several fits of a 32-unit model (about a minute on 2 loaded cores)
def test_step_failure_of_a_second_fit_gives_the_mapped_pre_fit_weights_back(tmp_path):
    module, first = _fit(tmp_path / "first", budget=BUDGET_BYTES)
    before = _values(module)
    hooks, arm = _fail_at_step(2)
    with pytest.raises(Boom):
        _fit(tmp_path / "second", module=module, budget=BUDGET_BYTES, hooks=hooks, callbacks=[arm])
    _assert_equal(_values(module), before)
    assert set(mapped_parameters(module).values()) == {first.weights_file}


def test_save_failure_leaves_a_clean_module_and_its_error(tmp_path):
    class FailingSave(L.Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint):
            raise Boom("injected failure in a save")

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1)
    torch.manual_seed(0)
    module = GPTModule(CFG)
    with pytest.raises(Boom, match="in a save"):
        _fit(tmp_path, module=module, budget=BUDGET_BYTES, callbacks=[ckpt, FailingSave()])
    with pytest.raises(ValueError, match="fit failed \\(Boom: injected failure in a save\\)"):
        module.state_dict()
    # Weights that fit the budget come back in memory, also after a failure: the last step's.
    torch.manual_seed(0)
    small = GPTModule(CFG)
    with pytest.raises(Boom):
        _fit(tmp_path / "fits", module=small, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c2"),
                                                                          every_n_train_steps=1), FailingSave()])
    assert not any(p.is_meta for p in small.parameters())


@pytest.mark.slow  # several fits of a 32-unit model (about a minute on 2 loaded cores)
def test_teardown_failure_during_the_export_leaves_a_clean_module(tmp_path):
    module, first = _fit(tmp_path / "first", budget=BUDGET_BYTES)
    before = _values(module)

    def fail_in_export(event):
        if event.phase == "export" and event.done >= 3:
            raise Boom("injected failure while exporting")

    with pytest.raises(Boom, match="while exporting"):
        _fit(tmp_path / "second", module=module, budget=BUDGET_BYTES, progress=Progress(listeners=[fail_in_export]))
    _assert_equal(_values(module), before)  # the pre-fit (first fit's) weights, mapped again
    assert not list(tmp_path.rglob("greedysnake-weights*"))  # no partial file, no name of the first fit's either


# ---------------------------------------------------------------------- item 4: a dead run's ssd_dir
_DEAD_RUN = """
import os, signal, sys
from snake_strategy.storage import SsdDirectory
ssd = SsdDirectory(sys.argv[1], use_o_direct=False)
fd = ssd.open("weights/unit00000.bin", 4 << 20)
os.pwrite(fd, b"x" * (4 << 20), 0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _dead_run(path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _DEAD_RUN, str(path)], env=env)
    assert done.returncode == -signal.SIGKILL
    assert (path / "weights" / "unit00000.bin").stat().st_blocks * 512 >= 4 << 20  # it left its state


def test_a_dead_runs_ssd_dir_is_reclaimed(tmp_path):
    ssd_dir = tmp_path / "ssd"
    _dead_run(ssd_dir)
    (ssd_dir / "user_notes.txt").write_text("mine")  # a user's file in the same directory stays
    SsdDirectory(str(ssd_dir), use_o_direct=False).close()
    assert sorted(p.name for p in ssd_dir.iterdir()) == ["user_notes.txt"]


def test_free_space_refusal_names_what_dead_runs_left(tmp_path):
    dead = tmp_path / "dead_ssd"
    _dead_run(dead)
    ssd = SsdDirectory(str(tmp_path / "new_ssd"), use_o_direct=False)
    try:
        with pytest.raises(ValueError, match=f"dead runs left .*{dead} \\(dead pid \\d+, 0.00391 GiB\\)"):
            ssd.check_free_space(2**62, "weights")
    finally:
        ssd.close()


@pytest.mark.slow  # two validations of a 32-unit model
def test_evaluation_plans_for_its_own_working_set(mapped_run):
    """A budget below a training step's working set (optimizer chunk, gradient buffers) but above
    evaluation's (streamed units, non-layer weights): validate plans a weights split and runs."""
    _, reference, _, module, _ = mapped_run
    val = _loader(8, 4)
    strategy = snake_strategy.GreedySnakeStrategy(storage={"placement": "auto", "host_budget_bytes": 3 * 2**19})
    loss = L.Trainer(strategy=strategy, **trainer_kwargs(limit_val_batches=2)).validate(module, val, verbose=False)
    assert 0 < strategy.plan.storage.weights.ssd < 1
    expected = L.Trainer(strategy=snake_strategy.GreedySnakeStrategy(),
                         **trainer_kwargs(limit_val_batches=2)).validate(reference, val, verbose=False)
    assert loss[0]["val_loss"] == expected[0]["val_loss"]


@pytest.mark.slow  # a LoRA fit of a 32-unit model
def test_peft_save_pretrained_after_a_mapped_fit(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    module = GPTModule(CFG)
    module.configure_model()
    peft_model = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "attn_out"],
                                                             lora_dropout=0.0))
    _fit(tmp_path, module=module, budget=BUDGET_BYTES)  # 6.4 MB of base weights + adapters over 3 MiB
    assert mapped_parameters(module)
    peft_model.save_pretrained(str(tmp_path / "adapter"))  # safetensors: views of one map, none overlapping
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    adapters = {f"base_model.model.{n.replace('.default', '')}": p for n, p in module.named_parameters()
                if "lora_" in n}
    assert adapters and saved.keys() == adapters.keys()
    for key, value in adapters.items():
        assert torch.equal(saved[key], value.detach()), key


def test_weights_that_fit_only_without_the_engine_are_mapped_not_copied(tmp_path):
    """The export copies the weights while the engine still holds its host memory: weights that fit the
    budget alone, but not next to the engine, go to a mapped file (the in-memory copy is what an 8 GiB
    cgroup OOM-killed on gpt_1b); with room for both they go back in memory."""
    module, roomy = _fit(tmp_path / "a", budget=64 * 2**20)
    assert roomy.weights_file is None  # in memory
    weights_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    budget = weights_bytes + roomy.plan.host_bytes - 1
    assert weights_bytes < budget
    mapped, tight = _fit(tmp_path / "b", budget=budget)
    assert tight.plan.host_bytes == roomy.plan.host_bytes  # the same plan: only the export's choice differs
    assert tight.weights_file is not None
    assert set(mapped_parameters(mapped)) == {n for n, _ in mapped.named_parameters()}
