"""CacheBlend engine: model loading, prompt layout, chunk KV precompute, blending and decoding."""
