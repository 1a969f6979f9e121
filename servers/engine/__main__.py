"""``python -m servers.engine``: one engine server (the same as ``skyrl-grpc serve``)."""

from .engine_server import main

main()
