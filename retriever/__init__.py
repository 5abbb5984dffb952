"""Retriever service: chunking, embeddings, FAISS index and chunk catalog."""
