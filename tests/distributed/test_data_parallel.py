"""Data parallel with real processes (gloo on 127.0.0.1): N ranks x M micro-batches equal 1 rank x N*M
micro-batches over the same global batches, through Lightning's own launcher (the worker script is
re-run for rank 1) and through torchrun with two "nodes" on this machine.

Each run is ``tests/distributed/dp_worker.py CONFIG.json`` in a subprocess; every rank writes its final parameters,
per-step stats, reduction records and task list. The default suite runs three 2-rank comparisons
(vertical on the SSD, partitioned norm clipping, replicated moments) and the input checks; the rest is
``--runslow``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from snake_strategy.distributed import check_rank_loader, rank_storage
from snake_strategy.config import StorageConfig
from snake_strategy.engine.parallel.partition import shard_bounds
from snake_strategy.engine.parallel.reduce import ring_all_reduce_sent_bytes
from snake_strategy.schedule import BACKWARD

from tests.helpers import SMALL_GPT, fit_snake, max_abs_diff, token_loader

WORKER = Path(__file__).with_name("dp_worker.py")
REPO = Path(__file__).resolve().parents[2]
SSD = {"weights": {"ssd": 1.0}, "optimizer": {"ssd": 1.0}, "checkpoints": {"host": 1.0}}


def run_worker(tmp_path: Path, name: str, torchrun_nodes: int = 0, expect_rc: int | None = 0, **cfg) -> dict:
    """Run the worker (ranks included); returns {rank: output}."""
    out = tmp_path / name
    cfg = {"out": str(out), **cfg}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    if torchrun_nodes:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={torchrun_nodes}", f"--node_rank={node}",
             "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={cfg['port']}", str(WORKER), str(path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(torchrun_nodes)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        codes = [p.returncode for p in procs]
        assert codes == [0] * torchrun_nodes, "\n".join(o[-3000:] for o in outputs)
    else:
        done = subprocess.run([sys.executable, str(WORKER), str(path)], env=env, capture_output=True, text=True,
                              timeout=300)
        if expect_rc is not None:
            assert done.returncode == expect_rc, (done.stdout[-3000:] + done.stderr[-5000:])
        if expect_rc != 0:
            return {"returncode": done.returncode, "stderr": done.stderr}
    return {int(f.stem[4:]): torch.load(f, weights_only=False) for f in sorted(out.glob("rank*.pt"))}


def _check_ranks_agree(ranks: dict) -> None:
    assert sorted(ranks) == [0, 1]
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key  # bitwise: one reduced sum


def test_two_ranks_equal_one_rank_vertical_ssd_alpha(tmp_path):
    common = dict(steps=3, kind="vertical", alpha=0.25, storage={**SSD, "ssd_dir": str(tmp_path / "ssd")})
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    assert not (tmp_path / "ssd").exists()  # the ssd_dir the run created is removed ...
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    assert not (tmp_path / "ssd").exists()  # ... by two ranks as by one process (rank dirs and their root)
    _check_ranks_agree(two)
    assert max_abs_diff(one[0]["state"], two[0]["state"]) < 1e-10
    assert two[0]["world_size"] == 2 and two[0]["sampler"] == "DistributedSampler"
    # Each rank has its own SSD directory under ssd_dir.
    assert [two[r]["stats"][-1]["ssd_dir"] for r in (0, 1)] == [str(tmp_path / "ssd" / f"rank{r}") for r in (0, 1)]
    last = two[0]["stats"][-1]
    # One reduction per unit per step, launched right after the unit's last backward task (before the next
    # unit's backward starts), and the non-layer one at the end; the counted bytes are the ring model's.
    tasks, records = last["tasks"], last["reductions"]
    unit_records = [r for r in records if r["unit"] >= 0]
    assert [r["unit"] for r in unit_records] == sorted({t[1] for t in tasks if t[0] == BACKWARD}, reverse=True)
    for record in unit_records:
        last_backward = max(i for i, t in enumerate(tasks) if t[0] == BACKWARD and t[1] == record["unit"])
        assert record["tasks_before"] == last_backward + 1
    assert records[-1]["unit"] == -1 and records[-1]["tasks_before"] == len(tasks)
    # Partitioned (the default): unit gradients are reduce-scattered ((N-1)/N of the padded payload sent,
    # plus the small used-parameter mask), the non-layer ones all-reduced, the weights all-gathered.
    sent = {k: v for k, v in last["traffic"].items() if k.startswith("net/")}
    assert all(r["kind"] == "reduce_scatter" for r in unit_records) and records[-1]["kind"] == "all_reduce"
    assert sent["net/gradients/sent"] == sum(r["sent_bytes"] for r in unit_records)
    assert sent["net/nonlayer_gradients/sent"] == records[-1]["sent_bytes"] == ring_all_reduce_sent_bytes(
        records[-1]["payload_bytes"], 2)
    padded = [-(-unit["train_end"] // 8192) * 8192 for unit in last["layout"]]  # 2 shards of whole 4096 pages
    assert [r["payload_bytes"] for r in unit_records] == [8 * p for p in reversed(padded)]  # fp64, every unit
    for r in unit_records:
        assert r["payload_bytes"] // 2 <= r["sent_bytes"] < r["payload_bytes"] // 2 + 4096
    assert sent["net/weights/sent"] == sum(8 * p // 2 for p in padded)  # each rank sends its shard
    # Each rank keeps its shard of every unit's moments (rank 0 the first whole pages, rank 1 the rest), the
    # weights whole.
    for r in (0, 1):
        layout = two[r]["stats"][-1]["layout"]
        shards = [shard_bounds(u["train_end"], 2, r) for u in layout]
        assert [u["exp_avg_ssd"] for u in layout] == [-(-8 * (hi - lo) // 4096) * 4096 for lo, hi in shards]
        assert [u["weights_ssd"] for u in layout] == [u["weights_ssd"] for u in one[0]["stats"][-1]["layout"]]
    # The free-space check's plan is per rank: its moments are this rank's shards, as the files on its disk.
    for ranks in (one, two):
        for r, out in ranks.items():
            stats = out["stats"][-1]
            files, planned = stats["ssd_files"], stats["ssd_plan"]
            moments = sum(size for name, size in files.items() if name.startswith(("exp_avg/", "exp_avg_sq/")))
            assert planned["optimizer_moments"] == moments > 0
            assert planned["weights"] == sum(size for name, size in files.items() if name.startswith("weights/"))
            assert sum(planned.values()) == sum(files.values())
    assert two[0]["stats"][-1]["ssd_plan"]["optimizer_moments"] + two[1]["stats"][-1]["ssd_plan"]["optimizer_moments"] \
        == one[0]["stats"][-1]["ssd_plan"]["optimizer_moments"]


@pytest.mark.parametrize("shard,optimizer", [(True, "sgd_nesterov"), (False, "sgd_nesterov"), (True, "sgd")])
def test_two_ranks_equal_one_rank_with_sgd(tmp_path, shard, optimizer):
    """An element-wise optimizer other than Adam (SGD, Nesterov momentum): its momentum partitioned by element
    ranges like Adam's moments (or replicated), two ranks equal to one process; and SGD without momentum,
    which keeps no state at all, partitioned."""
    common = dict(steps=3, kind="vertical", alpha=0.25, storage=SSD, shard=shard, optimizer=optimizer)
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    _check_ranks_agree(two)
    assert max_abs_diff(one[0]["state"], two[0]["state"]) < 1e-10
    layout = two[0]["stats"][-1]["layout"]
    shards = [shard_bounds(u["train_end"], 2, 0) if shard else (0, u["train_end"]) for u in layout]
    if optimizer == "sgd_nesterov":
        assert [u["momentum_buffer_ssd"] for u in layout] == [-(-8 * (hi - lo) // 4096) * 4096 for lo, hi in shards]
    else:
        assert not any(key.startswith("momentum_buffer") for key in layout[0])


def test_partitioned_state_of_a_per_tensor_optimizer_is_refused(tmp_path):
    out = run_worker(tmp_path, "two", world=2, micro=2, steps=1, storage=SSD, shard=True, optimizer="adafactor",
                     expect_rc=None)
    assert out["returncode"] != 0
    assert "shard_optimizer_state=False" in out["stderr"] and "Adafactor" in out["stderr"], out["stderr"][-3000:]


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


# In the default run (about 20 s each): partitioned norm clipping (a dropped all-reduce of the shard norms
# changes the clip factor) and replicated moments (a gradient never summed across ranks changes every
# update). The other combinations are --runslow.
@pytest.mark.parametrize("kind,clip,shard", [_slow("horizontal", None, True), ("vertical", 0.05, True),
                                             _slow("horizontal", 0.05, True), ("vertical", None, False),
                                             _slow("vertical", 0.05, False)])
def test_two_ranks_equal_one_rank_variants(tmp_path, kind, clip, shard):
    common = dict(steps=3, kind=kind, alpha=0.25, clip=clip, storage=SSD, shard=shard)
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    assert not (tmp_path / "ssd").exists()  # the ssd_dir the run created is removed ...
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    assert not (tmp_path / "ssd").exists()  # ... by two ranks as by one process (rank dirs and their root)
    _check_ranks_agree(two)
    assert max_abs_diff(one[0]["state"], two[0]["state"]) < 1e-10
    kinds = {r["kind"] for r in two[0]["stats"][-1]["reductions"] if r["unit"] >= 0}
    assert kinds == {"reduce_scatter" if shard else "all_reduce"}
    if clip is not None:
        norms = [s["grad_norm"] for s in one[0]["stats"]], [s["grad_norm"] for s in two[0]["stats"]]
        assert norms[0] == pytest.approx(norms[1], rel=1e-12)
        assert min(s["clip_factor"] for s in two[0]["stats"]) < 1.0  # the clip triggered


@pytest.mark.slow
def test_two_ranks_partitioned_speculative_step_rolls_back_exactly(tmp_path):
    """Norm clipping that alternates (the loss x8 on odd steps, max_norm 2 between the norms): each rank
    speculates on its shards, both ranks settle alike (one all-reduced norm) and roll back the odd steps,
    rollback state in SSD files; the result equals one rank's."""
    common = dict(steps=4, kind="vertical", alpha=0.25, clip=2.0, odd_factor=8.0, lr=1e-2, shard=True,
                  storage={**SSD, "rollback": "ssd"})
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    _check_ranks_agree(two)
    assert max_abs_diff(one[0]["state"], two[0]["state"]) < 1e-10
    for run in (one[0], two[0], two[1]):
        assert [s["clip_factor"] < 1.0 for s in run["stats"]] == [False, True, False, True]
        assert [s["speculation"] for s in run["stats"]] == [True, True, False, True]
        assert [s["rollbacks"] for s in run["stats"]] == [0, 1, 1, 2]
    files = two[0]["stats"][-1]["ssd_files"]
    assert any(name.startswith("rollback/") for name in files), sorted(files)  # this rank's shard's slots


