"""Gateway service: public REST and OpenAI-compatible API over retriever and engine."""
