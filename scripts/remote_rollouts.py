"""Rollouts from a client on a testbed host of its own (``bench_multihost --distance``): one
contender's closed-loop rounds of concurrent streams, as ``rollout_clients`` runs them, from
inside the client's network namespace; prints one ``JOB-RESULT`` line, tokens/s per round.

Run (inside a host): python -m scripts.remote_rollouts '{"contender": "grpc-streams",
"address": "10.250.0.11:50051", "streams": 64, "tokens": 128, "rounds": 3}'
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from scripts.rollout_clients import (
    RunBatch,
    client_streams,
    grpc_batch,
    grpc_streams,
    http_streams,
)
from testbed.peers import SERVED_NAME

JOB_RESULT = "JOB-RESULT "


def contender(name: str, address: str) -> RunBatch:
    if name == "grpc-streams":
        return grpc_streams(address, 0, sessions=False)
    if name == "client-streams":  # no router: the client routes from the server's status
        return client_streams("127.0.0.1:1", [address])
    if name == "grpc-batch":
        return grpc_batch(address, 0)
    if name == "vllm-http":
        return http_streams(f"http://{address}", SERVED_NAME)
    raise ValueError(f"contender {name!r}: grpc-streams, client-streams, grpc-batch or vllm-http")


async def rounds(arguments: dict[str, Any]) -> dict[str, Any]:
    run = contender(arguments["contender"], arguments["address"])
    await run(arguments["streams"], 8, -1)  # warm: connections, the first requests
    rates = []
    for index in range(arguments["rounds"]):
        started = time.perf_counter()
        tokens = await run(arguments["streams"], arguments["tokens"], index)
        rates.append(tokens / (time.perf_counter() - started))
    return {"tok_s": rates}


def main() -> None:
    result = asyncio.run(rounds(json.loads(sys.argv[1])))
    print(JOB_RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
