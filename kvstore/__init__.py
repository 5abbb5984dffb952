"""KV cache storage: on-disk format, memory and SSD tiers, layer-by-layer streaming."""
