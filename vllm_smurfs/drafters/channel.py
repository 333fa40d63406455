"""The proposer's end of a drafter's socket: it never blocks the target's step, in either direction.

A process drafter speaks `multiprocessing.connection`'s framing (a pickled message after its size:
4 bytes big-endian, or -1 and then 8 bytes for a message over 2 GiB). `Connection.recv` waits for
a whole message and `Connection.send` for the socket to take all of it; on the target's path
neither may wait: a drafter stopped (SIGSTOP, while paused) in the middle of a send leaves half a
message in the socket until it runs again, and a drafter that stops reading fills the socket.

`Channel` reads and writes the same frames on the same socket without waiting: what has arrived
of a message stays in a buffer until the rest comes, and what the socket does not take is queued
and sent as it drains, up to ``max_pending_bytes`` (a message that would go beyond is refused:
the caller skips it, as it skips a drafter that is behind). The drafter's side keeps its plain
blocking `Connection`.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_READ_CHUNK = 1 << 16


def frame(message: Any) -> bytes:
    """``message`` as `multiprocessing.connection` frames it."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > 0x7FFFFFFF:
        return _SHORT.pack(-1) + _LONG.pack(len(payload)) + payload
    return _SHORT.pack(len(payload)) + payload


class Channel:
    """Non-blocking messages over the socket of a `Connection` (which it takes over)."""

    def __init__(self, conn: Connection, max_pending_bytes: int = 1 << 20) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        self._sock.setblocking(False)
        self.max_pending_bytes = max_pending_bytes
        self._in = bytearray()
        self._out = bytearray()
        self._messages: deque[Any] = deque()
        self.bytes_received = 0  # everything read so far (a partial message counts)

    # -- sending ---------------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        """Bytes queued that the socket has not taken yet."""
        return len(self._out)

    def send(self, message: Any) -> bool:
        """Queue ``message`` and send what the socket takes now; False (nothing queued) when
        that would leave more than ``max_pending_bytes`` waiting. Raises OSError when the
        connection is gone."""
        data = frame(message)
        if self._out and len(self._out) + len(data) > self.max_pending_bytes:
            self.flush()
            if self._out and len(self._out) + len(data) > self.max_pending_bytes:
                return False
        self._out += data
        self.flush()
        return True

    def flush(self) -> None:
        """Send what the socket takes now of the queued bytes."""
        while self._out:
            try:
                sent = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            if sent <= 0:
                return
            del self._out[:sent]

    # -- receiving -------------------------------------------------------------------------------
    def receive(self, timeout: float = 0.0) -> Any | None:
        """The next whole message, waiting up to ``timeout`` seconds for one; None if none came.
        Raises EOFError when the other end closed (after the messages it sent are taken)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._messages:
                return self._messages.popleft()
            self.flush()
            closed = self._read()
            self._parse()
            if self._messages:
                return self._messages.popleft()
            if closed:
                raise EOFError("the drafter closed its connection")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            writers = [self._sock] if self._out else []
            select.select([self._sock], writers, [], left)

    def _read(self) -> bool:
        """Take every byte that has arrived; True if the other end has closed."""
        while True:
            try:
                data = self._sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return False
            if not data:
                return True
            self._in += data
            self.bytes_received += len(data)

    def _parse(self) -> None:
        buf = self._in
        while len(buf) >= _SHORT.size:
            (size,) = _SHORT.unpack_from(buf)
            start = _SHORT.size
            if size == -1:
                if len(buf) < start + _LONG.size:
                    return
                (size,) = _LONG.unpack_from(buf, start)
                start += _LONG.size
            if len(buf) < start + size:
                return
            self._messages.append(pickle.loads(bytes(buf[start:start + size])))
            del buf[:start + size]

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
