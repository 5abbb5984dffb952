"""HTTP layer of the retriever: FastAPI app factory, dependencies, routes and schemas."""
