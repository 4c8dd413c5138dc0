"""What survives on disk (issue 9): a checkpoint name that always holds a complete checkpoint, whatever
instant a save is killed at; one-line errors from the consolidation CLI; an SSD directory left as the
run found it; and a teardown that releases every file and the lock even when a step of it fails."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import types

import lightning as L
import pytest
import torch

from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.checkpoint import store as checkpoint_store
from snake_strategy.gpt import GPTModule
from snake_strategy.storage import PAGE_BYTES, IOEngine, SsdDirectory, aligned_empty
from snake_strategy.storage.aligned import padded_bytes
from tests.helpers import SMALL_GPT, Killed, KillAt, checkpoint_tag, run_snake

SSD_STATES = {"weights": "ssd", "optimizer": "ssd", "gradients": "ssd", "checkpoints": "ssd",
              "checkpoint_host_ends": 0}


class AtTrainEnd(L.Callback):
    """Runs ``fn(trainer)`` while the strategy's engine is still set up (before teardown)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def on_train_end(self, trainer, pl_module):
        self.fn(trainer)


def _fit_then(fn, ssd_dir) -> dict:
    states, _ = run_snake(SMALL_GPT, 1, 2, 2, "32-true", only_last=True, callbacks=[AtTrainEnd(fn)],
                          storage={"ssd_dir": str(ssd_dir), "weights": "ssd", "optimizer": "ssd"})
    return states[-1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint directory (saved at the end of a 1-step fit) and the live parameters."""
    root = tmp_path_factory.mktemp("saved")
    path = root / "last.ckpt"
    live = _fit_then(lambda trainer: trainer.save_checkpoint(str(path)), root / "ssd")
    return path, live


# ---------------------------------------------------------------------------------------- item 6: kills
def _kill_every_point(engine, base, exchange: bool, monkeypatch) -> list[str]:
    """Save "new" over "old" once per mutation point, killed there; check the name after each kill."""
    seen = []
    for n in range(1, 200):
        final = base / f"n{n}" / "last.ckpt"
        final.parent.mkdir(parents=True)
        snake_checkpoint.save(engine, {"tag": "old"}, final)
        kill = KillAt(n)
        with monkeypatch.context() as m:
            # Every way store.py changes the file system.
            if not exchange:
                m.setattr(checkpoint_store, "_exchange", lambda a, b: False)  # e.g. NFS
            for name in ("_exchange", "write_raw", "remove_path"):
                m.setattr(checkpoint_store, name, kill(getattr(checkpoint_store, name)))
            m.setattr(checkpoint_store, "os", types.SimpleNamespace(**{**vars(os), "rename": kill(os.rename)}))
            m.setattr(checkpoint_store, "shutil", types.SimpleNamespace(rmtree=kill(checkpoint_store.shutil.rmtree)))
            try:
                snake_checkpoint.save(engine, {"tag": "new"}, final)
            except Killed:
                pass
        if not kill.dead:
            assert checkpoint_tag(final) == "new"
            return seen
        if exchange:
            # The name itself never goes missing: Lightning's ckpt_path="last" lookup lists it.
            assert final.is_dir(), f"kill at mutation {n}: {final.name} is missing"
        # The name resolves to a complete checkpoint, the old or the new one, verified file by file.
        snake_checkpoint.read_manifest(final)
        seen.append(checkpoint_tag(final))
        # The next save cleans up what the dead save left and replaces the checkpoint as usual.
        snake_checkpoint.save(engine, {"tag": "next"}, final)
        assert sorted(os.listdir(final.parent)) == ["last.ckpt"], (n, os.listdir(final.parent))
        assert checkpoint_tag(final) == "next"
    raise AssertionError("the save never completed")


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_kill_at_any_point_of_a_save_keeps_a_complete_checkpoint(tmp_path, monkeypatch, exchange):
    """Issue 9 item 6. Before: the old directory was deleted, then the new one renamed; a kill between
    left only `.last.ckpt.tmp-PID` and `ckpt_path="last"` started from step 0."""
    seen = {}
    _fit_then(lambda trainer: seen.update(tags=_kill_every_point(trainer.strategy.engine, tmp_path / "c",
                                                                 exchange, monkeypatch)), tmp_path / "ssd")
    tags = seen["tags"]
    assert len(tags) > 10 and set(tags) <= {"old", "new"}
    assert "old" in tags and "new" in tags  # kills before and after the switch were both exercised


def test_load_adopts_a_checkpoint_left_aside_by_a_killed_save(tmp_path, monkeypatch):
    """Killed between the two renames (no atomic exchange): the name is missing and the old checkpoint
    lies aside. Loading that name finds it, puts it back, and removes the dead save's leftovers."""
    final = tmp_path / "ckpts" / "last.ckpt"
    final.parent.mkdir()
    result = {}

    def crash_between_renames(trainer):
        engine = trainer.strategy.engine
        snake_checkpoint.save(engine, {"tag": "old"}, final)
        monkeypatch.setattr(checkpoint_store, "_exchange", lambda a, b: False)
        renames = []

        def rename(src, dst):
            renames.append(src)
            if len(renames) >= 2:  # killed at the second: not even the handler's rename back happens
                raise Killed
            os.rename(src, dst)

        monkeypatch.setattr(checkpoint_store, "os", types.SimpleNamespace(**{**vars(os), "rename": rename}))
        monkeypatch.setattr(checkpoint_store, "shutil", types.SimpleNamespace(rmtree=lambda *a, **k: None))
        with pytest.raises(Killed):
            snake_checkpoint.save(engine, {"tag": "new"}, final)
        monkeypatch.undo()
        result["after_kill"] = sorted(os.listdir(final.parent))
        result["loaded"] = snake_checkpoint.load(engine, final)["tag"]
        result["after_load"] = sorted(os.listdir(final.parent))

    _fit_then(crash_between_renames, tmp_path / "ssd")
    pid = os.getpid()
    assert result["after_kill"] == [f".last.ckpt.old-{pid}", f".last.ckpt.tmp-{pid}"]
    assert result["loaded"] == "old"
    assert result["after_load"] == ["last.ckpt"]


def test_leftovers_of_a_live_process_are_left_alone(saved, tmp_path):
    """Another process's temporary directory is its save in progress (an evaluation script reading the
    checkpoints while training writes them must not destroy it)."""
    path, _ = saved
    final = tmp_path / "last.ckpt"
    shutil.copytree(path, final)
    theirs = tmp_path / f".last.ckpt.tmp-{os.getppid()}"  # our parent: alive, and not us
    theirs.mkdir()
    dead = tmp_path / ".last.ckpt.tmp-999999999"  # above any pid_max: no such process
    dead.mkdir()
    assert checkpoint_store._recover(final, clean=True) == final
    assert theirs.is_dir() and not dead.exists()


def test_missing_checkpoint_says_so(tmp_path, saved):
    """Before: "... is not a complete greedysnake checkpoint (no manifest.json): an interrupted save or
    another format" for a path where nothing exists."""
    with pytest.raises(ValueError, match=r"there is no checkpoint at .*nothing\.ckpt: check the path"):
        snake_checkpoint.read_manifest(tmp_path / "nothing.ckpt")
    (tmp_path / ".gone.ckpt.tmp-999999999").mkdir()
    with pytest.raises(ValueError, match=r"no checkpoint at .*gone\.ckpt \(only the unfinished save "):
        snake_checkpoint.read_manifest(tmp_path / "gone.ckpt")


# ---------------------------------------------------------------------------------------- item 2: the CLI
def _cli(capsys, *args) -> tuple[int, str]:
    code = snake_checkpoint.main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_cli_missing_directory_is_one_line(tmp_path, capsys):
    """Before: a traceback ending in ValueError (no manifest.json), exit code 1."""
    code, err = _cli(capsys, tmp_path / "nope.ckpt", tmp_path / "out.ckpt")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "there is no checkpoint at" in err and "nope.ckpt" in err


def test_cli_partial_directory_is_one_line(tmp_path, saved, capsys):
    """A save interrupted before its manifest (the hidden temporary directory)."""
    path, _ = saved
    partial = tmp_path / ".last.ckpt.tmp-1234"
    shutil.copytree(path, partial)
    (partial / "manifest.json").unlink()
    code, err = _cli(capsys, partial, tmp_path / "out.ckpt")
    assert code == 2 and err.count("\n") == 1 and "no manifest.json" in err


def test_cli_missing_output_directory_is_one_line(tmp_path, saved, capsys):
    """Before: a traceback from torch.save (RuntimeError: Parent directory ... does not exist)."""
    path, _ = saved
    code, err = _cli(capsys, path, tmp_path / "no" / "such" / "dir" / "out.ckpt")
    assert code == 2 and err.count("\n") == 1
    assert "output directory" in err and "does not exist" in err


def test_cli_truncated_unit_file_says_it_is_shorter(tmp_path, saved, capsys):
    path, _ = saved
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(path, copy)
    victim = copy / "units" / "unit00001.master.bin"
    victim.write_bytes(victim.read_bytes()[:-100])
    code, err = _cli(capsys, copy, tmp_path / "out.ckpt")
    assert code == 2 and err.count("\n") == 1
    assert "unit00001.master.bin is shorter than the manifest says" in err and "dmesg" not in err


def test_cli_exit_code_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "snake_strategy.checkpoint", str(tmp_path / "nope"),
                           str(tmp_path / "out.ckpt")], capture_output=True, text=True)
    # runpy's own RuntimeWarning (the package's __init__ imports this module) is not ours to silence.
    lines = [line for line in proc.stderr.splitlines() if "RuntimeWarning" not in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1
    assert lines[0].startswith("python -m snake_strategy.checkpoint: error: there is no checkpoint at")


def test_truncated_ssd_state_file_is_not_blamed_on_the_device(tmp_path):
    """A state file shorter than the layout (truncated by something else): before, the hint said
    "check the device (dmesg)", as for a disk error."""
    directory, engine = SsdDirectory(str(tmp_path / "ssd")), IOEngine(num_threads=1)
    try:
        fd = directory.open("weights/unit00000.bin", PAGE_BYTES)
        with pytest.raises(OSError) as err:
            engine.submit_read(fd, 0, padded_bytes(aligned_empty(2 * PAGE_BYTES, torch.uint8))).wait()
        assert "shorter than this run's layout says" in str(err.value) and "dmesg" not in str(err.value)
    finally:
        engine.close()
        directory.close()


# ---------------------------------------------------------------------------------------- item 6: plain Lightning
def test_load_consolidated_feeds_load_from_checkpoint_without_a_file(saved):
    """What a LayeredModule.load_from_checkpoint override can do with a directory: consolidate in memory
    and hand Lightning a buffer."""
    path, live = saved
    assert snake_checkpoint.is_checkpoint_dir(path)
    buffer = io.BytesIO()
    torch.save(snake_checkpoint.load_consolidated(path), buffer)
    buffer.seek(0)
    module = GPTModule.load_from_checkpoint(buffer, weights_only=False)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), live[name]), name
    message = str(snake_checkpoint.wrong_strategy_error(path))
    assert "consolidate it with `python -m snake_strategy.checkpoint" in message