@pytest.mark.slow
def test_two_ranks_fp32_with_validation(tmp_path):
    """fp32, validation after every step (flushes and gathers in the middle of training), and the logged
    train_loss synced across ranks (sync_dist) equals one process's."""
    common = dict(steps=2, kind="vertical", alpha=0.25, precision="32-true", storage=SSD, val=True)
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    assert not (tmp_path / "ssd").exists()  # the ssd_dir the run created is removed ...
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    assert not (tmp_path / "ssd").exists()  # ... by two ranks as by one process (rank dirs and their root)
    _check_ranks_agree(two)
    for key in one[0]["state"]:
        torch.testing.assert_close(two[0]["state"][key], one[0]["state"][key], rtol=1e-5, atol=1e-5)
    assert "val_loss" in two[0]["metrics"] and "val_loss" in two[1]["metrics"]
    assert two[0]["metrics"]["train_loss"] == two[1]["metrics"]["train_loss"]
    assert two[0]["metrics"]["train_loss"] == pytest.approx(one[0]["metrics"]["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_torchrun_two_nodes(tmp_path):
    """The cluster template: torchrun --nnodes=2 --node_rank={0,1} with one process per node (gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = dict(steps=2, kind="vertical", alpha=0.25, storage=SSD)
    one = run_worker(tmp_path, "one", world=1, micro=4, **common)
    two = run_worker(tmp_path, "two", torchrun_nodes=2, world=1, nodes=2, micro=2, port=port, **common)
    _check_ranks_agree(two)
    assert two[0]["world_size"] == 2
    assert max_abs_diff(one[0]["state"], two[0]["state"]) < 1e-10


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_both(tmp_path):
    """16-mixed, partitioned: an inf gradient on one rank only (step 2 of 4) skips that step on both ranks,
    as one process seeing the inf does: weights and moments unchanged, the scale halved, the step count
    kept, on every rank, at the same step as the one process; the ranks stay bitwise equal, and which rank
    saw the inf does not matter (bitwise).

    Against one process (whose micro-batches hold the same samples as the ranks', ``as_ranks``) the
    parameters agree to fp32 tolerance through the skipped step. Later steps drift apart by more (measured
    9.3e-5 after 4 steps with no inf at all): the two sum a unit's micro-batch gradients in another order
    (one fp32 ulp), and a weight one ulp off rounds to another fp16 value in the next forward now and then,
    which Adam's normalisation turns into differences of order lr; fp32 runs stay at 7.7e-7."""
    common = dict(steps=4, kind="vertical", alpha=0.25, precision="16-mixed", half_weights=False, storage=SSD,
                  record_every=True, lr=1e-3, tied_head=False)
    one = run_worker(tmp_path, "one", world=1, micro=4, as_ranks=2, poison={"step": 1, "rank": 0}, **common)
    two = run_worker(tmp_path, "two", world=2, micro=2, poison={"step": 1, "rank": 1}, **common)
    other = run_worker(tmp_path, "other", world=2, micro=2, poison={"step": 1, "rank": 0}, **common)
    for run in (one, two, other):
        for out in run.values():
            stats = out["stats"]
            assert [bool(s.get("skipped")) for s in stats] == [False, True, False, False]
            assert [s["step_count"] for s in stats] == [1, 1, 2, 3]
            assert [s["scale"] for s in stats] == [s["scale"] for s in one[0]["stats"]]
            assert stats[1]["scale"] == stats[0]["scale"] / 2
            before, after = out["states"][0], out["states"][1]
            assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step changed nothing
    _check_ranks_agree(two)
    _check_ranks_agree(other)
    for key in two[0]["state"]:
        assert torch.equal(two[0]["state"][key], other[0]["state"][key]), key
    for key in one[0]["states"][1]:  # through the skipped step
        torch.testing.assert_close(two[0]["states"][1][key], one[0]["states"][1][key], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- input checks (no processes)
def _sharded_loader(samples: int, batch: int, drop_last: bool = False) -> DataLoader:
    data = TensorDataset(torch.zeros(samples, 2))
    return DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False),
                      drop_last=drop_last)


def test_rank_loader_checks():
    check_rank_loader(_sharded_loader(16, 4), 4, 2)  # 8 samples per rank, 2 full batches
    with pytest.raises(ValueError, match="cannot share evenly"):
        check_rank_loader(_sharded_loader(15, 4), 4, 2)
    with pytest.raises(ValueError, match="not a multiple of the per-rank batch size"):
        check_rank_loader(_sharded_loader(12, 4), 4, 2)
    check_rank_loader(_sharded_loader(12, 4, drop_last=True), 4, 2)  # the short batch is dropped on every rank


def test_rank_storage_gives_each_rank_its_directory(tmp_path):
    storage = StorageConfig(ssd_dir=str(tmp_path), weights={"ssd": 1.0})
    assert rank_storage(storage, 0, 1) is storage
    assert rank_storage(storage, 3, 4).ssd_dir == str(tmp_path / "rank3")
    assert rank_storage(StorageConfig(), 1, 2).ssd_dir is None  # each process makes its own temporary directory


def _storage_checks(rank: int, world: int, port: int, tmp: str, results) -> None:
    """One of two gloo processes (no Lightning): run each layout case through check_rank_storage, and a
    setup that fails on rank 1 only through build_together; report every rank's error (or None)."""
    import torch.distributed as dist

    from snake_strategy.distributed import build_together, check_rank_storage

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    root = Path(tmp)
    cases = {"same": (root / "same", root / "same"), "roots": (root / "a", root / "b"),
             "link": (root / "link", root / "link"), "locked": (root / "locked", root / "locked"),
             "one_process": (root / "one", root / "one"), "unset": (root / "u", "$SNAKE_NO_SUCH_VAR/run")}
    out = {}
    for name, dirs in cases.items():
        try:
            check_rank_storage(StorageConfig(ssd_dir=str(dirs[rank]), weights="ssd"), rank, world)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)

    class Built:
        closed = False

        def close(self):
            Built.closed = True

    def build():
        if rank == 1:
            raise ValueError("storage.ssd_dir='/x/rank1' has 0 GiB free")
        return Built()

    try:
        build_together(build)
        out["build"] = None
    except ValueError as err:
        out["build"] = str(err)
    out["closed"] = Built.closed
    out["cleanup"] = _created_root_cleanup(rank, world, root)
    results[rank] = out
    dist.destroy_process_group()


def _created_root_cleanup(rank: int, world: int, tmp: Path) -> list:
    """Each rank builds a real SsdDirectory in ssd_dir/rank{r} through build_engine, rank 0 first (so rank 0
    makes the shared root), and closes it through close_engine, rank 0 first again: the root's creator is
    not the last to close, the order that left the root behind. Once with a root the run creates (and its
    missing parent), once with one that existed. Returns (created levels, root exists after rank r closed)."""
    import time

    import torch.distributed as dist

    from snake_strategy.distributed import build_engine, close_engine
    from snake_strategy.storage.ssd_directory import SsdDirectory

    out = []
    for root in (tmp / "new" / "ssd", tmp / "kept"):  # "kept" exists before the run
        storage = StorageConfig(ssd_dir=str(root), weights="ssd")

        def build():
            while rank == 1 and not (root / "rank0").is_dir():
                time.sleep(0.01)  # rank 0 makes the root
            return SsdDirectory(rank_storage(storage, rank, world).ssd_dir)

        engine, created = build_engine(build, storage, rank, world)
        dist.barrier()
        for turn in range(world):
            if turn == rank:
                close_engine(engine, created)
                exists = root.exists()
            dist.barrier()
        out.append((created, exists))
    return out


def test_mismatched_ssd_dir_layouts_stop_every_rank_before_setup(tmp_path):
    """Two real gloo processes: ranks of one machine with different ssd_dir roots, rank directories linked
    to one another, a rank directory (or the root) in use by a live run, an unexpanded variable: each is a
    ValueError on both ranks, before any lock is taken; a setup failure on one rank stops both. And the
    ssd_dir root a 2-rank run created is removed when the ranks close, whichever closes last."""
    import socket

    import torch.multiprocessing as mp

    (tmp_path / "link" / "rank0").mkdir(parents=True)
    (tmp_path / "link" / "rank1").symlink_to(tmp_path / "link" / "rank0")
    (tmp_path / "locked" / "rank1").mkdir(parents=True)
    (tmp_path / "kept").mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "locked" / "rank1" / ".snake.lock").write_text(str(sleeper.pid))
        (tmp_path / "one").mkdir()
        (tmp_path / "one" / ".snake.lock").write_text(str(sleeper.pid))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(_storage_checks, args=(2, port, str(tmp_path), results), nprocs=2, join=True)
    finally:
        sleeper.kill()
    results = dict(results)
    for r in (0, 1):
        got = results[r]
        assert got["same"] is None
        assert "were given different storage.ssd_dir roots" in got["roots"] and "ranks 0 and 1" in got["roots"]
        assert "would share the SSD directory" in got["link"]
        assert got["locked"].startswith("rank 1 ") and f"in use by a running process (pid {sleeper.pid}" in got["locked"]
        assert got["one_process"].startswith("rank 0 ") and "one-process run on storage.ssd_dir itself" in got["one_process"]
        assert "SNAKE_NO_SUCH_VAR" in got["unset"] and "environment variable that is not set" in got["unset"]
    assert results[0]["build"] == ("the setup failed on rank 1, so every rank stops: ValueError: "
                                   "storage.ssd_dir='/x/rank1' has 0 GiB free")
    assert results[1]["build"] == "storage.ssd_dir='/x/rank1' has 0 GiB free"  # its own error
    assert results[0]["closed"] and not results[1]["closed"]  # rank 0 releases what it built
    # devices=2 with an ssd_dir the run creates: gone once both ranks closed, as after one process (rank 0 made
    # it and closed first); a root that existed before stays, empty.
    new_root = tmp_path / "new" / "ssd"
    assert results[0]["cleanup"][0] == ([str(new_root), str(new_root.parent)], True)  # rank 1 still in it
    assert results[1]["cleanup"][0] == ([str(new_root), str(new_root.parent)], False)
    assert not (tmp_path / "new").exists()
    assert [r["cleanup"][1] for r in (results[0], results[1])] == [([], True), ([], True)]
    assert list((tmp_path / "kept").iterdir()) == []


