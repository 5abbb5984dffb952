"""One APIRouter per resource: documents, search, and health/metrics."""
