"""The gateway's FastAPI app: routes, dependencies, middleware and HTTP schemas."""
