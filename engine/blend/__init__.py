"""One prompt's prefill: layout, plan, the layer loop, check layers and selections,
the recompute ratio and its controller."""
