"""The engine: runs one optimizer step's task list over the tiered stores, with overlap.

core.py is the facade the strategy uses; build.py materializes the state (state.py); runner.py runs a
step's tasks; weights.py streams weights; gradients.py is the gradient path; overlap.py the optimizer
worker; trace.py the public record of what ran.
"""
from snake_strategy.engine.core import SnakeEngine
from snake_strategy.engine.hooks import EngineHooks
from snake_strategy.precision import DtypePolicy

__all__ = ["DtypePolicy", "EngineHooks", "SnakeEngine"]
