"""The HTTP layer of the ingress: the one ASGI application (every route, the one error mapping, request limits) and
the ingress replica's own uvicorn server. No torch."""
