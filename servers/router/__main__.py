"""``python -m servers.router``: the router (the same as ``skyrl-grpc route``)."""

from .server import main

main()
