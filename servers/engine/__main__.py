"""``python -m servers.engine``: one engine server (the same as ``skyrl-grpc serve``)."""

from servers.engine.process.engine_server import main

main()
