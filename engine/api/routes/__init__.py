"""One router per resource of the engine service."""