# ---------------------------------------------------------------------------------------- item 4: the SSD directory
def _tree(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


def test_run_leaves_a_user_ssd_dir_as_it_found_it(tmp_path):
    ssd = tmp_path / "ssd"
    (ssd / "notes").mkdir(parents=True)
    (ssd / "weights").mkdir()  # the user's own empty directory, named like a state: not ours to remove
    (ssd / "notes" / "keep.txt").write_text("mine")
    before = _tree(ssd)
    run_snake(SMALL_GPT, 1, 2, 2, "32-true", storage={"ssd_dir": str(ssd), **SSD_STATES})
    assert _tree(ssd) == before


def test_run_in_a_new_ssd_dir_leaves_nothing(tmp_path):
    """Before: `new/deeper/` stayed behind, empty."""
    run_snake(SMALL_GPT, 1, 2, 2, "32-true", storage={"ssd_dir": str(tmp_path / "new" / "deeper"), **SSD_STATES})
    assert os.listdir(tmp_path) == []


def test_close_releases_everything_even_when_a_step_fails(tmp_path):
    """An fd that fails to close (here: closed behind the directory's back) no longer stops the rest:
    the other fds, the files, the lock and the created directories are released, then the error is
    raised; a second close is a no-op and a retry in the same process gets the directory."""
    ssd = tmp_path / "ssd"
    directory = SsdDirectory(str(ssd))
    first = directory.open("weights/unit00000.bin", PAGE_BYTES)
    second = directory.open("exp_avg/unit00000.bin", PAGE_BYTES)
    os.close(first)
    with pytest.raises(OSError):
        directory.close()
    with pytest.raises(OSError):
        os.fstat(second)  # released
    assert not ssd.exists()
    directory.close()
    again = SsdDirectory(str(ssd))
    again.close()
    assert not ssd.exists()


def test_failed_start_leaves_no_directory(tmp_path, monkeypatch):
    from snake_strategy.storage import ssd_directory

    def refuse(self):
        raise ValueError("storage.ssd_dir is in use")

    monkeypatch.setattr(ssd_directory.SsdDirectory, "_take_lock", refuse)
    with pytest.raises(ValueError, match="in use"):
        SsdDirectory(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path) == []


_KILLED_IN_A_TEMPORARY_DIR = """
import os, signal
from snake_strategy.storage import SsdDirectory, leftovers
ssd = SsdDirectory(None, use_o_direct=False)  # under TMPDIR
fd = ssd.open("weights/unit00000.bin", 4 << 20)  # nameless (O_TMPFILE): goes with the process
os.pwrite(fd, b"x" * (4 << 20), 0)
os.makedirs(os.path.join(ssd.path, "weights"), exist_ok=True)
with open(os.path.join(ssd.path, "weights", "scratch.bin"), "wb") as f:  # a named file, as the weights scratch
    f.write(b"y" * (1 << 20))
leftovers.record_file(ssd.path, "weights/scratch.bin")
print(ssd.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_temporary_run_removes_what_killed_temporary_runs_left(tmp_path, monkeypatch):
    """A SIGKILLed run's temporary directory (its lock, a named scratch file, empty state directories) is never
    opened by name again: the next run that makes a temporary directory removes it. A live run's, one still
    starting (no lock yet), and a file nobody listed (with the dead run's lock, so a free-space refusal still
    names it) stay; registry entries naming removed directories go."""
    import signal
    import tempfile

    from snake_strategy.storage import leftovers
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_A_TEMPORARY_DIR], env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    killed = tmp_path / os.path.basename(done.stdout.strip())
    assert (killed / "weights" / "scratch.bin").stat().st_size == 1 << 20
    dead_pid = (killed / ".snake.lock").read_text()
    unlisted = tmp_path / "snake-ssd-unlisted"  # a dead run's directory holding a file no manifest names
    unlisted.mkdir()
    (unlisted / ".snake.lock").write_text(dead_pid)
    (unlisted / "notes.txt").write_text("not listed")
    live = tmp_path / "snake-ssd-live"
    live.mkdir()
    (live / ".snake.lock").write_text(str(os.getpid()))
    starting = tmp_path / "snake-ssd-starting"
    starting.mkdir()
    registry = tmp_path / leftovers.REGISTRY_DIR
    (registry / "gone").write_text(str(tmp_path / "snake-ssd-gone"))
    (registry / "live").write_text(str(live))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    SsdDirectory(None, use_o_direct=False).close()
    assert not killed.exists()
    assert sorted(p.name for p in unlisted.iterdir()) == [".snake.lock", "notes.txt"]
    assert (live / ".snake.lock").exists() and starting.exists()
    assert sorted(p.name for p in registry.iterdir()) == ["live"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([leftovers.REGISTRY_DIR, unlisted.name, live.name,
                                                                 starting.name])


_HOLDS_A_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_held_by_a_process_this_one_cannot_see_keeps_its_directory(tmp_path, monkeypatch):
    """A run in another PID namespace sharing the directory: the pid in its lock names no process here, but
    it holds the lock file's flock, so its temporary directory is not swept and its named directory is not
    taken; once it is gone, both are. (Stood in for by a process that holds the flock under a pid that does
    not exist.)"""
    import tempfile

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    no_such_pid = done.stdout.strip()
    temporary, named = tmp_path / "snake-ssd-elsewhere", tmp_path / "named"
    for directory in (temporary, named):
        directory.mkdir()
        (directory / ".snake.lock").write_text(no_such_pid)
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDS_A_LOCK, str(d / ".snake.lock")], stdout=subprocess.PIPE,
                                text=True) for d in (temporary, named)]
    try:
        assert all(h.stdout.readline().strip() == "held" for h in holders)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        SsdDirectory(None, use_o_direct=False).close()
        assert (temporary / ".snake.lock").exists()
        with pytest.raises(ValueError, match="in use by a running process"):
            SsdDirectory(str(named), use_o_direct=False)
    finally:
        for h in holders:
            h.kill()
            h.wait()
    SsdDirectory(None, use_o_direct=False).close()
    assert not temporary.exists()
    SsdDirectory(str(named), use_o_direct=False).close()
    assert not (named / ".snake.lock").exists()
