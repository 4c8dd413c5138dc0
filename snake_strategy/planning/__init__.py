"""The planning layer: from the model's shape, the dtypes and the machine to one ``RunPlan``, and its prediction.

One role per module; each imports only those above it in this list (a plan passes through it one way):

- ``memory_model``: the memory model, the bytes each state and buffer takes on the host and on the SSD;
- ``time_model``: the time model, one step's time from the shape, the placement and the machine's rates, and
  the knee where it turns compute-bound;
- ``calibration``: the rates this run's own measurements give (the unit timed before step 1, the steady steps);
- ``machine``: measurement of the machine, its rates (the probe) and the host memory a run may plan with;
- ``placement``: the placement search, where each state lives within the host budget, alpha, the prefetch
  depth and the kept activations;
- ``run_plan``: ``resolve``, every effective setting of a run decided once, into the frozen ``RunPlan``;
- ``run_prediction``: the run's prediction on its plan (before step 1, after it, calibrated on the steady
  steps) and the settings that depend on rates, re-planned with it; the one object the strategy asks.

``planner``, ``autoplan``, ``prediction``, ``hardware``, ``host_memory`` and ``memory`` are the old paths of
these (snake_strategy/moved.py)."""
