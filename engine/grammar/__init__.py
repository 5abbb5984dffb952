"""Structured outputs: a request's JSON schema compiled into a grammar, and the per-sequence
matchers that mask each decode step's logits to the tokens the grammar allows."""
