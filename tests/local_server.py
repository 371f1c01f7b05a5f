"""A real HTTP server for CPU tests: uvicorn serving an ASGI app in a thread on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


def free_port() -> int:
    """A TCP port nothing listens on right now (for servers started by port number)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(app, log_level: str = "warning", start_timeout_s: float = 60) -> Iterator[int]:
    """Serve `app` on 127.0.0.1 and yield its port; stop the server on exit."""
    # proto IPPROTO_TCP, which accepted sockets copy: asyncio turns Nagle's algorithm off only
    # on sockets that say so (base_events._set_nodelay). With it on, each answer after a
    # connection's first waited for the client's delayed ACK (~40 ms) and then arrived in one
    # piece: a stream's decode time read as zero. vLLM's uvloop turns Nagle off on any socket.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    # No lifespan: the test apps need no startup hooks, and vLLM's only schedules engine stats
    # logging, with no engine here. The stdlib loop, not uvicorn's default uvloop: uvloop's
    # timers count whole milliseconds, so its asyncio.sleep(0.01) can end after 9 ms, shorter
    # than the app asked for.
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"uvicorn did not start within {start_timeout_s:g} s")
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:  # also when it did not start in time: told to stop, its socket closed
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
