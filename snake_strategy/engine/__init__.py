"""The engine: runs one optimizer step's task list over the tiered stores, with overlap.

core.py is the training engine the strategy builds from a plan and a runtime (runtime.py); evaluation.py
the forward-only one; view.py the typed view both offer to the rest of the package. build.py materializes
the state (state.py); runner.py runs a step's tasks; weights.py streams weights; gradients.py is the
gradient path; overlap.py the optimizer worker; trace.py the public record of what ran.
"""
from snake_strategy.engine.core import SnakeEngine
from snake_strategy.engine.evaluation import EvalEngine
from snake_strategy.engine.runtime import EngineHooks, EngineRuntime
from snake_strategy.engine.view import EngineView, StepStats, running_engine
from snake_strategy.precision import DtypePolicy

__all__ = ["DtypePolicy", "EngineHooks", "EngineRuntime", "EngineView", "EvalEngine", "SnakeEngine", "StepStats",
           "running_engine"]
