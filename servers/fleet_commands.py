"""What changes a running fleet from outside ``up``'s code: ``scale N`` typed on up's standard
input, FleetAdmin served where ``up --admin-port`` asks (``fleet.admin``), and ``skyrl-grpc
scale N --fleet host:port``, its client on the command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from servers.fleet import Fleet, FleetAddresses


def add_admin_arguments(up: argparse.ArgumentParser) -> None:
    """``up``'s FleetAdmin flags."""
    up.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve FleetAdmin (Scale, ListMembers: `skyrl-grpc scale`, a trainer's "
        "FleetAdminClient) on this port of the router's host (0: any free port; default: not "
        "served, `scale N` on standard input only)",
    )
    up.add_argument(
        "--admin-token",
        default=None,
        help="FleetAdmin calls must carry 'authorization: Bearer <token>' (default: none)",
    )


def add_scale_command(commands: Any) -> None:
    """``skyrl-grpc scale`` (``commands``: the CLI's subparsers)."""
    scale = commands.add_parser(
        "scale",
        help="grow or shrink a running fleet (`up --admin-port`) to N serving servers",
        description="Calls FleetAdmin.Scale on a fleet started with `skyrl-grpc up "
        "--admin-port`: added servers read the fleet's weights before they take calls; removed "
        "ones (the newest first) are drained first. Prints the fleet's servers after it.",
    )
    scale.add_argument("servers", type=int, help="serving servers wanted (standbys kept)")
    scale.add_argument("--fleet", required=True, help="up's FleetAdmin address, host:port")
    scale.add_argument("--admin-token", default=None, help="the fleet's --admin-token")
    scale.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait (default %(default)s)"
    )
    scale.set_defaults(func=scale_command)


def read_commands(fleet: Fleet) -> None:
    """``up``'s standard input: ``scale N`` grows or shrinks the fleet (``Fleet.scale``: added
    servers join the router, removed ones are drained first), then prints the servers."""
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if len(words) != 2 or words[0] != "scale" or not words[1].isdigit():
            print(f"unknown command {line.strip()!r}: use `scale N`", flush=True)
            continue
        try:
            addresses = fleet.scale(int(words[1]))
        except Exception as error:  # reported; up keeps supervising what it has
            print(f"scale {words[1]} failed: {error}", flush=True)
            continue
        print_servers(addresses)


def print_servers(addresses: FleetAddresses) -> None:
    for index, address in enumerate(addresses.servers):
        role = " (standby)" if address in addresses.standbys else ""
        print(f"server {index}: {address}{role}", flush=True)


def serve_fleet_admin(fleet: Fleet, host: str, port: int | None, token: str | None) -> Any:
    """FleetAdmin on ``host:port`` where asked (``--admin-port``), printed; None otherwise."""
    if port is None:
        return None
    from servers.fleet.admin import FleetScaler, serve

    scaler = FleetScaler(fleet.scale, lambda: fleet.addresses)
    server, bound = serve(scaler, host, port, token)
    print(f"fleet admin: {host}:{bound}", flush=True)
    return server


def scale_command(args: argparse.Namespace, _: list[str]) -> None:
    """``skyrl-grpc scale``: FleetAdmin.Scale, then the fleet's servers."""
    import grpc

    from skyrl_grpc.fleet_admin import FleetAdminClient, FleetAdminError

    with FleetAdminClient(args.fleet, token=args.admin_token) as client:
        try:
            members = client.scale(args.servers, timeout=args.timeout)
        except FleetAdminError as error:
            hint = ""
            if error.code == grpc.StatusCode.UNAVAILABLE:  # nothing answers there
                hint = (
                    f" (is `skyrl-grpc up --admin-port {args.fleet.rpartition(':')[2]}` running?)"
                )
            raise SystemExit(f"skyrl-grpc scale: {error}{hint}") from None
    print_servers(FleetAddresses(members.router, members.servers, members.standbys))
