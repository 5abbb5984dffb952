"""What every service shares (request ids, logging, serving, the error body, SSE); it imports
no service, and every service may import it."""
