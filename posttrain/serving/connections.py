"""What a client may hold of `posttrain serve`: time limits on a request's headers and body, and a bound on open
connections, so that a slow or hostile client (connections that send a request line and a header and stop, as a
Slowloris attack does) cannot use up the process's file descriptors and lock the trainer out.

uvicorn times out idle keep-alive connections, and its `limit_concurrency` answers 503 once a whole request has
arrived, but it waits on an unfinished request for ever and accepts connections without bound. `bounded_protocol`
is uvicorn's h11 protocol with:
    header_seconds      a request's line and headers must arrive within this many seconds of its first byte (of the
                        connection, for its first request), else the connection is closed; the API key, which
                        travels in a header, is checked as soon as they have arrived, before any body is read
    body_idle_seconds   a request's body may pause at most this long between two reads (a weight bucket of hundreds
                        of MiB takes its time; a stalled one does not)
    max_connections     at most this many connections open: a new one beyond it closes the oldest connection that
                        is between requests or still sending its headers (a client whose request has arrived keeps
                        its connection); when every connection is busy with a request, the new one is closed
"""

HEADER_SECONDS = 10.0
BODY_IDLE_SECONDS = 60.0
MAX_CONNECTIONS = 256


def server_config(app, log_level: str = "warning", **limits):
    """The uvicorn.Config `posttrain serve` runs `app` with: uvicorn's, on bounded_protocol(**limits)."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, http=bounded_protocol(**limits))


def bounded_protocol(header_seconds: float = HEADER_SECONDS, body_idle_seconds: float = BODY_IDLE_SECONDS,
                     max_connections: int = MAX_CONNECTIONS) -> type:
    """uvicorn's H11Protocol with the module's limits: pass it as `uvicorn.Config(http=...)`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._timer, self._opened = None, self.loop.time()
            self._arm(header_seconds)  # the first request's headers
            if sum(not c.transport.is_closing() for c in self.connections) > max_connections:
                (self._evictable() or self).transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            starting = self.conn.their_state is h11.IDLE and self._timer is None  # a new request's first bytes
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY:  # headers in, body on its way: reset at every read
                self._arm(body_idle_seconds)
            elif state is h11.IDLE:
                if starting:
                    self._arm(header_seconds)
            else:  # the request is whole (or the connection is done with): nothing more to wait for
                self._disarm()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

        def _waiting_for_a_request(self) -> bool:
            """Between requests, or still receiving a request's headers: nothing of the app runs for it."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _evictable(self):
            """The oldest other open connection that is waiting for a request, or None (one closed already stays in
            `connections` until the loop reports it lost)."""
            idle = [c for c in self.connections if c is not self and isinstance(c, BoundedH11Protocol)
                    and not c.transport.is_closing() and c._waiting_for_a_request()]
            return min(idle, key=lambda c: c._opened) if idle else None

    return BoundedH11Protocol
