"""Moved to ``snake_strategy.planning.time_model`` (the placement search to ``snake_strategy.planning.placement``):
this old path still resolves its names for one release, with a DeprecationWarning that names the new path (see
snake_strategy/moved.py)."""
from snake_strategy.moved import forwarding

__getattr__, __dir__ = forwarding(__name__)