def test_validate_on_two_ranks_checks_the_ranks_ssd_directories_too(tmp_path):
    """trainer.validate with devices=2 builds its engine as fit does: rank directories linked to one another
    are refused on both ranks before either takes a lock; a good layout validates and leaves nothing."""
    (tmp_path / "link" / "rank0").mkdir(parents=True)
    (tmp_path / "link" / "rank1").symlink_to(tmp_path / "link" / "rank0")
    bad = run_worker(tmp_path, "bad", expect_rc=None, world=2, micro=2, steps=1, validate_only=True,
                     storage={**SSD, "ssd_dir": str(tmp_path / "link")})
    assert bad["returncode"] != 0
    assert "would share the SSD directory" in bad["stderr"], bad["stderr"][-3000:]
    run_worker(tmp_path, "good", world=2, micro=2, steps=1, validate_only=True,
               storage={**SSD, "ssd_dir": str(tmp_path / "ssd")})
    assert not (tmp_path / "ssd").exists()  # the ssd_dir root the two ranks created is removed


# ---------------------------------------------------------------------- checkpoints
def _checkpointed_run(tmp_path: Path, steps: int = 4) -> tuple[dict, Path]:
    """2 ranks, 2 steps per epoch (a resume after step 2 starts a fresh epoch: same data order)."""
    cfg = dict(world=2, micro=2, steps=steps, samples=16, kind="vertical", alpha=0.25, storage=SSD, save_every=2,
               ckpt_dir=str(tmp_path / "ckpts"))
    full = run_worker(tmp_path, "full", **cfg)
    return full, tmp_path / "ckpts" / "epoch=0-step=2.ckpt"


