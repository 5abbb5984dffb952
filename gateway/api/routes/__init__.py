"""One router per resource of the gateway service."""
