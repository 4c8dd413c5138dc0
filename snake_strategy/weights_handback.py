"""The weights hand-back: what the module holds once the engine goes, whatever happened. The trained
weights, its pre-fit weights, or (only when neither can be given) a guard whose error says why; never
meta tensors without a word. ``WeightsHandback`` is the strategy's part: it holds the pre-fit weights and
the failure of the current stage and, at teardown, decides between the preempted, failed and normal ends.

- A fit that ends normally gives the trained weights back: in memory when they fit the host budget
  (``machine.host_budget``, the plan's), else streamed into a safetensors file that the parameters
  then map (``engine/state/weights_file.py``). The guard stays only for the case where no file can be written.
  The file is the run's scratch, not an output: it is written where the SSD tier lives (``export_location``)
  and its name is removed once mapped, so it goes away with the process (a user's working directory never
  collects multi-GB files); ``storage.export_dir`` keeps it there instead, under a fixed name.
- A fit that fails (setup, a step, a save, teardown) never starts a file export: the weights go back in
  memory when they fit the budget and the engine is sound; else the module gets its pre-fit weights
  back when they are still held (setup failures; file-backed weights of an earlier fit, which cost no
  memory to keep); else the guard names the failure.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor, nn

import snake_strategy.storage.leftovers as leftovers
from snake_strategy.checkpoint.pins import CHECKSUMS
from snake_strategy.engine.state.weights_file import (WEIGHTS_FILE, close_unmapped, export_to_file, file_backed,
                                                      file_bytes_needed, file_mappings, give_module_file_weights,
                                                      release_name, temporary_file_name)

from snake_strategy.engine.evaluation import EvalEngine

if TYPE_CHECKING:
    from snake_strategy.checkpoint.consolidate import CheckpointWeights
    from snake_strategy.engine.training import SnakeEngine
    from snake_strategy.planning.run_plan import RunPlan
    from snake_strategy.progress import Progress

log = logging.getLogger(__name__)

GUARD_ATTR = "_greedysnake_weight_guard"
GUARD_MESSAGE_ATTR = "_greedysnake_weight_guard_message"


def install_weight_guard(module: nn.Module, message: str) -> None:
    """Reading the module's weights (state_dict, forward) raises ``ValueError(message)``."""
    remove_weight_guard(module)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError(message)

    handles = [module.register_state_dict_pre_hook(lambda *a, **k: refuse()),
               module.register_forward_pre_hook(lambda *a, **k: refuse())]
    setattr(module, GUARD_ATTR, handles)
    setattr(module, GUARD_MESSAGE_ATTR, message)


def remove_weight_guard(module: nn.Module) -> None:
    for handle in getattr(module, GUARD_ATTR, []):
        handle.remove()
    for attr in (GUARD_ATTR, GUARD_MESSAGE_ATTR):
        if hasattr(module, attr):
            delattr(module, attr)


def has_weight_guard(module: nn.Module) -> bool:
    return hasattr(module, GUARD_ATTR)


def guard_message(module: nn.Module) -> str:
    return getattr(module, GUARD_MESSAGE_ATTR, "")


class PreFitWeights:
    """What the module's parameters held before fit, to give back when fit fails (no copy is made).

    In-memory values are held only until setup ends (the engine then owns the weights and their memory
    goes back). Weights mapped from an earlier fit's file are kept as the file's name for the whole fit:
    they cost no memory, and the file is re-mapped on restore (the run may have stepped a mapped non-layer
    parameter in place; the private map kept those writes out of the file)."""

    def __init__(self, module: nn.Module) -> None:
        self._held: list[tuple[nn.Parameter, Tensor]] = []
        self._files: set[str] = set()
        close_unmapped()  # released files of earlier fits that nothing maps any more: their space goes back
        maps = file_mappings()
        for p in module.parameters():
            if p.is_meta:
                continue
            source = file_backed(p, maps)
            if source is not None and source.endswith(".safetensors"):
                self._files.add(source)
            else:
                self._held.append((p, p.detach()))

    def setup_done(self) -> PreFitWeights:
        self._held = []
        return self

    def restore(self, module: nn.Module) -> bool:
        """Give the parameters their pre-fit values back; whether there were any to give."""
        for p, value in self._held:
            if p.is_meta or p.data_ptr() != value.data_ptr():
                torch.utils.swap_tensors(p, nn.Parameter(value, p.requires_grad))
        restored = bool(self._held)
        for path in sorted(self._files):
            try:
                give_module_file_weights(module, path)
                restored = True
            except (OSError, ValueError, AttributeError) as err:  # the file is gone or not ours: say so
                log.warning("could not give back the pre-fit weights mapped from %s (%r)", path, err)
        return restored


