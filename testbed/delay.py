"""Added latency on a host's link, without netem (this machine's kernel has none): the packets
its eth0 sends go through an NFQUEUE (``iptables -j NFQUEUE``), and this program, running in
the host's namespace, lets each one go on ``--ms`` milliseconds after it was queued, in order
(``python -m testbed.delay --queue 0 --ms 20``). Two delayed hosts see each other's round
trip grow by twice the delay. It asks the kernel for the packets' metadata only (their ids,
never their bytes) and lets them go in batches (one verdict for every id up to the last one
due), so it costs a few microseconds per packet; with ``--queue-bypass`` in the rule, packets
pass undelayed once it stops.

It speaks nfnetlink_queue directly over a netlink socket (the kernel's ``linux/netfilter/
nfnetlink_queue.h``), so it needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import collections
import select
import socket
import struct
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
NFGEN_HEADER = struct.Struct("=BBH")  # family, version, queue number (big-endian, packed below)
ATTRIBUTE = struct.Struct("=HH")
QUEUE_MAXLEN = 1 << 16


def _attribute(kind: int, payload: bytes) -> bytes:
    length = ATTRIBUTE.size + len(payload)
    return ATTRIBUTE.pack(length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attributes: bytes, sequence: int = 0) -> bytes:
    body = NFGEN_HEADER.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    header = NLMSG_HEADER.pack(
        NLMSG_HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, sequence, 0
    )
    return header + body


class DelayLine:
    """One NFQUEUE, each packet let go ``delay`` seconds after it arrived."""

    def __init__(self, queue: int, delay: float) -> None:
        self.queue = queue
        self.delay = delay
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._sock.bind((0, 0))
        self._pending: collections.deque[tuple[float, int]] = collections.deque()
        self._configure()

    def _configure(self) -> None:
        bind = struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)
        params = struct.pack("!IB", 0, NFQNL_COPY_META)
        flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
        self._sock.send(_message(NFQNL_MSG_CONFIG, self.queue, _attribute(NFQA_CFG_CMD, bind)))
        config = (
            _attribute(NFQA_CFG_PARAMS, params)
            + _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
            + _attribute(NFQA_CFG_MASK, flags)
            + _attribute(NFQA_CFG_FLAGS, flags)
        )
        self._sock.send(_message(NFQNL_MSG_CONFIG, self.queue, config))

    def run(self) -> None:
        while True:
            timeout = None
            if self._pending:
                timeout = max(0.0, self._pending[0][0] - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if ready:
                self._read()
            self._release()

    def _read(self) -> None:
        """Every packet the kernel queued since the last read, each due ``delay`` from now."""
        while True:
            try:
                data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.monotonic()
            offset = 0
            while offset + NLMSG_HEADER.size <= len(data):
                length, kind, _, _, _ = NLMSG_HEADER.unpack_from(data, offset)
                if length < NLMSG_HEADER.size:
                    return
                if kind == NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", data, offset + NLMSG_HEADER.size)
                    if error:
                        raise OSError(-error, "nfnetlink_queue refused a request")
                elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    packet = self._packet_id(data, offset + NLMSG_HEADER.size, offset + length)
                    if packet is not None:
                        self._pending.append((now + self.delay, packet))
                offset += (length + 3) & ~3

    @staticmethod
    def _packet_id(data: bytes, start: int, end: int) -> int | None:
        at = start + NFGEN_HEADER.size
        while at + ATTRIBUTE.size <= end:
            length, kind = ATTRIBUTE.unpack_from(data, at)
            if length < ATTRIBUTE.size:
                return None
            if kind & 0x3FFF == NFQA_PACKET_HDR:
                (packet,) = struct.unpack_from("!I", data, at + ATTRIBUTE.size)
                return int(packet)
            at += (length + 3) & ~3
        return None

    def _release(self) -> None:
        """One verdict for every packet that is due (ids grow in queue order)."""
        now, last = time.monotonic(), None
        while self._pending and self._pending[0][0] <= now:
            last = self._pending.popleft()[1]
        if last is not None:
            verdict = _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            self._sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, verdict))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--ms", type=float, required=True)
    args = parser.parse_args()
    line = DelayLine(args.queue, args.ms / 1000)
    print("delaying", flush=True)
    line.run()


if __name__ == "__main__":
    main()
