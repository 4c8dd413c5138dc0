"""The side-by-side baseline: DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer on "nvme").

    python benchmarks/zero_infinity.py --preset r1 --micro-batch-size 2 --num-micro 4 --steps 5 \\
        --nvme-dir /tmp/zi --json-out benchmarks/results/zero_infinity_r1.json

Trains the same GPT as ``snake_strategy.gpt.GPTModule`` (its modules, its init, its AdamW groups and
hyper-parameters, the same ``TextDataModule`` batches) with DeepSpeed driven directly: single process,
gloo, no launcher, the CPU accelerator. Recipe and traps: the design notes' ``anchors.md``, section
"DeepSpeed ZeRO-Infinity on a CPU-only machine".

Run it as a subprocess (the CLI above, ``--json-out FILE``) from any benchmark that measures other
systems too: it initialises torch.distributed and DeepSpeed patches process-global state, so a process
runs ``run_zero_infinity`` once.

Needs the ``bench`` extra: ``apt-get install -y libaio-dev`` then
``DS_BUILD_OPS=0 pip install --no-build-isolation -e '.[bench]'``. DeepSpeed compiles its ops
(async_io, cpu_adam, pin_memory) on first use, ~8 minutes on 2 cores, into ``TORCH_EXTENSIONS_DIR``
(default here: ``<repo>/.torch_extensions``, kept between runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from snake_strategy.data import TextDataModule
from snake_strategy.gpt import GPTConfig, GPTModule, preset

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_HINT = (
    "DeepSpeed is not installed; the ZeRO-Infinity baseline needs the 'bench' extra: "
    "`apt-get install -y libaio-dev` (its async I/O op), then "
    "`DS_BUILD_OPS=0 pip install --no-build-isolation -e '.[bench]'` from the repository root "
    "(DS_BUILD_OPS=0: ops compile on first use; --no-build-isolation: the build must see the installed "
    "CPU torch instead of pulling another one)"
)
AIO_BLOCK_BYTES = 2**20
# Offload knobs, tuned on r1 (a sweep, back to back with the previous defaults of
# 1e8 live / 1e8 reuse / DeepSpeed's 5e7 prefetch bucket / 16 buffers, 5-6% faster): how many parameter
# elements may stay fetched and how far ahead a released one may be reused (3e7: blocks are released
# promptly instead of filling the buffers with the embedding and the head), how many elements the NVMe
# prefetch reads ahead, and the ZeRO-3 default size at or below which a parameter is never partitioned
# (it stays resident, like a LayerNorm gain).
MAX_LIVE_PARAMETERS = 3 * 10**7
MAX_REUSE_DISTANCE = 3 * 10**7
PREFETCH_BUCKET_NUMEL = 2 * 10**8
PERSISTENCE_THRESHOLD_NUMEL = 10**5
# Every swap buffer holds the largest parameter (r1: 155 MB, the embedding) and is page-locked; 24 of
# them on r1 (anchors' run used 16; 24 let the larger prefetch bucket read ahead): that is the memory the
# buffer pool may take when a model needs more.
MIN_PARAM_BUFFERS = 24
PARAM_BUFFER_BUDGET_BYTES = int(4e9)


class GPTLoss(nn.Module):
    """A GPTModule's computation as one module whose forward returns the loss: what DeepSpeed's engine
    wants. ``pre_stage -> blocks -> post_stage -> compute_loss``, the same path the strategy streams."""

    def __init__(self, gpt: GPTModule) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        batch = (inputs, targets)
        hidden = self.gpt.pre_stage(batch)
        for block in self.gpt.blocks:
            hidden = block(hidden)
        return self.gpt.compute_loss(self.gpt.post_stage(hidden), batch)


# ---------------------------------------------------------------------------------------- measurement
def _proc_io() -> tuple[int, int]:
    """Bytes this process (all its threads) made the block layer read / write. O_DIRECT I/O counts;
    page-cache hits do not."""
    fields = {}
    with open("/proc/self/io") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            fields[key] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def _dir_bytes(path: str) -> tuple[int, int]:
    """(apparent size, allocated size) of every file under ``path``."""
    apparent = allocated = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                info = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue  # a swap file removed under us
            apparent += info.st_size
            allocated += info.st_blocks * 512
    return apparent, allocated


class _RssSampler:
    """Samples the process RSS with psutil every ``interval_s`` on a daemon thread; keeps the peak.
    ru_maxrss already gives the true peak; this one starts after setup and sees the training loop only."""

    def __init__(self, interval_s: float = 0.05) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_bytes = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)


# ---------------------------------------------------------------------------------------- setup
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _import_deepspeed():
    # Before the import: torch's extension loader reads it when DeepSpeed loads an op.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    try:
        import deepspeed
    except ImportError as err:
        raise RuntimeError(f"{INSTALL_HINT} (import failed: {err})") from None
    # DeepSpeed logs its whole config and every step at INFO; keep warnings only.
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    return deepspeed


def _init_single_process(deepspeed) -> str | None:
    """One rank, gloo, no launcher: the environment the launcher would have set, then DeepSpeed's init.

    Returns the /dev/shm segment DeepSpeed's CPU all-reduce creates for this address and port, which it
    never removes (64 MiB of RAM per run, left in tmpfs): the caller unlinks it when done. None when
    torch.distributed was already up (not ours to clean)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return None
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ[key] = value
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.environ['MASTER_PORT']}_0"