def export_location(storage_export_dir: str | None, engine: SnakeEngine | EvalEngine,
                    storage_ssd_dir: str | None) -> tuple[str, bool]:
    """(directory, keep) of the weights file after fit. ``storage.export_dir`` when given: the file is
    kept there. Else where the SSD tier lives (the run's SSD directory, the configured ``ssd_dir``, or the
    temporary directory), and the file's name is removed once it is mapped (``keep`` False)."""
    if storage_export_dir is not None:
        return os.path.abspath(storage_export_dir), True
    ssd = getattr(engine, "ssd", None)
    if ssd is not None:
        return ssd.path, False
    return os.path.abspath(storage_ssd_dir) if storage_ssd_dir is not None else tempfile.gettempdir(), False


def weights_fit(weights_bytes: int, budget_bytes: int | None, engine_host_bytes: int) -> bool:
    """Whether the trained weights go back in memory. The export copies them while the engine still holds
    its host memory (``engine_host_bytes``, the plan's), so both together must fit the budget: gpt_1b in an
    8 GiB cgroup that copied its 4.83 GB of weights next to the engine's ~5 GiB was OOM-killed."""
    return budget_bytes is None or weights_bytes + engine_host_bytes <= budget_bytes


def give_back_weights(module: nn.Module, engine: SnakeEngine | EvalEngine, budget_bytes: int | None,
                      budget_source: str, directory: str, pre_fit: PreFitWeights | None,
                      file_name: str = WEIGHTS_FILE, progress: Progress | None = None,
                      engine_host_bytes: int = 0, keep_file: bool = True) -> str | None:
    """After a normal fit: the trained weights into the module. Returns the file they map, or None when
    they went back in memory (or a guard was installed because no file could be written). With
    ``keep_file`` False the file gets a name of its own, which is removed once it is mapped. After an
    evaluation: weights an earlier fit mapped from a file are mapped again (evaluation did not change
    them), else the evaluated weights go back as a fit's do: in memory when they fit, else mapped from a
    file (a model larger than RAM, evaluated from its HF directory, was OOM-killed copying them in)."""
    if isinstance(engine, EvalEngine) and pre_fit is not None and pre_fit.restore(module):
        return None
    weights_bytes = engine.master_bytes()
    if weights_fit(weights_bytes, budget_bytes, engine_host_bytes):
        engine.export_to_module()
        return None
    path = os.path.join(directory, file_name if keep_file else temporary_file_name(file_name))
    specs = engine.weight_specs()
    why_not = _why_not_writable(directory, file_bytes_needed(specs))
    over = (f"the trained weights ({weights_bytes / 2**30:.2f} GiB) and the engine's host memory while they are "
            f"copied ({engine_host_bytes / 2**30:.2f} GiB) exceed the host budget ({budget_bytes / 2**30:.2f} GiB, "
            f"bounded by {budget_source})")
    if why_not is not None:
        install_weight_guard(module, (
            f"{over}, so they were not copied into the module, and no weights file could be written: {why_not}. "
            "Set storage.export_dir to a directory with room (the module then maps a safetensors file of the "
            "weights), or save them during training (ModelCheckpoint) and consolidate: python -m "
            "snake_strategy.checkpoint CKPT_DIR model.ckpt"))
        log.warning("trained weights not given back: %s; %s", over, why_not)
        return None
    ssd = getattr(engine, "ssd", None)
    if not keep_file and ssd is not None and ssd.path == directory:
        # Until its name is removed, a SIGKILL would leave the file: the next run in this directory
        # reclaims what the manifest lists (storage/leftovers.py).
        name = os.path.basename(path)
        leftovers.record_file(directory, name)
        leftovers.record_file(directory, os.path.join(name + ".partial", "model.safetensors"))
    size_bytes = export_to_file(engine, path, specs, progress, scratch=not keep_file)
    if keep_file:
        log.info("%s: the module's parameters now map %s (%.2f GiB, %d bytes), kept there (storage.export_dir)",
                 over, path, size_bytes / 2**30, size_bytes)
    else:
        release_name(path)
        log.info("%s: the module's parameters now map %s (%.2f GiB, %d bytes), where the SSD tier lives; its "
                 "name is already removed, so the file goes away with this process (storage.export_dir keeps "
                 "one; checkpoints hold the weights too)", over, path, size_bytes / 2**30, size_bytes)
    return path


