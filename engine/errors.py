"""Named errors at the engine's edges; a bad request is an InvalidRequestError with a message."""


class ModelNotSupportedError(ValueError):
    """The checkpoint's architecture is not one the blend knows how to run."""


class ModelNotFoundError(ValueError):
    """No checkpoint at the given path, nor in the local Hugging Face cache."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (an empty question, a ratio outside [0, 1])."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus max_tokens does not fit the model's positions."""


class GrammarError(InvalidRequestError):
    """A response format whose JSON schema the grammar library cannot compile (its message), or
    a model whose tokenizer it cannot read."""


class ChunkTooLongError(InvalidRequestError):
    """A chunk to precompute has more tokens than any prompt could hold with it."""


class GenerationCancelled(Exception):
    """The consumer of a generation went away; the worker stops at the next token."""


class QueueFullError(RuntimeError):
    """The wait queue and the KV pool are both full; retry later."""


class ModelCorruptError(ModelNotFoundError):
    """A checkpoint file that cannot be read (a damaged or truncated GGUF); reported wherever a
    missing model is."""


class BackgroundQueueFullError(QueueFullError):
    """The background queue (chunk precompute, KV write-back) holds its bound; retry later."""
