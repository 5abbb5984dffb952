"""The model: loading a checkpoint (safetensors or GGUF), its layer operations the blend loop
calls, and the attention kernels they use."""
