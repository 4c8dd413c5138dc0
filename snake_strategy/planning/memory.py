"""Moved to ``snake_strategy.planning.memory_model``: this old path still resolves its names for one release, with a
DeprecationWarning that names the new path (see snake_strategy/moved.py)."""
from snake_strategy.moved import forwarding

__getattr__, __dir__ = forwarding(__name__)
