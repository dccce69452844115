"""Where the server's processes meet: the ipc:// addresses of the ZMQ channels between API server processes
and engine cores, all in one private directory.

One API process (`--api-server-count 1`) owns its directory and its engine cores (AsyncEngine). With several,
the supervisor (openai/api_server_manager.py) makes the directory and starts every process; each API server
process `client` binds its input channel to every engine core `engine` and its own output channel, each engine
core connects to all of them and to its control channel (bound by the supervisor). Who binds and who connects
does not depend on who starts first: ZMQ queues on the connecting side until the peer is there.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

DIR_PREFIX = "pagedllm-ipc-"  # tempfile.mkdtemp's prefix of the channels' directory


def owned_directory(addr: str) -> Optional[str]:
    """The private channel directory (one of DIR_PREFIX) an ipc:// address lies in, else None: what a process
    whose parent was killed removes before it exits."""
    if not addr.startswith("ipc://"):
        return None
    directory = os.path.dirname(addr[len("ipc://"):])
    return directory if os.path.basename(directory).startswith(DIR_PREFIX) else None


@dataclass(frozen=True)
class IPCLayout:
    directory: str
    num_clients: int  # API server processes
    num_engines: int  # engine cores (data parallel)

    def input(self, client: int, engine: int) -> str:
        """API process `client` -> engine core `engine` (bound by the API process)."""
        return f"ipc://{self.directory}/in-{client}-{engine}.sock"

    def output(self, client: int) -> str:
        """Every engine core (and the supervisor) -> API process `client` (bound by the API process)."""
        return f"ipc://{self.directory}/out-{client}.sock"

    def control(self, engine: int) -> str:
        """Supervisor -> engine core `engine` (bound by the supervisor): Shutdown, ClientGone."""
        return f"ipc://{self.directory}/ctl-{engine}.sock"

    def engine_inputs(self, engine: int) -> list[str]:
        return [self.input(c, engine) for c in range(self.num_clients)] + [self.control(engine)]

    def engine_outputs(self) -> list[str]:
        return [self.output(c) for c in range(self.num_clients)]

    @property
    def metrics_dir(self) -> str:
        """prometheus_client's multiprocess directory: every API process's samples, summed at scrape."""
        return os.path.join(self.directory, "metrics")


@dataclass(frozen=True)
class ClientSpec:
    """What one API server process of several needs to know about its place."""

    index: int
    layout: IPCLayout
