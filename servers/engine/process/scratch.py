"""One temporary directory per engine server process, gone with it however it ends.

vLLM and the processes it starts leave files in the system's temporary directory for every
engine: a ZeroMQ socket per channel between the server and its engine core, a file for
``torch.distributed``'s rendezvous, the multiprocessing forkserver's directory, and this
project's own (vLLM's log routing, LoRA adapters being staged). A server killed with SIGKILL, or
by the kernel for memory, cleans none of them up, and a supervised fleet restarting its servers
for weeks filled ``/tmp`` with thousands. ``use_scratch_directory`` points the temporary
directory of this process and of every process it starts at a fresh directory of its own; the
reaper's watchdog (``servers.common.reaper``) removes it once the server's processes are gone.

Caches that must outlive the server stay where they were: torch's compile cache
(``TORCHINDUCTOR_CACHE_DIR``) is pinned to its default, which is under the system's temporary
directory, before that moves.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from pathlib import Path

PREFIX = "skyrl-engine-"


def _inductor_cache_default() -> str:
    """torch's default compile cache (``torch._inductor.runtime.cache_dir_utils``), computed
    without importing torch."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def use_scratch_directory() -> Path:
    """Creates this server's directory and makes it the temporary directory of this process and
    of the processes it starts from now on; returns it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_default())
    # Named by the process that owns it, for whoever looks at the temporary directory.
    scratch = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = str(scratch)  # gettempdir() caches its first answer
    return scratch
