"""Real ZMQ sockets for the simulated side channels (NIXL side channel, MoRIIO handshake/notify ports)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from appliance.connector.sim import RouterHandler

log = logging.getLogger("appliance.engine.sim")



class Transport:
    """Owns the ZMQ context: ROUTER listeners, request/reply calls and fire-and-forget sends."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []
        self._senders: dict[str, zmq.asyncio.Socket] = {}

    def bind_router(self, host: str, port: int, handler: RouterHandler, name: str) -> int:
        """Bind a ROUTER socket (port 0 = any free port) served by ``handler``; returns the port."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        self._sockets.append(sock)
        self._tasks.append(asyncio.create_task(self._serve(sock, handler, name), name=f"sim-{name}"))
        return port

    async def _serve(self, sock: zmq.asyncio.Socket, handler: RouterHandler, name: str) -> None:
        while True:
            frames = await sock.recv_multipart()
            identity, rest = frames[0], frames[1:]
            try:
                replies = await handler(rest)
            except Exception:  # a malformed message must not kill the listener
                log.exception("%s: cannot handle message %r", name, rest[:1])
                continue
            for reply in replies:
                await sock.send_multipart([identity, *reply])

    async def request(
        self, host: str, port: int, frames: list[bytes], replies: int, timeout_s: float
    ) -> list[list[bytes]]:
        """Send ``frames`` on a fresh DEALER and wait for ``replies`` messages (TimeoutError if late)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        try:
            await sock.send_multipart(frames)
            return [await asyncio.wait_for(sock.recv_multipart(), timeout_s) for _ in range(replies)]
        finally:
            sock.close(linger=0)

    async def send(self, host: str, port: int, frames: list[bytes]) -> None:
        """Fire-and-forget on a cached DEALER, as vLLM's connectors send notifications."""
        path = f"tcp://{host}:{port}"
        sock = self._senders.get(path)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(path)
            self._senders[path] = sock
        await sock.send_multipart(frames)

    def dealer(self, endpoint: str) -> zmq.asyncio.Socket:
        """A connected DEALER the caller owns (used for registration heartbeats)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._sockets.append(sock)
        return sock

    async def close(self) -> None:
        """Stop listeners and close every socket."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in [*self._sockets, *self._senders.values()]:
            sock.close(linger=0)
        self.ctx.destroy(linger=0)
