"""Directory checkpoints of the tiered state. Layers, bottom up: ``format`` (layout, raw files, the verified
manifest, the unit reader) <- ``store`` (save, atomic replacement under the name, load) <- ``shards``
(per-rank saves) and ``consolidate`` (weights without optimizer state, one file) <- ``cli``
(``python -m snake_strategy.checkpoint``)."""
from snake_strategy.checkpoint.cli import main
from snake_strategy.checkpoint.consolidate import CheckpointWeights, consolidate, load_consolidated, open_base
from snake_strategy.checkpoint.format import FORMAT, SHARDED_FORMAT, STATES, is_checkpoint_dir
from snake_strategy.checkpoint.store import (load, locate, read_manifest, recover, release, save, sweep,
                                             wrong_strategy_error)

__all__ = ["FORMAT", "SHARDED_FORMAT", "STATES", "CheckpointWeights", "consolidate", "is_checkpoint_dir", "load",
           "load_consolidated", "locate", "main", "open_base", "read_manifest", "recover", "release", "save", "sweep",
           "wrong_strategy_error"]