def after_failure(module: nn.Module, engine: SnakeEngine, failure: BaseException, budget_bytes: int | None,
                  pre_fit: PreFitWeights | None) -> str:
    """After a failed fit (teardown): never a file export. What the module now holds, in words."""
    weights_bytes = engine.master_bytes()
    try:
        engine.flush()
        sound = True
    except BaseException as err:  # noqa: BLE001 - the failure the user sees is the original one
        log.warning("after the failed fit, the pending optimizer updates could not be applied (%r)", err)
        sound = False
    if sound and (budget_bytes is None or weights_bytes <= budget_bytes):
        try:
            engine.export_to_module()
            return "the weights of the last step, in memory"
        except BaseException as err:  # noqa: BLE001 - as above
            log.warning("after the failed fit, giving the weights back failed too (%r)", err)
    if pre_fit is not None and pre_fit.restore(module) and not any(p.is_meta for p in module.parameters()):
        return "its pre-fit weights"
    reason = ("the engine could not apply its pending updates" if not sound else
              f"the trained weights ({weights_bytes / 2**30:.2f} GiB) exceed the host budget "
              f"({(budget_bytes or 0) / 2**30:.2f} GiB) and a failed run does not start a multi-GB export")
    install_weight_guard(module, (
        f"fit failed ({type(failure).__name__}: {failure}) and the module has no weights to give: {reason}. "
        "Resume from the last checkpoint (trainer.fit(..., ckpt_path=...)) or evaluate it (ckpt_path=...)"))
    return "no weights (a guard explains why)"


def teardown_after_failure(module: nn.Module, engine: SnakeEngine | EvalEngine, failure: BaseException,
                           budget_bytes: int | None, pre_fit: PreFitWeights | None,
                           close: Callable[[], None]) -> None:
    """Teardown of a failed fit or evaluation: leave a clean module, close the engine (``close``), and
    raise nothing (the failure the user sees is the original one)."""
    try:
        if isinstance(engine, EvalEngine):
            give_back_weights(module, engine, budget_bytes, "", "", pre_fit)
        else:
            held = after_failure(module, engine, failure, budget_bytes, pre_fit)
            log.warning("fit failed (%s: %s): the module holds %s", type(failure).__name__, failure, held)
    except BaseException as err:  # noqa: BLE001 - reported, never raised over the original failure
        log.warning("cleaning up after the failure also failed (%r)", err)
    finally:
        try:
            close()
        except BaseException as err:  # noqa: BLE001 - as above
            log.warning("closing the engine after the failure also failed (%r)", err)


def after_setup_failure(module: nn.Module, failure: BaseException, pre_fit: PreFitWeights) -> None:
    """Setup failed: the pre-fit weights go back; a module that had none (built on the meta device, so
    there never were any) gets a guard that names the failure instead of silent meta tensors."""
    pre_fit.restore(module)
    if any(p.is_meta for p in module.parameters()):
        install_weight_guard(module, (
            f"fit failed during setup ({type(failure).__name__}: {failure}) before the weights existed: the "
            "module was built on the meta device (configure_model under strategy='greedysnake') and the "
            "strategy materializes it only while setting up. Fix the error above and fit again"))


def _why_not_writable(directory: str, needed_bytes: int) -> str | None:
    try:
        os.makedirs(directory, exist_ok=True)
        free_bytes = shutil.disk_usage(directory).free
    except OSError as err:
        return f"'{directory}' is not a writable directory ({err.strerror})"
    if not os.access(directory, os.W_OK):
        return f"'{directory}' is not writable"
    if needed_bytes > free_bytes:
        return (f"'{directory}' has {free_bytes / 2**30:.2f} GiB free ({free_bytes} bytes), the file needs "
                f"{needed_bytes / 2**30:.2f} GiB ({needed_bytes} bytes)")
    return None


