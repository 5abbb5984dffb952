"""Named errors at the engine's edges; user mistakes are plain ValueErrors with a message."""


class ModelNotSupportedError(ValueError):
    """The checkpoint's architecture is not one the blend knows how to run."""


class ModelNotFoundError(ValueError):
    """No checkpoint at the given path, nor in the local Hugging Face cache."""


class PromptTooLongError(ValueError):
    """The prompt plus max_tokens does not fit the model's positions."""


class GenerationCancelled(Exception):
    """The consumer of a generation went away; the worker stops at the next token."""


class QueueFullError(RuntimeError):
    """The wait queue and the KV pool are both full; retry later."""
