"""``python -m snake_strategy.checkpoint``: consolidate a checkpoint directory into one Lightning file, or
export its weights as a HuggingFace model directory (``--format hf``, the optional ``[hf]`` extra)."""
from __future__ import annotations

import argparse
import sys

import torch

from snake_strategy.checkpoint.consolidate import consolidate
from snake_strategy.checkpoint.format import verified_manifest
from snake_strategy.checkpoint.store import locate
from snake_strategy.progress import Progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snake_strategy.checkpoint",
                                     description="Consolidate a greedysnake checkpoint directory into one file "
                                                 "that LightningModule.load_from_checkpoint reads (--format ckpt), "
                                                 "or export an HFCausalLM's weights to a HuggingFace model "
                                                 "directory, streamed one unit at a time (--format hf).")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output", help="the file to write (ckpt) or the directory to write (hf)")
    parser.add_argument("--format", choices=("ckpt", "hf"), default="ckpt")
    parser.add_argument("--config", default=None,
                        help="hf only: a HF model directory or config.json (default: the config saved with the module)")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                        help="hf only: dtype of the safetensors files (default: the checkpoint's master dtype)")
    parser.add_argument("--base", default=None, metavar="PATH",
                        help="a fine-tuning checkpoint's frozen base weights: the base model's HF directory, "
                             "state-dict or .ckpt file (checked against the checkpoint's CRC-32s)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    parser.add_argument("--progress-every-s", type=float, default=5.0, metavar="SECONDS",
                        help="at most one progress line per phase every this many seconds (default 5)")
    args = parser.parse_args(argv)
    if args.format == "ckpt" and (args.config or args.dtype):
        parser.error("--config and --dtype apply to --format hf only")
    try:
        progress = Progress(log=not args.quiet, every_s=args.progress_every_s)
        if args.format == "hf":
            from snake_strategy.hf.export import export_hf_checkpoint  # on use: the optional [hf] extra

            dtype = getattr(torch, args.dtype) if args.dtype else None
            files = export_hf_checkpoint(args.checkpoint_dir, args.output, config=args.config, dtype=dtype,
                                         progress=progress, base=args.base)
            print(f"wrote {args.output}: config.json + {len(files)} safetensors file(s)")
            return 0
        base_note = _base_note(args.checkpoint_dir, args.base)
        checkpoint = consolidate(args.checkpoint_dir, args.output, progress, base=args.base)
    except (ValueError, OSError, ImportError) as err:
        # A user's mistake, a damaged checkpoint or a missing [hf] extra: one line that names it, as
        # argparse does for bad usage.
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors" + base_note)
    return 0


def _base_note(path: str, base: str | None) -> str:
    """What the CLI adds when a fine-tuning checkpoint is consolidated without its base weights."""
    if base is not None:
        return ""
    manifest = verified_manifest(locate(path), verify=lambda name: False)  # consolidate verifies the files
    frozen = sum(len(u.get("frozen", {}).get("names", [])) for u in manifest["units"])
    return (f" (the trained ones only: the {frozen} frozen block parameters are the base model's; pass --base PATH "
            "to include them)") if frozen else ""
