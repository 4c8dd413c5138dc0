"""The engine: runs one optimizer step's task list over the tiered stores, with overlap.

training.py is the training engine the strategy builds from a plan and a runtime (runtime.py);
evaluation.py the forward-only one; view.py the typed view both offer to the rest of the package; trace.py
the public record of what ran. The roles, one folder each, imports running one way (step -> stream ->
optimizer -> state -> parallel):

- step/       one step's work on the main thread: runner, gradient path, kept graphs, split backward
- stream/     weight streaming and forward-only passes
- optimizer/  the worker that overlaps the optimizer step, and the speculative step's rollback
- state/      building the state, the stores, half-precision weights, the weights file after fit
- parallel/   gradient all-reduce and the optimizer-state partition across ranks
"""
from snake_strategy.engine.training import SnakeEngine
from snake_strategy.engine.evaluation import EvalEngine
from snake_strategy.engine.runtime import EngineHooks, EngineRuntime
from snake_strategy.engine.view import EngineView, StepStats, running_engine
from snake_strategy.precision import DtypePolicy

__all__ = ["DtypePolicy", "EngineHooks", "EngineRuntime", "EngineView", "EvalEngine", "SnakeEngine", "StepStats",
           "running_engine"]
