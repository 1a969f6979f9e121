"""What a client is made of: addresses and settings only, so it pickles in a few bytes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias, TypedDict

import grpc

from skyrl_grpc import tracing
from skyrl_grpc.channels import DEFAULT_MAX_MESSAGE_BYTES, liveness_options, open_channel
from skyrl_grpc.metadata import bearer
from skyrl_grpc.tls import TlsConfig

__all__ = [
    "DEFAULT",
    "ClientConfig",
    "ClientSettings",
    "Plane",
    "RelayFanout",
    "Timeout",
    "TlsConfig",
]

# ``ClientConfig.weight_relay_fanout``: the relay trees' fan-out (1: a chain; 0: no relay), or
# "auto" (``trainer_client.weights.relay_plan.fanout_for``).
RelayFanout: TypeAlias = int | Literal["auto"]

#: Which of a server's services a call goes to: each may require its own bearer token
#: (``serve --data-token`` / ``--control-token``).
Plane = Literal["data", "control"]


class _Default(enum.Enum):
    """The type of ``DEFAULT`` (an enum of one member, so type checkers can tell it apart)."""

    DEFAULT = "the client's default"

    def __repr__(self) -> str:
        return "DEFAULT"


#: A call's ``timeout`` left to the client: ``ClientConfig.data_timeout`` for data-plane calls,
#: ``ClientConfig.control_timeout`` for control-plane ones. ``None`` means no deadline at all.
DEFAULT: Final = _Default.DEFAULT

#: Seconds, ``None`` for no deadline, or ``DEFAULT`` for the client's setting of the call's plane.
Timeout: TypeAlias = float | _Default | None


@dataclass(frozen=True)
class ClientConfig:
    """Where the stack is and how to talk to it.

    ``router`` takes every data-plane call; ``servers`` are the engine servers the control plane
    fans out to (the router is never in that path).
    """

    router: str
    servers: tuple[str, ...] = ()
    # Deadline of each control-plane call, per server, in seconds.
    control_timeout: float = 60.0
    # Deadline of each data-plane call (None: none; a generation may legitimately take long).
    data_timeout: float | None = None
    # Bearer token sent on every call (servers started with a token require it): the same one
    # for both planes. Servers started with --data-token and --control-token apart take
    # ``data_token`` and ``control_token``, each of which overrides ``token`` for its plane.
    token: str | None = None
    # Bearer token of DataPlane calls (generation, tokenizer, sessions; through the router).
    data_token: str | None = None
    # Bearer token of ControlPlane calls (pause, weights, adapters; to every server).
    control_token: str | None = None
    tls: TlsConfig | None = None
    # How many times a generation aborted by a pause is resubmitted (None: until the budget of
    # tokens is used up; each retry makes progress only if tokens were generated). A sample
    # still aborted after that is returned with finish_reason ABORTED, never raised.
    max_abort_retries: int | None = None
    # Tokens per streamed message for generate() / generate_batch(), which return whole
    # samples: fewer, larger messages cost the server, router and client less CPU per token
    # (docs/performance.md). A pause, a weight-version change and the
    # end flush at once.
    stream_interval: int = 16
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Send generation calls straight to the server the router's policy picks, following the
    # router's view (trainer_client.direct), instead of through the router: the same
    # placement without the extra hop. False: everything goes through the router.
    direct: bool = True
    # The streams of generations to one server (direct) or through the router share one
    # GenerateMultiplex call (skyrl_grpc.multiplex), whose one message per engine step carries
    # every stream's new tokens: the client reads a message a step, not a message a step per
    # stream (the router places each request of its call by its session). False: a
    # GenerateStream call each.
    multiplex: bool = True
    # Direct path: how many times one generation moves on after its server failed (before the
    # first token: a retry; after: the prompt plus the tokens so far, as the router migrates).
    max_direct_failovers: int = 4
    # Direct path: a server that answers no keepalive ping on the generation channel for this
    # many seconds is lost, and its generations move on (as the router's
    # ``--backend-liveness-seconds``): a host cut off by the network closes no connection.
    # Control calls and weights keep a channel of their own with a slower keepalive, whose
    # pings may queue behind a weight update's bytes on a slow link.
    direct_liveness_seconds: float = 2.0
    # A server this client cannot reach is cut out of pauses, resumes and in-band weight
    # updates instead of failing them (each goes on with the others; an update commits), and is
    # taken back by the first such call it answers: it keeps its weights meanwhile, and
    # placement keeps calls off it once it is behind (trainer_client.cut_out). False: those
    # calls fail on it, as every retry does until it answers again.
    cut_out_unreachable: bool = False
    extra_metadata: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    # In-band weight updates go over each server's push socket where it offers one (the same
    # streams at the link's speed instead of gRPC's: trainer_client.weights.push_lanes), else over
    # gRPC. Never with ``tls``: the socket is not encrypted. False: always over gRPC.
    push_socket: bool = True
    # In-band weight updates are relayed: the update is split into ``weight_relay_fanout``
    # shares, each streamed once by the trainer down a relay tree of its own, every forwarding
    # server with that many children and forwarding in one tree only (on a host, in a chain:
    # trainer_client.weights.relay_plan), so what the trainer sends does not grow with the
    # fleet and every host's link carries the update once each way. "auto": one chain up to
    # 32 hosts (one stream per link: 1.10x the link's floor at 4 hosts on the testbed, 1.14x
    # with a trainer's link 4x a server's; docs/weights.md), two trees above (log-deep);
    # k >= 2: k trees; 1: always a chain; 0: the trainer streams to every server (its link
    # carries N copies).
    weight_relay_fanout: RelayFanout = "auto"
    # OpenTelemetry traces over OTLP/gRPC to this host:port (vLLM's flag's name): a span per
    # update_weights and generate_batch, and the W3C trace context on every call, so the
    # servers' spans (each weight update phase, each generation) join the trainer's trace.
    # None: off, at no cost.
    otlp_traces_endpoint: str | None = None

    def metadata(self, plane: Plane) -> tuple[tuple[str, str], ...]:
        """The metadata of a call to ``plane``: the extra pairs, that plane's token and the
        current trace context (tracing on)."""
        pairs = self.call_metadata(plane)
        if tracing.enabled():
            pairs = (*pairs, *tracing.headers().items())
        return pairs

    def call_metadata(self, plane: Plane) -> tuple[tuple[str, str], ...]:
        """What every call to ``plane`` carries whatever it is for: the extra pairs and that
        plane's token (no trace context; a multiplexed call's requests each carry their own)."""
        pairs = list(self.extra_metadata)
        token = (self.data_token if plane == "data" else self.control_token) or self.token
        if token:
            pairs.append(bearer(token))
        return tuple(pairs)

    def timeout(self, plane: Plane, timeout: Timeout) -> float | None:
        """A call's deadline in seconds (None: none): ``timeout`` as given, or for ``DEFAULT``
        this config's setting for ``plane``."""
        if timeout is DEFAULT:
            return self.data_timeout if plane == "data" else self.control_timeout
        return timeout

    def open_channel(self, address: str, liveness_seconds: float | None = None) -> grpc.aio.Channel:
        """A channel to ``address``; with ``liveness_seconds``, one that loses a peer answering
        no keepalive ping within that long (``skyrl_grpc.channels.liveness_options``)."""
        extra = liveness_options(liveness_seconds) if liveness_seconds else []
        return open_channel(
            address, tls=self.tls, max_message_bytes=self.max_message_bytes, extra_options=extra
        )


class ClientSettings(TypedDict, total=False):
    """``ClientConfig``'s settings as keyword arguments of a client's constructor: typed and
    checked, with their defaults and meaning in ``ClientConfig`` (one place decides them)."""

    control_timeout: float
    data_timeout: float | None
    token: str | None
    data_token: str | None
    control_token: str | None
    tls: TlsConfig | None
    max_abort_retries: int | None
    stream_interval: int
    max_message_bytes: int
    direct: bool
    multiplex: bool
    max_direct_failovers: int
    direct_liveness_seconds: float
    cut_out_unreachable: bool
    extra_metadata: tuple[tuple[str, str], ...]
    push_socket: bool
    weight_relay_fanout: RelayFanout
    otlp_traces_endpoint: str | None
