"""The router's OpenAI-compatible HTTP edge: ``asgi`` (the ASGI plumbing and the uvicorn
server), ``handlers`` (each endpoint, over the router's forwarding path), ``parse`` (OpenAI
requests -> the contract), ``render`` (the contract -> OpenAI responses) and ``http_status``
(gRPC statuses as HTTP ones)."""