def _offloaded_param_numels(config: GPTConfig) -> list[int]:
    """Sizes of the parameters ZeRO-3 partitions (and so swaps), from a meta build: no memory, no RNG."""
    with torch.device("meta"):
        gpt = GPTModule(config)
        gpt.configure_model()
    # named_parameters() yields a tied weight once, as ZeRO does.
    return [p.numel() for _, p in gpt.named_parameters() if p.numel() > PERSISTENCE_THRESHOLD_NUMEL]


def param_buffer_count(config: GPTConfig, buffer_numel: int) -> int:
    """Swap buffers for offload_param. A fetched parameter holds one buffer until it is released, and
    ZeRO-3 keeps fetched parameters until MAX_LIVE_PARAMETERS elements are live (or they leave the reuse
    window); with too few buffers the swapper asserts "Not enough buffers". Worst case: the live set is
    the smallest parameters. Give that many (+2 for prefetch), at least 16, but no more than fit the
    budget (a wide model with a big embedding, like r1, releases early anyway: its live set fills with
    few, large parameters)."""
    live, live_numel = 0, 0
    for numel in sorted(_offloaded_param_numels(config)):
        if live_numel + numel > MAX_LIVE_PARAMETERS:
            break
        live, live_numel = live + 1, live_numel + numel
    affordable = PARAM_BUFFER_BUDGET_BYTES // (buffer_numel * 4)
    return max(MIN_PARAM_BUFFERS, min(live + 2, affordable))


def merge_settings(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in, nested dicts key by key (a sweep point over the config)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge_settings(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(config: GPTConfig, micro_batch_size: int, num_micro_batches: int, nvme_path: str,
                     gpt_hparams: dict, grad_clip_norm: float | None = None,
                     num_param_buffers: int | None = None, prefetch_bucket_numel: int | None = None,
                     overrides: dict | None = None, world_size: int = 1) -> dict:
    """The ZeRO-Infinity config that works on this CPU-only machine (anchors.md), fp32 throughout.
    ``world_size``: data-parallel ranks (DeepSpeed checks train_batch_size = micro x accumulation x ranks)."""
    # offload_param.buffer_size counts elements and must hold the largest parameter; round it up to
    # whole aio blocks (fp32: 4 bytes per element).
    block_numel = AIO_BLOCK_BYTES // 4
    largest_numel = max(_offloaded_param_numels(config), default=1)  # tiny models: nothing is swapped
    buffer_numel = -(-largest_numel // block_numel) * block_numel
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": num_micro_batches,
        "train_batch_size": micro_batch_size * num_micro_batches * world_size,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # Explicit: DeepSpeed 0.19.8 defaults to clipping the gradient norm at 1.0, which silently
        # changes the updates versus an unclipped Lightning run (Adam is scale-invariant except for its
        # eps, so only near-zero gradients move: losses drift in the 3rd-4th digit within a few steps).
        "gradient_clipping": 0.0 if grad_clip_norm is None else float(grad_clip_norm),
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        # "AdamW" with an offloaded optimizer becomes DeepSpeedCPUAdam(adamw_mode=True). The weight decay
        # here is the default; the param groups passed to initialize() carry GPTModule's split.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": gpt_hparams["learning_rate"],
                "betas": list(gpt_hparams["betas"]),
                "eps": gpt_hparams["eps"],
                "weight_decay": gpt_hparams["weight_decay"],
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4, "pin_memory": False},
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": num_param_buffers or param_buffer_count(config, buffer_numel),
                "buffer_size": buffer_numel,
                # The default 1e9 silently keeps every parameter in RAM: not an SSD run.
                "max_in_cpu": 0,
                "pin_memory": False,
            },
            # 1e9 reuse distance (or too few buffers) crashes with "Not enough buffers".
            "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
            "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
            "stage3_prefetch_bucket_size": PREFETCH_BUCKET_NUMEL,
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD_NUMEL,
        },
        # intra_op_parallelism: older DeepSpeed releases called it thread_count.
        "aio": {"block_size": AIO_BLOCK_BYTES, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
    }
    if prefetch_bucket_numel is not None:
        ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch_bucket_numel
    return merge_settings(ds_config, overrides or {})


