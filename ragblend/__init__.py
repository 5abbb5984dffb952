"""ragblend: an asynchronous RAG gateway with CacheBlend KV-cache fusion.

This package holds only the `ragblend` command line; the parts live in engine/, kvstore/,
retriever/ and gateway/, what they share in common/. No service imports this package.
"""
