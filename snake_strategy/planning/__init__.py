"""The planning layer: from the model's shape, the dtypes and the machine to one ``RunPlan``.

``memory`` (the one memory model) <- ``planner`` (traffic, roofline, placement) <- ``hardware`` (measured
rates) <- ``autoplan`` (``resolve``: every effective setting of a run, decided once)."""
