"""Zero-copy checkpoints (issue 23): a save pins the SSD files instead of copying them, the next update
writes a new version, a released checkpoint leaves nothing; preemption by SIGTERM; nameless state files
in a temporary ssd_dir (issue 22); recovery, sweep and fsync of checkpoint files (issue 25 items 2, 3, 17)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import zlib

import lightning as L
import pytest
import torch

from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.checkpoint import store as checkpoint_store
from snake_strategy.checkpoint import pins
from snake_strategy.checkpoint.pins import Checksums
from snake_strategy.storage import IOEngine, aligned_empty, versions
from snake_strategy.storage.aligned import padded_bytes
from snake_strategy.storage.leftovers import REGISTRY_DIR
from tests.helpers import Killed, KillAt, StackModule, assert_bitwise, checkpoint_tag, fit_resumable, fit_snake, token_loader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def straight_six(tmp_path_factory):
    return fit_resumable(6, tmp_path_factory.mktemp("straight") / "ssd").last


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no such process (pid reuse within the test is negligible)


def _inode(path) -> int:
    return os.stat(path).st_ino


# ------------------------------------------------------------------------------ save cost and COW
def test_save_links_the_ssd_files_and_training_past_it_leaves_it_intact(tmp_path, straight_six):
    """The step-3 checkpoint's unit files are hard links (nothing of the SSD state written); steps 4-6
    then update every unit (copy-on-write), and resuming from step 3 is bitwise the uninterrupted run."""
    saves = []

    class Spy(L.Callback):  # at the start of a step: ModelCheckpoint saved at the end of the previous one
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                saves.append(dict(trainer.strategy.last_save))
                engine = trainer.strategy.engine
                tier = engine.unit_tiers(0)["exp_avg"]
                saves.append({"versions_at_save": tier.ssd_file.versions, "tier": tier})
            if trainer.global_step == 5:
                saves.append({"versions_after_update": saves[1]["tier"].ssd_file.versions})

    ckpts = tmp_path / "ckpts"
    fit_resumable(6, tmp_path / "ssd", ckpt_dir=ckpts, callbacks=[Spy()])
    save = saves[0]
    n_units = len(snake_checkpoint.read_manifest(ckpts / "epoch=0-step=3.ckpt")["units"])
    assert save["methods"] == {"link": 3 * n_units}, save
    manifest = snake_checkpoint.read_manifest(ckpts / "epoch=0-step=3.ckpt")  # CRC-32s completed in the background
    assert manifest["format"] == "greedysnake-checkpoint/3"
    unit_files = [n for n in manifest["files"] if n.startswith("units/")]
    assert all(manifest["files"][n]["crc32"] is not None for n in unit_files)
    unit_bytes = sum(manifest["files"][n]["bytes"] for n in unit_files)
    assert save["written_bytes"] < unit_bytes / 4  # meta.pt, nonlayer.pt: no unit byte
    # The first update after the save started a new version; the pinned one was never written again.
    assert saves[2]["versions_after_update"] == saves[1]["versions_at_save"] + 1
    run = fit_resumable(6, tmp_path / "ssd2", ckpt_path=str(ckpts / "epoch=0-step=3.ckpt"))
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 6
    assert_bitwise(resumed, straight_six)


def test_background_checksums_read_only_while_the_engines_io_is_idle(tmp_path):
    """The pinned files' CRC-32s wait while training's SSD transfers are queued or moving (a transfer held
    on the disk here), and complete once the I/O engine is idle."""
    payload = os.urandom(3 * 2**20 + 123)
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "u.bin").write_bytes(payload)
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"units/u.bin": {"bytes": len(payload),
                                                                                  "crc32": None}}}))
    on_disk, go = threading.Event(), threading.Event()

    def hold_the_disk(direction, num_bytes):
        on_disk.set()
        go.wait(30)

    io = IOEngine(num_threads=1, before_transfer=hold_the_disk)
    fd = os.open(tmp_path / "training.bin", os.O_RDWR | os.O_CREAT, 0o600)
    checksums = Checksums()
    try:
        buffer = aligned_empty(4096, torch.uint8)
        ticket = io.submit_write(fd, 0, padded_bytes(buffer))  # training's transfer, held on the disk
        assert on_disk.wait(10)
        checksums.submit(tmp_path, ["units/u.bin"], read_bytes_per_s=1e12, disk_idle=io.idle)
        time.sleep(0.5)
        assert not io.idle()
        assert json.loads((tmp_path / "manifest.json").read_text())["files"]["units/u.bin"]["crc32"] is None
        go.set()
        ticket.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            crc = json.loads((tmp_path / "manifest.json").read_text())["files"]["units/u.bin"]["crc32"]
            if crc is not None:
                break
            time.sleep(0.02)
        assert crc == zlib.crc32(payload)
    finally:
        go.set()
        io.close()
        os.close(fd)


def _wait_for_crc(manifest, name: str, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        crc = json.loads(manifest.read_text())["files"][name]["crc32"]
        if crc is not None:
            return crc
        time.sleep(0.02)
    return None


def test_background_checksums_read_no_faster_than_their_rate(tmp_path):
    """The pinned files are read back at ``read_bytes_per_s`` at most (training's disk comes first): a 6 MiB
    file at 4 MiB/s takes at least 1.5 s, where an unpaced read of it takes milliseconds."""
    rate_bytes_per_s = 4 * 2**20
    payload = os.urandom(6 * 2**20 + 123)
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "u.bin").write_bytes(payload)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": {"units/u.bin": {"bytes": len(payload), "crc32": None}}}))
    checksums = Checksums()
    start_s = time.monotonic()
    checksums.submit(tmp_path, ["units/u.bin"], read_bytes_per_s=rate_bytes_per_s)
    crc = _wait_for_crc(manifest, "units/u.bin", 30)
    took_s = time.monotonic() - start_s
    assert crc == zlib.crc32(payload)
    assert took_s >= 6 * 2**20 / rate_bytes_per_s, took_s


# ------------------------------------------------------------------------------ kills
class AtStep(L.Callback):
    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.fn(trainer)


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_kill_at_every_point_of_a_zero_copy_save(tmp_path, monkeypatch, exchange):
    """Every file-system mutation of a zero-copy save (links, writes, renames, removals), killed there:
    the name resolves to a complete, verified checkpoint (the old or the new one), and the next save
    leaves exactly the name."""
    seen = []

    def kill_everywhere(trainer):
        engine = trainer.strategy.engine
        for n in range(1, 400):
            final = tmp_path / "c" / f"n{n}" / "last.ckpt"
            final.parent.mkdir(parents=True)
            snake_checkpoint.save(engine, {"tag": "old"}, final, zero_copy=True)
            kill = KillAt(n)
            with monkeypatch.context() as m:
                if not exchange:
                    m.setattr(checkpoint_store, "_exchange", lambda a, b: False)
                for name in ("_exchange", "write_raw", "remove_path"):
                    m.setattr(checkpoint_store, name, kill(getattr(checkpoint_store, name)))
                m.setattr(checkpoint_store, "os", types.SimpleNamespace(**{**vars(os), "rename": kill(os.rename)}))
                m.setattr(checkpoint_store, "shutil", types.SimpleNamespace(rmtree=kill(shutil.rmtree)))
                m.setattr(versions, "os", types.SimpleNamespace(**{**vars(os), "link": kill(os.link)}))
                try:
                    snake_checkpoint.save(engine, {"tag": "new"}, final, zero_copy=True)
                except Killed:
                    pass
            if not kill.dead:
                assert checkpoint_tag(final) == "new"
                return
            snake_checkpoint.read_manifest(final)
            seen.append(checkpoint_tag(final))
            snake_checkpoint.save(engine, {"tag": "next"}, final, zero_copy=True)
            assert sorted(os.listdir(final.parent)) == ["last.ckpt"], (n, os.listdir(final.parent))
        raise AssertionError("the save never completed")

    fit_resumable(1, tmp_path / "ssd", callbacks=[AtStep(1, kill_everywhere)])
    assert len(seen) > 10 and set(seen) <= {"old", "new"} and "old" in seen and "new" in seen


COW_KILL_SCRIPT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[3])
import lightning as L
from snake_strategy.engine import EngineHooks
from tests.helpers import fit_resumable

marker = sys.argv[1]

class Arm(L.Callback):
    armed = False
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Arm.armed = trainer.global_step == 3  # the step-3 checkpoint is committed: step 4 begins

def before_transfer(direction, num_bytes):
    if Arm.armed and direction == "write":
        with open(marker, "w") as f:
            f.write("first write after the save")
        time.sleep(600)

fit_resumable(60, None, storage={"gradients": "ssd"},  # no ssd_dir: a temporary one
              hooks=EngineHooks(before_ssd_transfer=before_transfer), precision="32-true", callbacks=[Arm()],
              ckpt_dir=sys.argv[2], record=None)
"""


def _run_until_marker(script, args, marker, timeout_s=180, env=None):
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    deadline = time.time() + timeout_s
    while not os.path.exists(marker) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    if not os.path.exists(marker):
        proc.kill()
        pytest.fail(f"the child never reached the point: {proc.communicate()[1].decode()[-3000:]}")
    return proc


def _unnamed_bytes(mount) -> int:
    """Bytes the filesystem at ``mount`` uses beyond its named files: nameless (O_TMPFILE or unlinked)
    files that a process still holds (statvfs against a walk of the tree; exact on a tmpfs)."""
    vfs = os.statvfs(mount)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    named = sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(mount) for f in fs)
    return used - named


