"""``python -m servers.router``: the router (the same as ``skyrl-grpc route``)."""

from .router_server import main

main()
