"""Serving many requests: the scheduler over sequences and KV blocks, one step's
execution, sampling and results, and the model thread with its background queue."""
