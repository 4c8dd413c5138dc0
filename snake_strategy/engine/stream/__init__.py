"""Weight streaming: the prefetching streamer of compute weights, and forward-only passes over streamed
units (evaluation, validation inside fit, generation)."""
