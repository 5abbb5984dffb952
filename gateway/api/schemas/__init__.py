"""Request and response bodies of the gateway, one model per direction, per resource."""
