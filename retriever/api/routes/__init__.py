"""One APIRouter per resource: documents, search, chunk, and health/metrics."""