class WeightsHandback:
    """The strategy's side of the hand-back, one per strategy, across its fits and evaluations.

    ``weights_file``: the safetensors file the module's parameters map after the last fit (None when they
    went back in memory); its name is already removed (the file goes away with the process) unless
    ``storage.export_dir`` keeps it. ``gave_back_weights``: a run gave its trained weights back, so they
    are the module's weights from then on (``pretrained=`` was only the first run's starting point).
    ``failure``: what stopped the current stage (Lightning's ``on_exception``); teardown then leaves a
    clean module without starting a multi-GB export."""

    def __init__(self) -> None:
        self.weights_file: str | None = None
        self.gave_back_weights = False
        self.failure: BaseException | None = None
        self._pre_fit: PreFitWeights | None = None  # what the module held before this fit/evaluation

    def start_fit(self, module: nn.Module) -> None:
        """Before fit's setup: hold what the module has now, to give it back if the fit fails."""
        self.failure = None
        remove_weight_guard(module)
        self._pre_fit = PreFitWeights(module)

    def setup_failed(self, module: nn.Module, failure: BaseException) -> None:
        """Fit's setup raised: the pre-fit weights go back, or a guard names ``failure``."""
        after_setup_failure(module, failure, self._pre_fit)

    def setup_done(self) -> None:
        """The engine holds the weights: in-memory pre-fit values are released."""
        self._pre_fit.setup_done()

    def start_eval(self, module: nn.Module, stage: str, has_checkpoint: bool) -> None:
        """Before validate/test/predict: refuse a guarded module (its blocks are on the meta device, so
        evaluating them would evaluate a fresh random init) unless a checkpoint brings the weights."""
        self.failure = None
        if has_weight_guard(module) and not has_checkpoint:
            raise ValueError(f"trainer.{stage} has no weights to evaluate ({guard_message(module)}). "
                             "Pass ckpt_path=<a greedysnake checkpoint directory saved during fit>")
        remove_weight_guard(module)

    def eval_source(self, module: nn.Module, checkpoint: CheckpointWeights | None, pretrained: Any) -> Any:
        """Where the evaluation engine reads the weights: the checkpoint (with the fine-tuning base), the
        ``pretrained`` source before any run gave weights back, else None (the module's own weights, which
        teardown maps again when they are file-backed instead of copying them back)."""
        if checkpoint is not None:
            source = checkpoint.with_base(module, pretrained)
        else:
            source = self.pretrained(pretrained)
        self._pre_fit = PreFitWeights(module).setup_done() if source is None else None
        return source

    def pretrained(self, pretrained: Any) -> Any:
        """The strategy's ``pretrained`` source, or None once a run gave its trained weights back."""
        return None if self.gave_back_weights else pretrained

    def teardown(self, module: nn.Module, engine: SnakeEngine | EvalEngine, plan: RunPlan, file_name: str,
                 progress: Progress, preempted: bool, close: Callable[[], None]) -> None:
        """The engine goes; ``close`` releases its files, locks and rank directories, on every path.

        Preempted: the zero-copy checkpoint holds the weights and the process exits, so no export. Failed:
        no export, and nothing raised over the original failure. Normal: the trained weights go back (in
        memory or mapped from a file); a failed export leaves the module clean, then raises."""
        if preempted:
            close()
        elif self.failure is not None:
            teardown_after_failure(module, engine, self.failure, plan.host_budget_bytes, self._pre_fit, close)
        else:
            try:
                engine.flush()
                CHECKSUMS.wait()  # the pinned checkpoint files' CRC-32s, read while training ran
                directory, keep = export_location(plan.storage.export_dir, engine, plan.storage.ssd_dir)
                self.weights_file = give_back_weights(
                    module, engine, plan.host_budget_bytes, plan.host_budget_source, directory, self._pre_fit,
                    file_name, progress, plan.host_bytes, keep)
                self.gave_back_weights = not has_weight_guard(module)
            except BaseException as err:
                after_failure(module, engine, err, plan.host_budget_bytes, self._pre_fit)
                raise
            finally:
                close()  # even when the flush failed; re-raises