def _resume_in_process(ckpt: Path, ssd_dir: Path, steps: int = 4) -> tuple[dict, Path]:
    """One process (this one), 1 x 4 micro-batches over the worker's global batches, from ``ckpt``; saves
    at step 4 into ssd_dir/../ckpts_one (one process's format)."""
    import lightning as L

    from snake_strategy.gpt import GPTModule

    out = ssd_dir.parent / "ckpts_one"
    L.seed_everything(0, verbose=False)  # the module's init, as the ranks drew it
    run = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3),
                    token_loader(16, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=steps, precision="64-true",
                    storage={**SSD, "ssd_dir": str(ssd_dir)},
                    schedule={"kind": "vertical", "num_micro_batches": 4, "alpha": 0.25}, record="last",
                    ckpt_dir=out, ckpt_every=2, ckpt_path=str(ckpt), seed=None)
    return run.last, out


def test_sharded_checkpoint_each_rank_writes_its_shard(tmp_path):
    """Partitioned moments: each rank writes its own shard of master weights and moments (rank 0 the
    manifest, last); consolidation merges the shards; one process resumes it (re-sharding at load) exactly;
    a missing shard is refused before any step, naming the file."""
    from snake_strategy import checkpoint as snake_checkpoint

    full, ckpt = _checkpointed_run(tmp_path, steps=2)
    manifest = snake_checkpoint.read_manifest(ckpt)  # verifies every file's size and CRC-32
    assert manifest["format"] == snake_checkpoint.SHARDED_FORMAT and not (ckpt / "units").exists()
    shards = manifest["shards"]
    assert shards["world_size"] == 2
    assert [w["pid"] for w in shards["writers"]] == [full[0]["pid"], full[1]["pid"]] and full[0]["pid"] != full[1]["pid"]
    layout = full[0]["stats"][-1]["layout"]
    for r in (0, 1):
        names = sorted(p.name for p in (ckpt / "shards" / f"rank{r}").iterdir())
        assert names == sorted(f"unit{u:05d}.{s}.bin" for u in range(len(layout)) for s in snake_checkpoint.STATES)
        for u, unit in enumerate(layout):
            lo, hi = shard_bounds(unit["train_end"], 2, r)
            assert shards["ranges"][u][r] == [lo, hi]
            for s in snake_checkpoint.STATES:  # fp64: this rank's range only, ~1/2 of the unit
                assert (ckpt / "shards" / f"rank{r}" / f"unit{u:05d}.{s}.bin").stat().st_size == 8 * (hi - lo)
    # Each rank's shard is its own range of whole pages; together they are every unit once. Each rank's save
    # wrote its shard only (its progress events count the bytes: 3 states x its range, fp64).
    total = sum(p.stat().st_size for p in (ckpt / "shards").rglob("*.exp_avg.bin"))
    assert total == 8 * sum(unit["train_end"] for unit in layout)
    for r in (0, 1):
        mine = sum(hi - lo for lo, hi in (shard_bounds(unit["train_end"], 2, r) for unit in layout))
        assert full[r]["saved_bytes"] == [3 * 8 * mine]
    # Evaluation and the HF export read the master weights through the same merge.
    from snake_strategy.checkpoint.consolidate import CheckpointWeights

    weights = CheckpointWeights(ckpt)
    try:
        for name, value in full[0]["state"].items():
            assert torch.equal(weights.tensor(name), value), name
    finally:
        weights.close()
    # Consolidation merges the shards: the 2-rank run's parameters after step 2, bitwise.
    merged = snake_checkpoint.consolidate(ckpt, tmp_path / "merged.ckpt")["state_dict"]
    for name, value in full[0]["state"].items():
        assert torch.equal(merged[name], value), name
    # A shard missing: refused before any step, naming the file and the fix.
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(ckpt, broken)
    (broken / "shards" / "rank1" / "unit00001.exp_avg_sq.bin").unlink()
    with pytest.raises(ValueError, match=r"(?s)shards/rank1/unit00001.exp_avg_sq.bin is missing.*saved by 2 ranks"
                                         r".*Copy or move the whole checkpoint directory"):
        _resume_in_process(broken, tmp_path / "ssd_broken")


