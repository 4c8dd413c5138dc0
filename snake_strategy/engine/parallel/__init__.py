"""Data parallelism inside the engine: the per-unit gradient all-reduce and the partition of the optimizer
state across ranks."""
