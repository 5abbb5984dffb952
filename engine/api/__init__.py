"""The engine's HTTP service (FastAPI): precompute, generate (JSON or SSE), health, metrics."""
