"""``python -m servers.engine``: one engine server (the same as ``skyrl-grpc serve``)."""

from .server import main

main()
