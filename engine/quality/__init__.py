"""What a blend costs in quality: shadow checks against full prefill, their
agreement measures, and the research oracle's scores."""
