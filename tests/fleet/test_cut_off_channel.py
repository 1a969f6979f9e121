"""A trainer client's direct-path channel to a server whose host is cut off: a call placed on it
while the channel tries to reconnect fails over within the liveness. No answer reaches the
connection attempt, so only a timeout ends it: the liveness's keepalive timeout, which gRPC also
sets as the socket's TCP_USER_TIMEOUT, gives it up in a second, where gRPC's connect timeout
would be 20 s. (Checked while looking for the 7.98 s outlier of the direct-path fault test,
issue 76: it is not this.) Two testbed hosts, a stand-in server on one (the subject is the
client's channel)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from testbed.stack import ROOT, Printed, Process
from tests.helpers.hosts import open_testbed

LIVENESS_SECONDS = 2.0
# The probe's call deadline: a call left to gRPC's reconnection waits all of it.
CALL_SECONDS = 15.0
PORT = 50051
# Seconds a line the probe prints may take: it waits a minute at most for the loss.
PROBE_SECONDS = 90.0


def test_a_call_on_a_cut_off_servers_channel_fails_over_within_the_liveness(
    tmp_path: Path,
) -> None:
    with open_testbed() as bed, (tmp_path / "probe.log").open("w") as log:
        server_host, client_host = bed.add_host("server"), bed.add_host("client")
        server = server_host.popen(
            [sys.executable, "-m", "tests.helpers.fake_backend",
             "--host", server_host.address, "--port", str(PORT)],
            cwd=ROOT,
        )  # fmt: skip
        Process(server_host, server).until("ready")
        address = f"{server_host.address}:{PORT}"
        probe = Printed(
            client_host,
            client_host.popen(
                [sys.executable, "-m", "tests.helpers.channel_probe",
                 address, str(LIVENESS_SECONDS), str(CALL_SECONDS)],
                cwd=ROOT,
                log=log,
            ),
        )  # fmt: skip
        probe.until("READY", PROBE_SECONDS)
        bed.cut_between(server_host, client_host)
        probe.until("LOST", PROBE_SECONDS)  # the keepalive found the server gone
        result = json.loads(probe.until("RESULT ", PROBE_SECONDS).split(" ", 1)[1])
        assert probe.popen.wait(timeout=30) == 0
    assert result["code"] == "UNAVAILABLE", result
    # A connection attempt is given up after half the liveness; allowed twice, with room.
    assert result["seconds"] <= 2 * LIVENESS_SECONDS, result
