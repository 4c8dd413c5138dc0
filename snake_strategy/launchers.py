"""The strategy's launchers: the one hook Lightning calls before it resolves ``ckpt_path``.

``Trainer.fit`` (and validate/test/predict) resolves ``ckpt_path="last"`` by listing the ModelCheckpoint
directories for ``last*.ckpt`` (``_CheckpointConnector._parse_ckpt_path``) before ``_run`` calls any
strategy or callback hook (``connect``, ``setup_environment``, the callbacks' ``setup``,
``strategy.setup``); only the launcher's ``launch`` runs earlier, around the whole entry point
(``trainer/call.py: _call_and_handle_interrupt``). A save killed between the two renames of a
replacement without an atomic exchange (store._replace) leaves no ``last.ckpt`` but complete copies
beside it: unless they are put back first, Lightning finds no last checkpoint and the run silently
starts from step 0. So each launcher first puts back, in the directories that lookup lists and under
a ``ckpt_path`` given by name, the newest complete copy a killed save left, then launches as usual.

Process 0 also removes what dead processes left there and logs it once (store.sweep_and_log; the setup
sweep then finds nothing). In the other ranks of a data-parallel run only missing names are filled
(store.adopt): started by the script launcher they begin after process 0 did it all; started by
torchrun or SLURM they may race it, and filling a missing name is the one change every rank can make at
once safely (one rename; whoever loses finds the name taken).
"""
from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from snake_strategy.checkpoint import store

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The ckpt_path values Lightning resolves itself ("best": a path its callback recorded in this process;
# "registry:<name>": a download; "<protocol>://": a remote filesystem, which store.py does not handle).
_SPECIAL_PATHS = ("last", "best", "hpc", "registry")


def recover_checkpoints(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> None:
    """Before ``function`` (a Trainer entry point's implementation) resolves its ``ckpt_path``: in each
    ModelCheckpoint directory, and for a ``ckpt_path`` given as a path, put the newest complete copy a
    killed save left back under its name (process 0: and remove dead processes' leftovers, logged)."""
    if trainer is None:
        return
    try:
        ckpt_path = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except TypeError:  # not an entry point with a ckpt_path: Lightning reports its own argument errors
        ckpt_path = None
    first = trainer.strategy.global_rank == 0
    directories = [c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    names = []
    if ckpt_path == "last":
        # Where Lightning's lookup lists last*.ckpt: a callback without a dirpath resolves one from the
        # logger (ModelCheckpoint._find_last_checkpoints; the same call that lookup makes next), and an
        # OnExceptionCheckpoint names its file.
        directories += [_lightning_dirpath(c, trainer) for c in trainer.checkpoint_callbacks
                        if isinstance(c, ModelCheckpoint) and not c.dirpath]
        names += [c.ckpt_path for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)]
    elif isinstance(ckpt_path, (str, os.PathLike)) and str(ckpt_path) not in _SPECIAL_PATHS \
            and not str(ckpt_path).startswith("registry:") and "://" not in str(ckpt_path):
        names.append(os.fspath(ckpt_path))
        directories.append(os.path.dirname(os.path.abspath(ckpt_path)))
    for directory in dict.fromkeys(os.fspath(d) for d in directories if d):
        if first:
            store.sweep_and_log(directory)
        else:
            for name in _checkpoint_names(directory):
                store.adopt(os.path.join(directory, name))
    for name in names:
        store.adopt(name)


def _lightning_dirpath(callback: ModelCheckpoint, trainer: pl.Trainer) -> str | None:
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
    return os.fspath(resolve(trainer)) if resolve is not None else None


def _checkpoint_names(directory: str) -> list[str]:
    """The checkpoint names that staged or set-aside siblings in ``directory`` belong to (``store.parse_sibling``)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    parsed = (store.parse_sibling(name) for name in entries)
    return sorted({p[0] for p in parsed if p is not None and p[1] in ("tmp", "old")})


class SingleProcessLauncher(_Launcher):
    """One process: recovery, then the entry point itself (what Lightning does without a launcher)."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        recover_checkpoints(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to do: there are no other processes (SIGTERM reaches this one's own handlers)."""


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, recovery first: in process 0 before the other ranks start."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        recover_checkpoints(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)