@pytest.mark.slow
def test_resume_two_ranks_bitwise_and_on_one_rank_exact(tmp_path):
    """2 -> 2 from the per-rank shards is bitwise; 2 -> 1 (re-sharded at load) equals the 2-rank run, and its
    one-process checkpoint consolidates to what the 2-rank checkpoint of the same step consolidates to;
    1 -> 2 re-shards a one-process checkpoint."""
    from snake_strategy import checkpoint as snake_checkpoint

    full, ckpt = _checkpointed_run(tmp_path)
    _check_ranks_agree(full)
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    common = dict(steps=4, samples=16, kind="vertical", alpha=0.25, storage=SSD, resume=str(ckpt))
    again = run_worker(tmp_path, "again", world=2, micro=2, **common)
    _check_ranks_agree(again)
    for key in full[0]["state"]:
        assert torch.equal(again[0]["state"][key], full[0]["state"][key]), key
    one, one_ckpts = _resume_in_process(ckpt, tmp_path / "ssd_one")  # re-sharded: 1 x 2M micro-batches
    assert max_abs_diff(one, full[0]["state"]) < 1e-10
    one_step4 = one_ckpts / "epoch=1-step=4.ckpt"
    assert snake_checkpoint.read_manifest(one_step4)["format"] == snake_checkpoint.FORMAT  # one process's format
    merged_two = snake_checkpoint.load_consolidated(tmp_path / "ckpts" / "epoch=1-step=4.ckpt")["state_dict"]
    merged_one = snake_checkpoint.load_consolidated(one_step4)["state_dict"]
    assert max_abs_diff(merged_one, merged_two) < 1e-10
    # 1 -> 2: the one-process checkpoint of step 4 resumes on 2 ranks (each keeps its range of the moments).
    back = run_worker(tmp_path, "back", world=2, micro=2, **{**common, "steps": 6, "samples": 16,
                                                                "resume": str(one_step4)})
    _check_ranks_agree(back)


