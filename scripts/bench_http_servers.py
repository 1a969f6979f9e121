"""Which HTTP stack serves the OpenAI edge: uvicorn (httptools) vs aiohttp's server.

Each serves the same server-sent-event response (64 events of a completion chunk, then
``[DONE]``) from a bare handler in its own process; 64 concurrent aiohttp clients read them,
alternating between the two for three rounds. Prints events per second. (The measurement
behind servers/router/http_edge's choice of uvicorn.)

Run: .venv/bin/python scripts/bench_http_servers.py
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

EVENTS = 64
CHUNK = {
    "id": "x",
    "object": "text_completion",
    "choices": [{"index": 0, "text": "ab", "token_ids": [5]}],
}
PAYLOAD = [f"data: {json.dumps(CHUNK)}\n\n".encode() for _ in range(EVENTS)]


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for chunk in PAYLOAD:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(0)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def aiohttp_handler(request: Any) -> Any:
    from aiohttp import web

    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for chunk in PAYLOAD:
        await response.write(chunk)
        await asyncio.sleep(0)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def serve(kind: str, port: int) -> None:
    async def main() -> None:
        if kind == "uvicorn":
            import uvicorn

            config = uvicorn.Config(
                asgi_app, host="127.0.0.1", port=port, log_level="error", http="httptools",
                lifespan="off",
            )  # fmt: skip
            await uvicorn.Server(config).serve()
        else:
            from aiohttp import web

            app = web.Application()
            app.router.add_post("/", aiohttp_handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            await asyncio.Event().wait()

    asyncio.run(main())


async def load(url: str, concurrency: int, per_client: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            for _ in range(per_client):
                async with session.post(url, data=b"{}") as response:
                    async for _ in response.content:
                        pass

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return concurrency * per_client * EVENTS / (time.perf_counter() - started)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    ports = {"uvicorn": 18081, "aiohttp": 18082}
    servers = [
        subprocess.Popen([sys.executable, __file__, "serve", kind, str(port)])
        for kind, port in ports.items()
    ]
    try:
        time.sleep(3)
        for round_index in range(3):
            for kind, port in ports.items():
                rate = asyncio.run(load(f"http://127.0.0.1:{port}/", 64, 10))
                print(f"round {round_index}: {kind:8s} {rate:8.0f} events/s", flush=True)
    finally:
        for server in servers:
            server.terminate()


if __name__ == "__main__":
    main()
