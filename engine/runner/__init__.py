"""The paged KV pool and the batched forward over it: decode steps (eager, flex,
CUDA graphs) and the penalties' per-lane state."""