@pytest.mark.slow
def test_two_ranks_missing_shard_stops_every_rank(tmp_path):
    """A 2-rank resume with rank 1's shard incomplete: both ranks stop before any step with the file named
    (rank 0 reads only its own shard, but the ranks agree on the verification first: nobody waits)."""
    _, ckpt = _checkpointed_run(tmp_path, steps=2)
    victim = ckpt / "shards" / "rank1" / "unit00002.master.bin"
    victim.write_bytes(victim.read_bytes()[:-8])
    failed = run_worker(tmp_path, "failed", expect_rc=None, world=2, micro=2, steps=4, samples=16, kind="vertical",
                        alpha=0.25, storage=SSD, resume=str(ckpt))
    assert failed["returncode"] != 0
    assert "shards/rank1/unit00002.master.bin is shorter than the manifest says" in failed["stderr"], \
        failed["stderr"][-3000:]
    assert "Traceback" in failed["stderr"] and "optimizer_step" not in failed["stderr"]


@pytest.mark.slow
def test_rank_killed_inside_a_sharded_save_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1 dies right after writing the first file of its shard of the step-4 checkpoint: no checkpoint
    of step 4 appears under its name (the manifest comes last, after every shard), the step-2 one stays
    complete and resumes bitwise, and the run saves step 4 under that name afterwards."""
    from snake_strategy import checkpoint as snake_checkpoint

    full, _ = _checkpointed_run(tmp_path)
    cfg = dict(world=2, micro=2, steps=4, samples=16, kind="vertical", alpha=0.25, storage=SSD, save_every=2,
               ckpt_dir=str(tmp_path / "ckpts_killed"), kill_in_save={"rank": 1, "save": 2})
    killed = run_worker(tmp_path, "killed", expect_rc=None, **cfg)
    assert killed["returncode"] != 0
    names = sorted(p.name for p in (tmp_path / "ckpts_killed").iterdir())
    assert "epoch=1-step=4.ckpt" not in names and "epoch=0-step=2.ckpt" in names
    # (Rank 0 sees its gather fail when rank 1 dies and removes the partial directory itself; had it died
    # too, the next save or load of the name would: checkpoint._recover.)
    last = tmp_path / "ckpts_killed" / "epoch=0-step=2.ckpt"
    snake_checkpoint.read_manifest(last)  # complete: every file's size and CRC-32
    again = run_worker(tmp_path, "again", world=2, micro=2, steps=4, samples=16, kind="vertical", alpha=0.25,
                       storage=SSD, resume=str(last), save_every=2, ckpt_dir=str(tmp_path / "ckpts_killed"))
    for key in full[0]["state"]:
        assert torch.equal(again[0]["state"][key], full[0]["state"][key]), key
    assert sorted(p.name for p in (tmp_path / "ckpts_killed").iterdir()) == ["epoch=0-step=2.ckpt",
                                                                           "epoch=1-step=4.ckpt"]


@pytest.mark.slow
def test_rank_killed_mid_step_leaves_the_last_checkpoint_loadable(tmp_path):
    full, ckpt = _checkpointed_run(tmp_path)
    cfg = dict(world=2, micro=2, steps=4, samples=16, kind="vertical", alpha=0.25, storage=SSD, save_every=2,
               ckpt_dir=str(tmp_path / "ckpts_killed"), kill_rank=1, kill_step=3)
    killed = run_worker(tmp_path, "killed", expect_rc=None, **cfg)
    assert killed["returncode"] != 0  # Lightning's launcher ends rank 0 when rank 1 dies
    last = tmp_path / "ckpts_killed" / "epoch=0-step=2.ckpt"
    again = run_worker(tmp_path, "again", world=2, micro=2, steps=4, samples=16, kind="vertical", alpha=0.25,
                       storage=SSD, resume=str(last))
    for key in full[0]["state"]:
        assert torch.equal(again[0]["state"][key], full[0]["state"][key]), key


def test_host_and_ssd_plans_count_this_ranks_moment_shards():
    """With partitioned moments each rank plans its own shards: over the ranks they add up to one process's
    moments, on the host and on the SSD (page-rounded per unit: the shards are whole pages)."""
    from snake_strategy.planning.memory_model import MemoryInputs, host_plan, ssd_plan

    units = (12800, 4096 * 3 + 5, 100)
    for optimizer in ("host", "ssd"):
        storage = StorageConfig(weights="host", optimizer=optimizer, gradients="host")
        plans = {}
        for world in (1, 2, 3):
            for rank in range(world):
                inputs = MemoryInputs(unit_params=units, nonlayer_params=10, compute_bytes=8, master_bytes=8,
                                      device_is_cpu=True, storage=storage, shard_world_size=world, shard_rank=rank)
                plans[world, rank] = (host_plan(inputs), ssd_plan(inputs))
        for world in (2, 3):
            for which in (0, 1):
                whole = plans[1, 0][which]["optimizer_moments"]
                assert sum(plans[world, r][which]["optimizer_moments"] for r in range(world)) == whole
            assert plans[world, 0][0]["optimizer_moments" if optimizer == "host" else "weights"] > 0
            assert "partition_buffers" in plans[world, 0][0] and "partition_buffers" not in plans[1, 0][0]
        shard = [8 * (hi - lo) for lo, hi in (shard_bounds(n, 2, 1) for n in units)]
        if optimizer == "host":
            assert plans[2, 1][0]["optimizer_moments"] == 2 * sum(shard)
        else:  # one file per unit and moment, page-rounded
            assert plans[2, 1][1]["optimizer_moments"] == 2 * sum(-(-b // 4096) * 4096 for b in shard)


def test_planner_places_each_ranks_moment_shards():
    """auto placement with partitioned moments plans rank 0's shards (the largest), so more of them fit in
    the same per-process budget: weights first, then the moments' host share grows."""
    from snake_strategy.planning.memory_model import host_plan
    from snake_strategy.planning.placement import choose_alpha, memory_inputs, plan
    from snake_strategy.planning.time_model import HardwareProfile, ModelShape

    shape = ModelShape(num_units=8, params_per_unit=2**20, nonlayer_params=0, head_params=0, tokens_per_micro=64,
                       num_micro=4, checkpoint_bytes=2**16)
    hw = HardwareProfile()
    two = dataclasses.replace(shape, optimizer_shards=2)
    assert two.moment_elems * 2 == shape.moment_elems == 8 * 2**20
    storage = StorageConfig(weights="host", optimizer="host", gradients="host", checkpoints="host")
    whole = host_plan(memory_inputs(shape, hw, storage, "vertical", 0.25))["optimizer_moments"]
    assert host_plan(memory_inputs(two, hw, storage, "vertical", 0.25))["optimizer_moments"] * 2 == whole
    # The weights (32 MiB), the working set (~51 MiB, a unit's weight gradients among it; partitioned: + the
    # gather buffers and the gradient buffers' padding) and part of the moments (64 MiB whole, 32 MiB per rank
    # partitioned).
    for mib, whole_share, rank_share in ((96, 0.203, 0.343), (128, 0.703, 1.0)):
        one_rank = plan(shape, hw, mib * 2**20, alpha=choose_alpha(shape))
        per_rank = plan(two, hw, mib * 2**20, alpha=choose_alpha(two))
        assert one_rank.storage.weights.host == per_rank.storage.weights.host == 1.0
        assert (one_rank.storage.optimizer.host, per_rank.storage.optimizer.host) == (whole_share, rank_share)
        placed = memory_inputs(two, hw, per_rank.storage, "vertical", per_rank.alpha, prefetch_depth=2)
        assert sum(host_plan(placed).values()) <= mib * 2**20


