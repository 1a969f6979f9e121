"""RayFleet: N engine servers as Ray actors on a placement group, plus a router.

Each server gets one bundle holding all its devices (``{"GPU": tp x pp, "CPU": 1}``, or
``{"CPU": cpus_per_engine}`` in CPU mode, which is the default where the engine is vLLM's CPU
build: a CPU engine never waits for a GPU; an engine's devices stay on one node) plus any
``resources`` named (custom node resources: ``ray start --resources '{"inference": 8}'`` and
``resources={"inference": 1}`` keep servers to those nodes), and its actor takes that bundle.
``strategy`` is Ray's: PACK (default), SPREAD, STRICT_SPREAD (one server per node), STRICT_PACK.
Pass an existing placement group (``placement_group=`` and ``bundle_offset=``, one bundle per
server) to colocate inference with training. ``start()`` waits until every server
is healthy and the router is up, then returns the addresses; ``close()`` drains the servers,
kills the actors and removes the placement group it created, so no process outlives it.
A GPU engine on a cluster with too few GPUs fails at once, naming ``--cpu-only``, instead of
waiting out the start timeout for bundles Ray can never place.

The stack's addresses and logs are the local fleet's: ``router_port``, ``server_ports`` (0: any
free port), the router's ``http_port`` (the OpenAI edge) and ``metrics_port`` on the router
actor (reachable from outside the cluster with ``host="0.0.0.0"``: advertised as its node's
IP), and ``log_dir``: each actor's output (its engine's too) in a file of its own there, on the
node it runs on. Every wait is sliced, so a signal handler of the caller's (``up``'s SIGTERM)
runs at once instead of after a native wait of minutes.

``supervise()`` applies the fleets' one rule (``supervision.ServerSupervisor``): a server whose
actor, node or engine died is re-created in its bundle — Ray re-places a lost node's bundles on
a node with room — and the router's membership follows (RouterAdmin: the old address removed,
the new one added; its sessions move as on any server death). The router actor is supervised by
the same rule: re-created on its port over the fleet's current servers, it learns where each
session lives from the servers' status feeds.

    with RayFleet(num_servers=2, cpu_only=True) as fleet:
        router = fleet.addresses.router
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from servers.common.event_loops import ASYNCIO
from servers.common.supervision import RestartPolicy, ServerSupervisor
from servers.fleet import ROUTED_EXPERTS_FLAG, Fleet, FleetAddresses, FleetStartFailed
from servers.fleet.ray_actors import EngineServerActor, RouterActor, server_options
from servers.fleet.ray_options import STRATEGIES, ServerGroupOptions, engine_runs_on_cpu
from servers.fleet.ray_waits import (
    actors_started,
    callers_sigterm_kept,
    not_dead_yet,
    sliced,
)
from servers.fleet.seeds import server_seed
from servers.fleet.standbys import StandbyRoles

# The niceness Ray's raylet gives the workers it starts (Ray's default: 15).
RAY_WORKER_NICENESS = "RAY_worker_niceness"


class RayFleet(Fleet):
    """See the module docstring."""

    def __init__(
        self,
        num_servers: int = 2,
        *,
        cpu_only: bool | None = None,
        engine: dict[str, Any] | None = None,
        placement_group: Any = None,
        bundle_offset: int = 0,
        start_timeout: float = Fleet.start_timeout,
        standby: int = 0,
        **options: Any,
    ) -> None:
        # ``standby``: warm standbys beside the ``num_servers`` that serve (``standbys``); the
        # fleet's bundles and ``server_ports`` count them too.
        num_servers += standby
        self.roles = StandbyRoles.last(standby, num_servers)
        self.options = ServerGroupOptions(
            num_servers=num_servers,
            cpu_only=engine_runs_on_cpu() if cpu_only is None else cpu_only,
            engine=engine or {},
            **options,
        )
        ports = self.options.server_ports
        if ports is not None and len(ports) != num_servers:
            raise ValueError(f"{len(ports)} server ports for {num_servers} servers")
        if self.options.strategy not in STRATEGIES:
            raise ValueError(
                f"placement strategy {self.options.strategy!r}: use one of {', '.join(STRATEGIES)}"
            )
        # Checked now, before Ray starts anything: the flags every server will take.
        self._server = server_options(self.options.server_args, self.options.engine, "")
        self.start_timeout = start_timeout
        self._external_pg = placement_group
        self._bundle_offset = bundle_offset
        self._pg: Any = None
        # Placement groups of servers added by scale() (one bundle each), by server index.
        self._added_pgs: dict[int, Any] = {}
        self._servers: list[Any] = []
        self._router: Any = None
        self._env: dict[str, str] = {}
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._router_supervisor: threading.Thread | None = None
        self.router_supervision: ServerSupervisor | None = None
        self.http_port: int | None = None  # the router's OpenAI HTTP edge, once started
        self.metrics_port: int | None = None

    @property
    def devices_per_engine(self) -> int:
        engine = self._server.engine
        return int(engine.tensor_parallel_size) * int(engine.pipeline_parallel_size)

    def bundle(self) -> dict[str, float]:
        """One server's bundle: its devices (one node) and the resources asked for."""
        if self.options.cpu_only:
            devices = {"CPU": self.options.cpus_per_engine}
        else:
            devices = {"GPU": float(self.devices_per_engine), "CPU": 1.0}
        return {**devices, **self.options.resources}

    def bundles(self) -> list[dict[str, float]]:
        return [self.bundle()] * self.options.num_servers

    def start(self, timeout: float | None = None) -> FleetAddresses:
        import ray
        from ray.util.placement_group import placement_group

        timeout = self.start_bound(timeout)
        if not ray.is_initialized():
            # Ray starts its workers at niceness 15, below anything else a node runs: engine
            # servers are a node's main work, not background jobs that yield to every other
            # busy process. A cluster this starts inherits this; one started with `ray start`
            # takes it from that command's environment (see docs/fleet.md).
            os.environ.setdefault(RAY_WORKER_NICENESS, "0")
            with callers_sigterm_kept():
                # The actors' output stays out of the driver's (up's) terminal, as a local
                # fleet's does: it goes to log_dir when given, to Ray's logs otherwise.
                ray.init(
                    address=self.options.ray_address, include_dashboard=False, log_to_driver=False
                )
        self._check_devices()
        env = dict(self.options.env)
        self._env = env
        try:
            if self._external_pg is None:
                self._pg = placement_group(self.bundles(), strategy=self.options.strategy)
                if not sliced(lambda s: bool(self._pg.wait(timeout_seconds=s)), timeout):
                    raise FleetStartFailed(
                        f"Ray could not place {self.options.num_servers} server bundles "
                        f"{self.bundle()} ({self.options.strategy}) within {timeout:g} s: the "
                        "cluster lacks those resources (`ray status` shows what it has)"
                    )
            self._servers = [self._new_server(i) for i in range(self.options.num_servers)]
            started = [s.start.remote() for s in self._servers]
            names = [f"server-{index}" for index in range(len(started))]
            servers = actors_started(started, names, timeout)  # as each actor advertises itself
            # The router stays on this (the driver's) node: a node that leaves takes servers
            # with it, never the router that moves their sessions.
            router = self._start_router(servers, self.options.router_port, timeout)
        except BaseException:  # a signal's exception too: nothing started is left running
            self.close()
            raise
        self.addresses = FleetAddresses(router, tuple(servers), self.roles.of(servers))
        return self.addresses

    def _check_devices(self) -> None:
        """A GPU engine on a cluster without the GPUs its servers need fails now, in one line,
        instead of when the start timeout runs out on bundles Ray can never place."""
        import ray

        if self.options.cpu_only:
            return
        needed = self.devices_per_engine
        present = float(ray.cluster_resources().get("GPU", 0))
        if present < needed:
            raise FleetStartFailed(
                f"the Ray cluster has {present:g} GPUs and each server's engine needs {needed}: "
                "pass --cpu-only (RayFleet(cpu_only=True)) to place servers on CPUs "
                "(vLLM's CPU build), or join a cluster with GPU nodes (--ray-address)"
            )

    def _log_file(self, name: str) -> str | None:
        directory = self.options.log_dir
        return None if directory is None else str(Path(directory).resolve() / f"{name}.log")

    def _start_router(self, servers: list[str], port: int, timeout: float) -> str:
        """A router actor on this (the driver's) node, started; its advertised address (its
        HTTP and metrics ports in ``http_port`` and ``metrics_port``)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # A restarted router binds the ports its first start bound (0 there: any free one).
        http_port = self.options.http_port if self.http_port is None else self.http_port
        metrics = self.options.metrics_port if self.metrics_port is None else self.metrics_port
        self._router = (
            ray.remote(RouterActor)
            .options(num_cpus=0, scheduling_strategy=here)
            .remote(
                servers,
                self.options.host,
                port,
                standbys=list(self.roles.of(servers)),
                http_port=http_port,
                metrics_port=metrics,
                log_file=self._log_file("router"),
                replicas=self.options.router_replicas,
                otlp_traces_endpoint=self.options.otlp_traces_endpoint,
                tokenizer=self.options.tokenizer,
                routed_experts=ROUTED_EXPERTS_FLAG in self.options.server_args,
            )
        )
        (address,) = actors_started([self._router.start.remote()], ["the router"], timeout)
        ports = ray.get(self._router.ports.remote(), timeout=60)
        self.http_port, self.metrics_port = ports["http_port"], ports["metrics_port"]
        return str(address)

    def _new_server(self, index: int, catch_up: bool = False) -> Any:
        """A server actor in its bundle (not started): the fleet's placement group for the
        first ``num_servers``, a group of its own for one ``scale()`` added. With
        ``catch_up``, it reads the fleet's current weights from the other servers before it
        serves (a re-created or added server)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if index in self._added_pgs:
            pg, bundle_index = self._added_pgs[index], 0
        else:
            pg, bundle_index = self._external_pg or self._pg, self._bundle_offset + index
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index
        )
        bundle = self.bundle()
        server_args = list(self.options.server_args)
        peers = [a for i, a in enumerate(self.addresses.servers) if i != index]
        if catch_up and peers:
            server_args += ["--catch-up-from", ",".join(peers)]
        # The engine options over the flags, with this server's own seed (``seeds``).
        seed = server_seed(self._server.engine.seed, index)
        ports = self.options.server_ports
        port = ports[index] if ports is not None and index < len(ports) else 0
        # The server runs on the actor's loop, which Ray makes (uvloop unless RAY_USE_UVLOOP
        # is 0) before the server's code runs: --event-loop asyncio is asked of Ray.
        asyncio_loop = self._server.engine.event_loop == ASYNCIO
        return (
            ray.remote(EngineServerActor)
            .options(
                scheduling_strategy=strategy,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=self.options.resources,
                runtime_env={"env_vars": {"RAY_USE_UVLOOP": "0"}} if asyncio_loop else None,
            )
            .remote(
                server_args,
                {**self.options.engine, "seed": seed},
                self.options.host,
                self._env,
                port=port,
                log_file=self._log_file(f"server-{index}"),
            )
        )

    # -- supervision ---------------------------------------------------------------------------

    def supervise(self, policy: RestartPolicy | None = None, interval: float = 1.0) -> None:
        """Starts re-creating servers that die (in a background thread) until ``close()``."""
        if self._supervisor is not None:
            return
        self.supervision = ServerSupervisor(
            len(self._servers),
            death=self._death,
            restart=self._restart,
            on_event=self.on_event,
            policy=policy or RestartPolicy(),
            on_moved=self._moved,
            addresses=list(self.addresses.servers),
            sleep=self._closing.wait,
            on_death=self._promote_in_place_of,
        )
        self._supervisor = self.supervision.start(self._closing, interval, "ray fleet supervisor")
        self.router_supervision = ServerSupervisor(
            1,
            death=lambda _: self._router_death(),
            restart=lambda _: self._restart_router(),
            on_event=self.on_event,
            policy=policy or RestartPolicy(),
            noun="router",
            back_note="it routes to the fleet again; sessions keep their servers",
            addresses=[self.addresses.router],
            sleep=self._closing.wait,
        )
        self._router_supervisor = self.router_supervision.start(
            self._closing, min(interval, 0.2), "ray router supervisor"
        )

    def _router_death(self) -> str | None:
        import ray

        try:
            ray.get(self._router.pid.remote(), timeout=30)
        except not_dead_yet():
            return None  # busy, or out of reach for now: asked again next pass
        except ray.exceptions.RayActorError as error:
            return f"its actor died: {str(error).splitlines()[0]}"
        return None

    def _restart_router(self) -> str:
        """A new router actor on the old port, over the fleet's current servers: it learns
        where each session lives from the servers' status feeds."""
        import ray

        try:
            ray.kill(self._router)
        except Exception:  # already gone
            pass
        port = int(self.addresses.router.rpartition(":")[2])
        address = self._start_router(list(self.addresses.servers), port, 120)
        self.addresses = replace(self.addresses, router=address)
        return address

    def _death(self, index: int) -> str | None:
        import ray

        try:
            failure = ray.get(self._servers[index].failure.remote(), timeout=30)
        except not_dead_yet():
            return None  # busy, or out of reach for now: asked again next pass
        except ray.exceptions.RayActorError as error:
            return f"its actor died: {str(error).splitlines()[0]}"
        return None if failure is None else str(failure)

    def _restart(self, index: int) -> str:
        import ray

        try:
            ray.kill(self._servers[index])
        except Exception:  # already gone with its node
            pass
        self._servers[index] = self._new_server(index, catch_up=True)
        started = self._servers[index].start.remote()
        return str(actors_started([started], [f"server-{index}"], self.start_timeout)[0])

    def _moved(self, index: int, old: str, new: str) -> None:
        """The router forgets the old address and watches the new one."""
        import grpc

        from skyrl_grpc.v1 import router_pb2

        with self._router_admin() as admin:
            try:
                admin.RemoveBackend(router_pb2.RemoveBackendRequest(address=old), timeout=30)
            except grpc.RpcError as error:  # already removed: nothing to do
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            standby = index in self.roles.indexes
            request = router_pb2.AddBackendRequest(address=new, standby=standby)
            admin.AddBackend(request, timeout=30)
        servers = list(self.addresses.servers)
        servers[index] = new
        self.addresses = replace(
            self.addresses, servers=tuple(servers), standbys=self.roles.of(servers)
        )
        self.on_event(f"the router now routes to {new} in place of {old}")

    # -- growth and shrinkage ------------------------------------------------------------------

    def _add_server(self, index: int, timeout: float) -> str:
        """A server in a placement group of its own, on a node with room (``scale``)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([self.bundle()], strategy=self.options.strategy)
        if not sliced(lambda s: bool(group.wait(timeout_seconds=s)), timeout):
            remove_placement_group(group)
            raise FleetStartFailed(
                f"Ray could not place a server bundle {self.bundle()} within {timeout:g} s"
            )
        self._added_pgs[index] = group
        self._servers.append(self._new_server(index, catch_up=True))
        return str(ray.get(self._servers[index].start.remote(), timeout=timeout))

    def _remove_server(self, index: int) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        actor = self._servers.pop()
        try:
            ray.get(actor.stop.remote(), timeout=60)
        finally:
            ray.kill(actor)
            if index in self._added_pgs:
                remove_placement_group(self._added_pgs.pop(index))

    def kill_server(self, index: int) -> None:
        """Kills server ``index``'s actor (for fault tests and tools)."""
        import ray

        ray.kill(self._servers[index])

    def kill_router(self) -> None:
        """SIGKILL the router actor's process (for fault tests; it runs on this node)."""

        import ray

        os.kill(ray.get(self._router.pid.remote(), timeout=30), signal.SIGKILL)

    def node_ids(self) -> list[str]:
        """The Ray node each server runs on, in server order (Ray's own view)."""
        import ray

        return list(ray.get([s.node_id.remote() for s in self._servers]))

    def pids(self) -> list[int]:
        import ray

        actors = [*self._servers, *([self._router] if self._router is not None else [])]
        return list(ray.get([a.pid.remote() for a in actors]))

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closing.set()
        for supervisor in (self._supervisor, self._router_supervisor):
            if supervisor is not None:
                supervisor.join(timeout=30)
        self._supervisor = self._router_supervisor = None
        stops = []
        if self._router is not None:
            stops.append(self._router.stop.remote())
        stops.extend(s.stop.remote() for s in self._servers)
        for stop in stops:
            try:
                ray.get(stop, timeout=60)
            except Exception:  # an actor that already died has nothing to drain
                pass
        for actor in [*self._servers, *([self._router] if self._router is not None else [])]:
            ray.kill(actor)
        self._servers.clear()
        self._router = None
        for group in [*([self._pg] if self._pg is not None else []), *self._added_pgs.values()]:
            remove_placement_group(group)
        self._pg = None
        self._added_pgs.clear()
