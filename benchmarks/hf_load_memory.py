"""Peak RSS of streaming a >= 1B-parameter HF checkpoint through PretrainedSource, unit by unit.

    python benchmarks/hf_load_memory.py                       # Llama-shaped, hidden 2048 x 20 layers, vocab 32000
    python benchmarks/hf_load_memory.py --layers 4 --keep     # smaller; keep the files afterwards

1. A subprocess writes random weights as sharded safetensors (1 GiB shards, written with the
   safetensors library one shard at a time, so the writer never holds the model either) plus
   config.json into a temporary directory.
2. A fresh subprocess evicts the files from the page cache (posix_fadvise DONTNEED), builds
   ``HFCausalLM`` on the meta device and reads what the engine reads at setup: every non-layer
   parameter (kept, as the engine keeps them) and every unit's flat vector (dropped after use, as the
   engine hands it to its tiers). It reports its peak RSS (ru_maxrss) against the model size and against
   the floor "non-layer weights + one unit".

Not part of the test suite: it writes ~4.6 GB. The directory is removed unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

GIB = 2**30


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=2048)


def write(args) -> None:
    import torch
    from safetensors.torch import save_file

    from snake_strategy.hf import HFCausalLM
    config = llama_config(args)
    module = HFCausalLM(config)
    with torch.device("meta"):
        module.configure_model()
    params = list(module.named_parameters())
    shards, current, current_bytes = [], [], 0
    for name, p in params:
        size = p.numel() * 4
        if current and current_bytes + size > args.shard_gib * GIB:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, p.shape))
        current_bytes += size
    shards.append(current)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shard}
        save_file(tensors, os.path.join(args.dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
    total = sum(p.numel() * 4 for _, p in params)
    with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config.save_pretrained(args.dir)
    print(json.dumps({"num_params": sum(p.numel() for _, p in params), "files": len(shards),
                      "writer_peak_rss_gib": peak_rss_bytes() / GIB}))


def read(args) -> None:
    import torch

    from snake_strategy.hf import HFCausalLM
    from snake_strategy.sources.pretrained import PretrainedSource
    from snake_strategy.units import build_layouts
    for name in os.listdir(args.dir):
        fd = os.open(os.path.join(args.dir, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not a warm page cache
        os.close(fd)
    module = HFCausalLM(args.dir)
    with torch.device("meta"):
        module.configure_model()
    baseline = rss_bytes()
    layouts = build_layouts(module.blocks, 1, {id(p): 0 for p in module.parameters()})
    block_ids = {id(p) for p in module.blocks.parameters()}
    start = time.perf_counter()
    source = PretrainedSource(args.dir)
    nonlayer, nonlayer_bytes = [], 0
    for name, p in module.named_parameters():
        if id(p) not in block_ids:
            nonlayer.append(source.tensor(name, p.shape).clone())  # kept, as the engine keeps them
            nonlayer_bytes += p.numel() * 4
    unit_bytes, largest_unit = 0, 0
    peak_sampled = rss_bytes()
    for layout in layouts:
        flat = source.unit_flat(layout, layout.index, "model.layers", torch.float32)
        unit_bytes += flat.numel() * 4
        largest_unit = max(largest_unit, flat.numel() * 4)
        peak_sampled = max(peak_sampled, rss_bytes())
        del flat  # the engine evicts it to its tiers here
    source.close()
    seconds = time.perf_counter() - start
    model_bytes = nonlayer_bytes + unit_bytes
    peak = peak_rss_bytes()
    print(json.dumps({
        "model_gib": model_bytes / GIB, "nonlayer_gib": nonlayer_bytes / GIB, "largest_unit_gib": largest_unit / GIB,
        "floor_gib": (nonlayer_bytes + largest_unit) / GIB, "baseline_rss_gib": baseline / GIB,
        "peak_rss_gib": peak / GIB, "peak_minus_baseline_gib": (peak - baseline) / GIB,
        "peak_rss_over_model": peak / model_bytes, "seconds": seconds, "read_gib_per_s": model_bytes / GIB / seconds,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    parser.add_argument("--phase", choices=["write", "read"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "write":
        return write(args)
    if args.phase == "read":
        return read(args)
    directory = args.dir or tempfile.mkdtemp(prefix="hf_load_memory_")
    os.makedirs(directory, exist_ok=True)
    base = [sys.executable, __file__, "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
            "--layers", str(args.layers), "--vocab", str(args.vocab), "--shard-gib", str(args.shard_gib),
            "--dir", directory]
    try:
        for phase in ("write", "read"):
            out = subprocess.run(base + ["--phase", phase], check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{phase}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in result.items()))
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
