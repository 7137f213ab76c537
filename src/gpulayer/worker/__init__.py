"""The worker: detects GPUs, takes tasks, runs them as process trees, reports back."""
