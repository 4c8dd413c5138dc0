"""One optimizer step's work on the main thread: the runner that executes the task list, the gradient path
that completes, reduces and clips each unit's gradient, kept forward graphs, LayerPipe's split backward and
the first step's batching check."""