def test_sigkill_at_the_first_copy_on_write_update_after_a_save(tmp_path, tmpfs, straight_six):
    """SIGKILL while the first SSD write after the step-3 save is in flight (the moment a pinned unit gets
    its new version), with a temporary ssd_dir on a tmpfs: the checkpoint is intact, the resume is
    bitwise, and the dead run's state is gone: no file with a name but the lock, and statvfs gives back
    every byte the nameless state files held (issue 22: nothing leaks on SIGKILL)."""
    mount = tmpfs("512m")
    marker, ckpts, tmp = tmp_path / "marker", mount / "ckpts", mount / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = _run_until_marker(COW_KILL_SCRIPT, [str(marker), str(ckpts), REPO], marker, env=env)
    held = _unnamed_bytes(mount)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert held >= 16 * 4096  # the live run's nameless files (gradients, new versions; the pinned ones are named)
    assert _unnamed_bytes(mount) == 0  # all of it came back when the process died
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
    # Named files left: the lock, and the registry record that names the dead run's directory for the next
    # run's free-space message (storage/leftovers.py); no state file.
    assert all(os.path.basename(p) == ".snake.lock" or os.path.basename(os.path.dirname(p)) == REGISTRY_DIR
               for p in left), left
    manifest = snake_checkpoint.read_manifest(ckpts / "epoch=0-step=3.ckpt")
    assert manifest["step_count"] == 3 and manifest["format"] == "greedysnake-checkpoint/3"
    run = fit_resumable(6, tmp_path / "ssd", ckpt_path=str(ckpts / "epoch=0-step=3.ckpt"))
    resumed = run.last
    assert_bitwise(resumed, straight_six)


