"""What the benchmark scripts share: where results go, the peak RSS, SSD bytes in a step's traffic, the
per-step probe of a Lightning run, a memory cgroup to run a child in (and its peak), the disk's used bytes,
and the per-rank plot of the data-parallel benchmarks.

The scripts run as ``python benchmarks/<script>.py`` (this folder is then first on ``sys.path``), so they
import it as ``common``. Lightning and matplotlib are imported inside the functions that need them: every
script's ``--help`` and its DeepSpeed worker processes start without them.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir(benchmark: str) -> Path:
    """``benchmarks/results/<benchmark>/``: every script writes into the folder named after it."""
    return RESULTS / benchmark


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def ssd_bytes(traffic: dict[str, int], direction: str) -> int:
    """Bytes moved to or from the SSD tier in one step's traffic (keys ``tier/state/direction``)."""
    assert direction in ("read", "write"), direction
    return sum(v for k, v in traffic.items() if k.startswith("ssd/") and k.endswith("/" + direction))


def step_probe(label: str = "", flush_at_end: bool = False, rss_in_line: bool = False):
    """A Lightning callback for a run with the greedysnake strategy. Per training step it keeps the
    seconds, the loss, the engine's ``StepStats`` and its traffic, and prints one line. At the end of
    training, before teardown gives the trained weights back to the module (which then holds the whole
    model), it keeps the peak RSS and the engine's host plan by item.

    ``flush_at_end`` waits for the engine's last optimizer work first, so the peak includes it.
    """
    import lightning as L

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.setup_done: float | None = None  # time.perf_counter() at on_fit_start: the strategy is set up
            self.step_s: list[float] = []
            self.losses: list[float] = []
            self.stats: list = []
            self.traffic: list[dict[str, int]] = []
            self.train_peak_rss_bytes: int | None = None
            self.host_plan_bytes: dict[str, int] = {}
            self._step_start = 0.0

        def on_fit_start(self, trainer, pl_module):
            self.setup_done = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._step_start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_s.append(time.perf_counter() - self._step_start)
            self.losses.append(float(outputs["loss"]))
            stats = trainer.strategy.engine.last_step
            self.stats.append(stats)
            self.traffic.append(stats.step_traffic())
            rss = f", peak RSS {peak_rss_bytes() / 2**30:.2f} GiB" if rss_in_line else ""
            print(f"{label}step {len(self.step_s)}: loss {self.losses[-1]:.4f}, {self.step_s[-1]:.1f} s{rss}",
                  flush=True)

        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            if flush_at_end:
                engine.flush()
            self.train_peak_rss_bytes = peak_rss_bytes()
            self.host_plan_bytes = dict(engine.host_bytes_plan(engine.checkpoint_bytes))

        def steady_s_per_step(self) -> float:
            """The median step time without the first step (which also warms up), or of all if only one."""
            return statistics.median(self.step_s[1:] or self.step_s)

    return StepProbe()


def make_cgroup(limit_bytes: int, label: str = "bench") -> str:
    """A new memory cgroup limited to ``limit_bytes`` (no swap), v2 or v1; returns its directory. A child
    process enters it by writing its pid to ``cgroup.procs`` (as root)."""
    name = f"snake-{label}-{os.getpid()}-{int(time.time())}"
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2
        path = f"/sys/fs/cgroup/{name}"
        os.mkdir(path)
        Path(path, "memory.max").write_text(str(limit_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            Path(path, "memory.swap.max").write_text("0")
    else:  # v1
        path = f"/sys/fs/cgroup/memory/{name}"
        os.mkdir(path)
        Path(path, "memory.limit_in_bytes").write_text(str(limit_bytes))
    return path


def enter_cgroup(path: str):
    """A ``preexec_fn`` for ``subprocess``: the child moves itself into the cgroup ``path`` before it starts."""
    def enter() -> None:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))
    return enter


def cgroup_peak_bytes(path: str) -> int | None:
    """The cgroup's peak memory (v2 ``memory.peak``, v1 ``memory.max_usage_in_bytes``), None where neither exists."""
    peak = next((Path(path, n) for n in ("memory.peak", "memory.max_usage_in_bytes") if Path(path, n).exists()), None)
    return int(peak.read_text()) if peak is not None else None


def disk_used_bytes(path: str) -> int:
    """Bytes in use on the filesystem holding ``path``."""
    usage = shutil.disk_usage(path)
    return usage.total - usage.free


def write_random_hf(model_dir: Path, config, dtype=None, max_shard_bytes: int = 2**30) -> int:
    """An HF directory of sharded safetensors for ``config`` with random weights (normal, std 0.02; norms 1),
    built shape by shape (the model itself stays on the meta device) and stored in ``dtype`` (export_hf's
    default when None); returns the parameter count."""
    import torch

    from snake_strategy.hf import HFCausalLM, export_hf
    planner = HFCausalLM(config)
    with torch.device("meta"):
        planner.configure_model()
    shapes = [(name, p.shape) for name, p in planner.named_parameters()]
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes:
            yield name, torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.02

    export_hf(tensors(), model_dir, config=config, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return sum(shape.numel() for _, shape in shapes)


def plot_ranks(report: dict, path: Path, keys: list[tuple[str, str]], ylabel: str, title: str) -> None:
    """Two panels for a data-parallel report (``runs``: name -> the ranks' result dicts): rank 0's bytes
    per ``keys`` item, one bar group per run, and the median s/step of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(runs)
    for i, (name, ranks) in enumerate(runs.items()):
        ax.bar([k + i * width for k in range(len(keys))], [ranks[0][k] / 1e6 for k, _ in keys], width, label=name)
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(keys))], [label for _, label in keys],
                  rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    bx.bar(list(runs), [statistics.median(r["s_per_step"] for r in ranks) for ranks in runs.values()])
    bx.tick_params(axis="x", labelsize=8)
    bx.set_ylabel("s / step (2 shared cores)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
