"""``python -m snake_strategy.plan``: the dry run of a training run, before it starts.

It takes exactly the training app's config groups and overrides (``python -m snake_strategy.train``'s)::

    python -m snake_strategy.plan                                                 # the main job's defaults
    python -m snake_strategy.plan model=gpt_4b storage.host_budget_bytes=17179869184 storage.ssd_dir=/nvme/run
    python -m snake_strategy.plan model=hf_local model.path=/models/llama data.context_len=512

and prints whether the run fits (host RAM, SSD space) and what to change when it does not, the predicted
s/step, tokens/s and bound, the peak host RAM, the SSD space, the bytes per step, the SSD bytes written per
1,000 steps and the days of them until the drive's rated endurance (``storage.ssd_endurance_tbw``); the same
as ``<output dir>/plan.json``. No weight is built (the model's structure lives on the meta device). From
Python: ``snake_strategy.dry_run.plan_run(module, strategy, batch)``.
"""
from snake_strategy.train import plan_main

if __name__ == "__main__":
    plan_main()