def test_shards_cover_each_unit_once_on_whole_pages():
    from snake_strategy.planning.memory_model import SHARD_ALIGN_ELEMS, shard_size

    for train_end in (0, 1, 4096, 12800, 3 * 4096 + 5, 10**6):
        for world in (1, 2, 3, 8):
            bounds = [shard_bounds(train_end, world, r) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == train_end
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, disjoint
            per = shard_size(train_end, world)
            assert per % SHARD_ALIGN_ELEMS == 0 and per * world >= train_end
            assert all((lo % SHARD_ALIGN_ELEMS == 0 or lo == hi) and hi - lo <= per for lo, hi in bounds)


def test_partitioned_state_refuses_half_weight_storage():
    """The fp32 tail of half-precision weight storage is not all-gathered: refused before any collective."""
    from snake_strategy.engine.parallel.partition import Partition
    from snake_strategy.precision import GreedySnakePrecision
    from snake_strategy.storage import TrafficCounters

    dtypes = GreedySnakePrecision("bf16-mixed").dtypes
    with pytest.raises(ValueError, match="half_weights=False.*shard_optimizer_state=False"):
        Partition(2, 0, TrafficCounters(), dtypes, torch.device("cpu"))


@pytest.mark.parametrize("shard", [True, False])
def test_two_ranks_where_one_routes_nothing_to_an_expert(tmp_path, shard):
    """A hand-written MoE (tests/moe/models.py): in step 0 only rank 1 routes samples to expert 1, in step 1
    neither rank does, later each rank routes to an expert of its own. An expert used on one rank is stepped
    (its gradient is the ranks' sum, as DDP with find_unused_parameters=True steps it), one used on neither
    sits the step out; two ranks equal one process that sees the same samples (fp64, 1e-10)."""
    common = dict(steps=3, kind="vertical", alpha=0.25, storage=SSD, shard=shard, moe=True, record_every=True)
    one = run_worker(tmp_path, "one", world=1, micro=4, as_ranks=2, **common)
    two = run_worker(tmp_path, "two", world=2, micro=2, **common)
    _check_ranks_agree(two)
    states = two[0]["states"]
    expert = "blocks.0.experts.1.0.weight"
    assert torch.equal(states[0][expert], states[1][expert]), "expert 1 sat step 1 out on both ranks"
    assert not torch.equal(states[1][expert], states[2][expert]), "expert 1 trains in step 2 (rank 1's samples only)"
    for a, b in zip(one[0]["states"], states):
        assert max_abs_diff(a, b) < 1e-10
