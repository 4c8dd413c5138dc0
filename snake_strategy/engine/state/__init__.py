"""The state the engine owns: building it from a module, the per-unit and non-layer stores, half-precision
weight storage, and the trained weights written to a mapped file after fit."""
