"""The optimizer step over the tiers: the worker thread that overlaps it with the backward and the next
forward, and the rollback state of a speculative step."""
