"""``python -m servers.router``: the router (the same as ``skyrl-grpc route``)."""

from servers.router.router_server import main

main()
