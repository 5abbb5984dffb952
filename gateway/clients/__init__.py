"""HTTP clients of the gateway's dependencies: the retriever and the engine pool."""