def _param_groups(gpt: GPTModule) -> list[dict]:
    """GPTModule.configure_optimizers' groups: decay on matrices and embeddings, none on biases and
    LayerNorm gains. Partitioned ZeRO-3 parameters keep their true shape in ``ds_shape``."""
    decay, no_decay = [], []
    for _, param in gpt.named_parameters():
        if not param.requires_grad:
            continue
        num_dims = len(getattr(param, "ds_shape", param.shape))
        (decay if num_dims >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": gpt.hparams.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# ---------------------------------------------------------------------------------------- the run
def run_zero_infinity(config: GPTConfig, micro_batch_size: int, num_micro_batches: int, steps: int,
                      nvme_dir: str, seed: int = 0, lr: float = 3e-4,
                      grad_clip_norm: float | None = None, num_param_buffers: int | None = None,
                      prefetch_bucket_numel: int | None = None, overrides: dict | None = None,
                      data=None, counters=None) -> dict:
    """Train ``steps`` optimizer steps of the GPT under ZeRO-Infinity and return the measurements.

    Each step is ``num_micro_batches`` micro-batches of ``micro_batch_size`` windows of
    ``config.context_len`` byte tokens (the batches ``TextDataModule(seed=seed)`` yields). The model
    weights equal those of ``torch.manual_seed(seed); GPTModule(config).configure_model()``.

    Swap files go to a fresh sub-directory of ``nvme_dir``, removed at the end. Timing is the median over
    the steps after the first (warm-up); SSD bytes come from /proc/self/io. ``grad_clip_norm``: clip
    the global gradient norm (None: no clipping, like Lightning's default). ``num_param_buffers``:
    offload_param.buffer_count (None: ``param_buffer_count``'s rule). ``prefetch_bucket_numel``:
    stage3_prefetch_bucket_size (None: PREFETCH_BUCKET_NUMEL; 0 turns NVMe prefetch off, the workaround for
    "param N already assigned swap buffer id M", which the ``small`` preset hits). One call per process.

    Data parallel (``zero_infinity_ranks.py``): the caller initialises torch.distributed first (its
    ranks run this each with its own ``nvme_dir``) and passes ``data``, an object whose
    ``train_dataloader()`` yields this rank's ``(inputs, targets)`` per step; ``counters``, a callable
    returning cumulative byte counters, adds their per-step differences as ``counters_per_step``.
    """
    config = GPTConfig.from_any(config)
    for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches),
                        ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is warm-up and not timed), got {steps}")
    deepspeed = _import_deepspeed()
    try:
        import psutil  # noqa: F401  (the RSS sampler's; fail before the long setup, not after it)
    except ImportError:
        raise RuntimeError(INSTALL_HINT.replace("DeepSpeed is not installed", "psutil is not installed")) from None

    setup_start = time.perf_counter()
    shm_segment = _init_single_process(deepspeed)
    os.makedirs(nvme_dir, exist_ok=True)
    swap_dir = tempfile.mkdtemp(prefix="zero-infinity-", dir=os.path.abspath(nvme_dir))
    engine = None
    try:
        # Build the data first: the corpus read must not land in the SSD counters.
        if data is None:
            data = TextDataModule(source="stdlib", context_len=config.context_len, micro_batch_size=micro_batch_size,
                                  num_micro_batches=num_micro_batches, seed=seed)
        world_size = torch.distributed.get_world_size()
        batches = iter(data.train_dataloader())

        gpt_hparams = {"learning_rate": lr, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
        ds_config = deepspeed_config(config, micro_batch_size, num_micro_batches, swap_dir, gpt_hparams,
                                     grad_clip_norm, num_param_buffers, prefetch_bucket_numel, overrides, world_size)
        # dtype=None: passing torch.float32 silently turns into bf16 on this CPU.
        with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device="nvme", dtype=None):
            gpt = GPTModule(config, learning_rate=lr, weight_decay=gpt_hparams["weight_decay"],
                            betas=gpt_hparams["betas"], eps=gpt_hparams["eps"])
            # Under Init the layers land on the CPU, not on meta (DeepSpeed forces the device of every
            # new tensor), so their constructors' default inits draw random numbers. Re-run the GPT init
            # from a fresh seed: Init's patched Module.apply gathers each module's parameters, runs the
            # init and writes them back to the swap files, giving the same weights as a plain build.
            gpt.configure_model()
            torch.manual_seed(seed)
            gpt.apply(gpt.init_module_weights)
            model = GPTLoss(gpt)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_param_groups(gpt), config=ds_config)
        num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in gpt.parameters())
        setup_s = time.perf_counter() - setup_start

        step_s: list[float] = []
        read_bytes: list[int] = []
        write_bytes: list[int] = []
        losses: list[float] = []
        counter_steps: list[dict] = []
        engine.train()
        with _RssSampler() as sampler:
            for _ in range(steps):
                try:
                    inputs, targets = next(batches)
                except StopIteration:
                    batches = iter(data.train_dataloader())
                    inputs, targets = next(batches)
                read_before, write_before = _proc_io()
                counters_before = counters() if counters else {}
                start = time.perf_counter()
                micro_losses = []
                for micro_inputs, micro_targets in zip(inputs.chunk(num_micro_batches), targets.chunk(num_micro_batches)):
                    loss = engine(micro_inputs, micro_targets)
                    engine.backward(loss)
                    engine.step()  # an optimizer step only at the accumulation boundary
                    micro_losses.append(loss.item())
                step_s.append(time.perf_counter() - start)
                read_after, write_after = _proc_io()
                counters_after = counters() if counters else {}
                counter_steps.append({k: v - counters_before.get(k, 0) for k, v in counters_after.items()})
                read_bytes.append(read_after - read_before)
                write_bytes.append(write_after - write_before)
                losses.append(sum(micro_losses) / len(micro_losses))
                print(f"zero_infinity step {len(step_s)}/{steps}: loss {losses[-1]:.5f}, {step_s[-1]:.2f} s, "
                      f"read {read_bytes[-1] / 1e9:.2f} GB, wrote {write_bytes[-1] / 1e9:.2f} GB", flush=True)
        if engine.global_steps != steps:
            raise RuntimeError(f"DeepSpeed took {engine.global_steps} optimizer steps, expected {steps}")
        swap_apparent_bytes, swap_allocated_bytes = _dir_bytes(swap_dir)
        swap_by_dir = {os.path.relpath(root, swap_dir): _dir_bytes(root)[0] for root, dirs, _ in os.walk(swap_dir)
                       if not dirs}  # the leaf directories: parameters and optimizer state apart
    finally:
        if engine is not None:
            engine.destroy()
        shutil.rmtree(swap_dir, ignore_errors=True)
        if shm_segment is not None and os.path.exists(shm_segment):
            os.remove(shm_segment)  # the mapping stays valid; only the name goes

    timed = slice(1, None)  # the first step warms up (buffer allocation, op loading, first swaps)
    s_per_step = statistics.median(step_s[timed])
    tokens_per_step = micro_batch_size * num_micro_batches * config.context_len
    result = {
        "system": "zero_infinity",
        "s_per_step": s_per_step,
        "tokens_per_s": tokens_per_step / s_per_step,
        "ssd_read_bytes_per_step": statistics.mean(read_bytes[timed]),
        "ssd_write_bytes_per_step": statistics.mean(write_bytes[timed]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "peak_rss_bytes_psutil_training": sampler.peak_bytes,
        "losses": losses,
        "steps": steps,
        "step_s": step_s,
        "ssd_read_bytes": read_bytes,
        "ssd_write_bytes": write_bytes,
        "swap_files_apparent_bytes": swap_apparent_bytes,
        "swap_files_allocated_bytes": swap_allocated_bytes,
        "setup_s": setup_s,
        "tokens_per_step": tokens_per_step,
        "micro_batch_size": micro_batch_size,
        "num_micro_batches": num_micro_batches,
        "seed": seed,
        "lr": lr,
        "grad_clip_norm": grad_clip_norm,
        "num_params": num_params,
        "config": dataclasses.asdict(config),
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "zero_config": ds_config["zero_optimization"] | {"aio": ds_config["aio"]},
        # every DeepSpeed setting this run used (the swap paths are this run's temporary directory)
        "deepspeed_settings": {k: v for k, v in ds_config.items() if k != "optimizer"},
        "deepspeed_overrides": overrides or {},
        "world_size": world_size,
        "swap_files_apparent_bytes_by_dir": swap_by_dir,
    }
    if counters:
        result["counters_per_step"] = counter_steps
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO-Infinity baseline on the GPT presets")
    parser.add_argument("--preset", default="r1", help="GPT preset name (snake_strategy.gpt.GPT_PRESETS)")
    parser.add_argument("--context-len", type=int, default=None, help="override the preset's context_len")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-micro", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (the first is warm-up)")
    parser.add_argument("--nvme-dir", default=None,
                        help="directory for the swap files (default: a temp dir under /tmp); a fresh "
                             "sub-directory is used and removed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--grad-clip", type=float, default=None, help="clip the gradient norm (default: off)")
    parser.add_argument("--param-buffers", type=int, default=None,
                        help="offload_param.buffer_count (default: enough for the live set, see param_buffer_count)")
    parser.add_argument("--prefetch-bucket-numel", type=int, default=None,
                        help="stage3_prefetch_bucket_size (default: PREFETCH_BUCKET_NUMEL, 2e8; 0 disables NVMe prefetch, "
                             "needed for the 'small' preset)")
    parser.add_argument("--ds-overrides", default=None,
                        help="JSON merged into the DeepSpeed config, nested key by key (a sweep point), e.g. "
                             "'{\"zero_optimization\": {\"stage3_max_live_parameters\": 3e8}}'")
    parser.add_argument("--json-out", default=None, help="write the result dict here as JSON")
    args = parser.parse_args(argv)

    config = preset(args.preset)
    if args.context_len is not None:
        config = dataclasses.replace(config, context_len=args.context_len)
    nvme_dir = args.nvme_dir or tempfile.gettempdir()
    result = run_zero_infinity(config, args.micro_batch_size, args.num_micro, args.steps, nvme_dir,
                               seed=args.seed, lr=args.lr, grad_clip_norm=args.grad_clip,
                               num_param_buffers=args.param_buffers, prefetch_bucket_numel=args.prefetch_bucket_numel,
                               overrides=json.loads(args.ds_overrides) if args.ds_overrides else None)
    result["preset"] = args.preset
    print(f"zero_infinity {args.preset}: {result['s_per_step']:.2f} s/step (median of {args.steps - 1}), "
          f"{result['tokens_per_s']:.0f} tokens/s, SSD read {result['ssd_read_bytes_per_step'] / 1e9:.2f} GB/step, "
          f"written {result['ssd_write_bytes_per_step'] / 1e9:.2f} GB/step, peak RSS "
          f"{result['peak_rss_bytes'] / 1e9:.2f} GB, losses {[round(x, 5) for x in result['losses']]}", flush=True)
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
