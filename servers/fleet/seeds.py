"""Each server of a fleet draws random numbers of its own.

vLLM seeds its sampler with the server's ``--seed`` (0 unless given), and a request without a
seed of its own samples from that one generator. Two servers started alike and handed alike
batches therefore draw the same numbers and return the same samples: measured with two fresh
servers of one `skyrl-grpc up`, four copies of a prompt to each at temperature 1 came back
token for token the same from both. A trainer that spreads a group of samples of one prompt
over the fleet (GRPO's n copies, SkyRL's generator) would get duplicates, and servers given
batches of the same shapes step after step stay in lockstep. So a fleet gives server ``i``
the seed ``--seed + i`` (the flag given to the fleet, 0 by default): distinct for every server
at any time, the same for a server restarted in its place, and reproducible run to run.
"""

from __future__ import annotations

from collections.abc import Sequence

SEED_FLAG = "--seed"


def fleet_seed(server_args: Sequence[str]) -> int:
    """The seed given to the fleet: ``--seed`` among ``server_args`` (read by the serve
    command's own parser), else the servers' default. A fleet that has the servers' options
    parsed already (``RayFleet``: engine options over the flags) reads it there."""
    from servers.engine.options import build_parser

    parsed, _ = build_parser().parse_known_args(list(server_args))
    return int(parsed.seed)


def server_seed(fleet_seed: int, index: int) -> int:
    """Server ``index``'s seed: the fleet's plus its index."""
    return fleet_seed + index
