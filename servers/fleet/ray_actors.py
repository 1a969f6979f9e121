"""What runs inside a Ray fleet's actors: one engine server (``EngineServerActor``) or the
router (``RouterActor``), each on the actor's own event loop, and the rule that turns
``skyrl-grpc serve`` flags into one server's options (``server_options``)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def write_output_to(log_file: str | None) -> None:
    """The actor's output (stdout, stderr, its engine's processes, which inherit them) appended
    to ``log_file`` on its node, as a local fleet's ``--log-dir`` keeps each process's."""
    if log_file is None:
        return
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(
        fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting (pid {os.getpid()})\n".encode()
    )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def server_options(server_args: list[str], engine: dict[str, Any], host: str, port: int = 0) -> Any:
    """One server's options: ``skyrl-grpc serve``'s flags (every one of them: LoRA, limits,
    tokens, TLS, dtype, ...), then ``engine`` (``EngineOptions`` fields) over them; the fleet
    picks the address. The rule ``LocalFleet`` follows too: servers take the serve command's
    flags."""
    import dataclasses

    from servers.engine.options import build_parser, options_from_args

    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(f"{flag}=") for a in server_args):
            raise ValueError(f"{flag} is the fleet's to choose, not a server flag here")
    parsed, unknown = build_parser().parse_known_args(server_args)
    if unknown:
        raise ValueError(f"not flags of `skyrl-grpc serve`: {' '.join(unknown)}")
    options = options_from_args(parsed)
    return dataclasses.replace(
        options, host=host, port=port, engine=dataclasses.replace(options.engine, **engine)
    )


def advertised(address: str) -> str:
    """``address`` as other nodes reach it: one bound to every interface (``--host 0.0.0.0``)
    is advertised with the IP Ray knows this node by. Asked inside the actor, on its own
    node: the driver's node is not the actor's once the cluster spans hosts."""
    import ray

    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::"):
        return f"{ray.util.get_node_ip_address()}:{port}"
    return address


class EngineServerActor:
    """Runs one EngineServer inside a Ray actor (an async actor: the server shares its loop)."""

    def __init__(
        self,
        server_args: list[str],
        engine: dict[str, Any],
        host: str,
        env: dict[str, str],
        port: int = 0,
        log_file: str | None = None,
    ) -> None:
        write_output_to(log_file)
        os.environ.update(env)
        from servers.common.reaper import reap_children_on_exit
        from servers.engine.process.engine_server import EngineServer
        from servers.engine.process.scratch import use_scratch_directory

        # As a server process started by ``serve``: vLLM's files in a directory of the
        # actor's own, and the engine's processes ended and that directory removed once the
        # actor's process is gone, however Ray ended it (a node's /tmp would otherwise keep
        # every killed server's sockets and files). Detached: Ray kills a dead worker's
        # children, and the watchdog must outlive the actor to do its work.
        reap_children_on_exit(remove=use_scratch_directory(), detach=True)

        self._server = EngineServer(server_options(server_args, engine, host, port))

    async def start(self) -> str:
        """Starts the server; returns the address others reach it at."""
        await self._server.start()
        await self._server.wait_ready()
        return advertised(self._server.address)

    async def stop(self) -> None:
        await self._server.drain(grace=5)

    def failure(self) -> str | None:
        """Why the server stopped serving (its engine failed or died); None while it serves."""
        return self._server.failure

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


class RouterActor:
    """Runs the router inside a Ray actor."""

    def __init__(
        self,
        backends: list[str],
        host: str,
        port: int = 0,
        *,
        standbys: list[str] | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        log_file: str | None = None,
        replicas: int = 1,
        otlp_traces_endpoint: str | None = None,
        tokenizer: str | None = None,
        routed_experts: bool = False,
    ) -> None:
        from servers.router.replicas import RouterReplicas
        from servers.router.router_server import RouterOptions, RouterServer
        from skyrl_grpc import tracing

        write_output_to(log_file)
        self._backends = backends
        self._router: RouterServer | None = None
        self._replicas: RouterReplicas | None = None
        if replicas > 1:  # processes of this actor's node, sharing its ports
            argv = ["--backends", ",".join(backends), "--host", host, "--port", str(port)]
            argv += ["--standbys", ",".join(standbys)] if standbys else []
            argv += ["--http-port", str(http_port)] if http_port is not None else []
            argv += ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
            if otlp_traces_endpoint:
                argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
            argv += ["--tokenizer", tokenizer] if tokenizer else []
            argv += ["--routed-experts"] if routed_experts else []
            self._replicas = RouterReplicas(argv, replicas, host, port, http_port, metrics_port)
        else:
            tracing.configure("skyrl-router", otlp_traces_endpoint)
            self._router = RouterServer(
                RouterOptions(
                    backends=backends,
                    standbys=list(standbys or ()),
                    host=host,
                    port=port,
                    http_port=http_port,
                    metrics_port=metrics_port,
                    otlp_traces_endpoint=otlp_traces_endpoint,
                    tokenizer=tokenizer,
                    routed_experts=routed_experts,
                )
            )

    async def start(self) -> str:
        if self._replicas is not None:
            await self._replicas.start()
            await self._replicas.wait_healthy(len(self._backends), timeout=120)
            return advertised(self._replicas.address)
        assert self._router is not None
        await self._router.start()
        await self._router.wait_healthy(len(self._router.options.backends), timeout=120)
        return advertised(self._router.address)

    async def stop(self) -> None:
        if self._replicas is not None:
            await self._replicas.stop()
        elif self._router is not None:
            await self._router.stop(grace=2)

    def ports(self) -> dict[str, Any]:
        """The ports its OpenAI edge and metrics endpoint bound (None: not served)."""
        if self._replicas is not None:
            described = self._replicas.describe()
            return {"http_port": described["http_port"], "metrics_port": described["metrics_port"]}
        assert self._router is not None
        return {"http_port": self._router.http_port, "metrics_port": self._router.metrics_port}

    def pid(self) -> int:
        return os.getpid()