RELEASE_KILL_SCRIPT = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from snake_strategy import checkpoint
real = os.unlink
def unlink(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # after the first file of the released checkpoint
os.unlink = unlink
checkpoint.release(sys.argv[1])
"""


def test_sigkill_during_release_leaves_nothing_after_the_sweep(tmp_path):
    """A checkpoint being released (top-k rotation) is renamed aside first: a SIGKILL in the middle of
    unlinking it leaves a hidden directory, which the next start's sweep removes (and logs)."""
    ckpts = tmp_path / "ckpts"
    fit_resumable(3, tmp_path / "ssd", ckpt_dir=ckpts)
    victim = ckpts / "epoch=0-step=3.ckpt"
    proc = subprocess.run([sys.executable, "-c", RELEASE_KILL_SCRIPT, str(victim), REPO], cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    hidden = [n for n in os.listdir(ckpts) if n.startswith(".")]
    assert len(hidden) == 1 and ".del-" in hidden[0] and not victim.exists()
    removed = snake_checkpoint.sweep(ckpts)
    assert removed and os.listdir(ckpts) == []


# ------------------------------------------------------------------------------ preemption
SIGTERM_SCRIPT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[3])
import lightning as L
from tests.helpers import fit_resumable

class MidStep(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == 2:  # inside step 3: the parent's SIGTERM lands mid-step
            with open(sys.argv[2], "w") as f:
                f.write("mid-step")
            time.sleep(1.0)

fit_resumable(60, sys.argv[1], ckpt_dir=sys.argv[4], callbacks=[MidStep()])
"""


def test_sigterm_mid_step_saves_the_last_step_and_exits_zero(tmp_path, straight_six):
    """SIGTERM (twice) in the middle of step 3: the step completes, last.ckpt of step 3 is committed, the
    child exits 0 within 10 s, and ``fit(ckpt_path="last")`` resumes to the uninterrupted result."""
    marker, ckpts = tmp_path / "marker", tmp_path / "ckpts"
    proc = _run_until_marker(SIGTERM_SCRIPT, [str(tmp_path / "ssd"), str(marker), REPO, str(ckpts)], marker)
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # a second one during the save corrupts nothing
    _, err = proc.communicate(timeout=60)
    exit_s = time.perf_counter() - start
    assert proc.returncode == 0, err.decode()[-3000:]
    assert exit_s < 10, exit_s
    assert snake_checkpoint.read_manifest(ckpts / "last.ckpt")["step_count"] == 3
    assert b"SIGTERM: saved the last completed step" in err
    run = fit_resumable(6, tmp_path / "ssd", ckpt_dir=ckpts, ckpt_path="last")
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 6
    assert_bitwise(resumed, straight_six)


# ------------------------------------------------------------------------------ other filesystems, space
def test_checkpoint_dir_on_another_filesystem_is_copied_and_says_so(tmp_path, tmpfs, straight_six, caplog):
    ckpts = tmpfs("256m") / "ckpts"
    with caplog.at_level(logging.INFO, logger="snake_strategy.checkpoint"):
        trainer = fit_resumable(3, tmp_path / "ssd", ckpt_dir=ckpts).trainer
    methods = trainer.strategy.last_save["methods"]
    assert set(methods) <= {"copy", "reflink"} and methods, methods
    assert "pipelined copy" in caplog.text or "reflink" in caplog.text
    resumed = fit_resumable(6, tmp_path / "ssd2", ckpt_path=str(ckpts / "epoch=0-step=3.ckpt")).last
    assert_bitwise(resumed, straight_six)


def test_checkpoints_that_cannot_fit_are_refused_at_setup_with_the_numbers(tmp_path, tmpfs):
    """Issue 22: a ModelCheckpoint whose kept checkpoints cannot fit is refused before any step, with
    the bytes needed, the bytes free and the ways out."""
    ckpts = tmpfs("64k") / "ckpts"
    with pytest.raises(ValueError, match=r"need up to \d+ bytes .* has \d+ bytes .* free.*another disk.*fewer"
                                         r".*host tier") as info:
        fit_resumable(3, tmp_path / "ssd", ckpt_dir=ckpts)
    assert "save_top_k=-1" in str(info.value)
    assert not ckpts.exists() or os.listdir(ckpts) == []


@pytest.mark.parametrize("case", ["fp32", "bf16-mixed", "adafactor", "frozen"])
def test_the_setup_counts_from_the_plan_the_state_a_save_counts_on_the_engine(tmp_path, case):
    """The space check at setup runs before the engine exists (from the plan's memory inputs); a save during
    the fit counts the engine's tiers. Both see the same bytes on the SSD tier and off it, for a master copy
    apart from the weights (bf16-mixed), a slot of its own length (Adafactor's factors) and frozen elements."""
    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            strategy = trainer.strategy
            seen["plan"] = pins.planned_state_bytes(strategy.plan.memory_inputs())
            seen["engine"] = pins.state_bytes(strategy.engine)

    def model():
        module = StackModule(lambda i: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()), width=256,
                             depth=3)
        if case == "adafactor":
            module.configure_optimizers = lambda: torch.optim.Adafactor(module.parameters(), lr=1e-2)
        if case == "frozen":
            module.blocks[1][0].weight.requires_grad_(False)
        return module

    shares = {"weights": {"host": 0.3, "ssd": 0.7}, "master": {"host": 0.45, "ssd": 0.55},
              "optimizer": {"host": 0.2, "ssd": 0.8}, "ssd_dir": str(tmp_path / "ssd")}
    fit_snake(model, token_loader(8, 4), steps=1, storage=shares, callbacks=[Look()], record=None,
              precision="bf16-mixed" if case == "bf16-mixed" else None)
    assert seen["plan"] == seen["engine"]
    assert seen["engine"][0] > 0 and seen["engine"][1] > 0


# ------------------------------------------------------------------------------ issue 25 items 2, 3, 17
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Complete checkpoints of step 3 and step 6 of one run."""
    root = tmp_path_factory.mktemp("two")
    fit_resumable(6, root / "ssd", ckpt_dir=root / "ckpts")
    return root / "ckpts" / "epoch=0-step=3.ckpt", root / "ckpts" / "epoch=1-step=6.ckpt"


def test_recovery_keeps_the_newest_complete_copy(tmp_path, two_steps):
    """Issue 25 item 2: killed between the two renames of ``last`` (no RENAME_EXCHANGE): step 3 aside,
    step 6 complete under the temporary name, no ``last.ckpt``. Recovery puts step 6 under the name
    (before: step 3, and the complete step-6 copy was deleted)."""
    dead = _dead_pid()
    shutil.copytree(two_steps[0], tmp_path / f".last.ckpt.old-{dead}")
    shutil.copytree(two_steps[1], tmp_path / f".last.ckpt.tmp-{dead}")
    snake_checkpoint.recover(tmp_path / "last.ckpt")
    assert snake_checkpoint.read_manifest(tmp_path / "last.ckpt")["step_count"] == 6
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_newer_complete_copy_is_never_deleted(tmp_path, two_steps):
    """The name holds step 3 and a dead save's complete step-6 copy lies beside it: the step-6 copy takes
    the name (before: it was deleted as garbage by the next save)."""
    dead = _dead_pid()
    shutil.copytree(two_steps[0], tmp_path / "last.ckpt")
    shutil.copytree(two_steps[1], tmp_path / f".last.ckpt.tmp-{dead}")
    snake_checkpoint.recover(tmp_path / "last.ckpt")
    assert snake_checkpoint.read_manifest(tmp_path / "last.ckpt")["step_count"] == 6
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_setup_sweeps_dead_runs_leftovers_and_logs_them(tmp_path, two_steps, caplog):
    """Issue 25 item 3: a partial checkpoint a killed save left stays no longer than the next start."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    dead = _dead_pid()
    partial = ckpts / f".epoch=0-step=9.ckpt.tmp-{dead}"
    (partial / "units").mkdir(parents=True)
    (partial / "units" / "unit00000.master.bin").write_bytes(b"\0" * 4096)
    alive = ckpts / f".epoch=0-step=8.ckpt.tmp-{os.getppid()}"  # a live process's save: left alone
    alive.mkdir()
    with caplog.at_level(logging.WARNING, logger="snake_strategy.checkpoint.pins"):
        fit_resumable(1, tmp_path / "ssd", ckpt_dir=ckpts)
    assert not partial.exists() and alive.is_dir()
    assert f"removed {partial}" in caplog.text


def test_every_checkpoint_file_is_fsynced_before_the_commit_rename(tmp_path, monkeypatch):
    """Issue 25 item 17: each file the manifest lists (and the manifest) reached the disk before the
    rename that names the checkpoint."""
    final = tmp_path / "ckpts" / "step.ckpt"
    final.parent.mkdir()
    synced: set[int] = set()
    at_rename: dict[str, set[int]] = {}
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        if os.path.abspath(dst) == str(final):  # the commit: what each name is, and what was synced
            at_rename["synced"] = set(synced)
            at_rename["inodes"] = {os.path.relpath(os.path.join(d, f), src): _inode(os.path.join(d, f))
                                   for d, _, fs in os.walk(src) for f in fs}
        return real_rename(src, dst, *args, **kwargs)

    def save(trainer):
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        trainer.save_checkpoint(str(final))
        monkeypatch.undo()

    fit_resumable(1, tmp_path / "ssd", callbacks=[AtStep(1, save)])
    manifest = snake_checkpoint.read_manifest(final)
    names = list(manifest["files"]) + ["manifest.json"]
    assert "synced" in at_rename
    assert set(names) <= set(at_rename["inodes"])
    missing = [n for n in names if at_rename["inodes"][n] not in at_rename["synced"]]
    assert not missing, missing
