"""The launcher's /health while no service runs yet: what it is doing before the gateway
starts (downloading and converting the default model on a first start, a minute or more).

It answers on the gateway's address, in the gateway's shape, `503 {"status": "starting",
"phase": ...}`, then hands its listening socket to the gateway (`hand_over`): a client
that polls while the gateway starts waits in the socket's backlog for the gateway's
answer, never finds the address closed. Where the address is taken it does not answer at
all (the gateway will then fail to bind and say so).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

PHASE_RESOLVING = "resolving the model"
PHASE_STARTING_SERVICES = "starting the services"


class StartupHealth:
    """Serves /health with the current phase from a daemon thread until `close()`."""

    def __init__(self, host: str, port: int) -> None:
        self.phase = PHASE_RESOLVING
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = self.path.split("?")[0] == "/health"
                body = json.dumps({"status": "starting", "phase": health.phase, "verifiers": {},
                                   "problems": []} if found else {"error": "starting"}).encode()
                self.send_response(503 if found else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a poll a second would flood the log

        self._server: ThreadingHTTPServer | None = None
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as error:
            logger.info("no start-up /health on %s:%d (%s)", host, port, error)
            return
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="startup-health",
                         daemon=True).start()

    def enter(self, phase: str) -> None:
        logger.info("start-up: %s", phase)
        self.phase = phase

    def hand_over(self) -> int | None:
        """Stops answering but keeps the address: the listening socket's descriptor, made
        inheritable for the gateway to serve on (None: there is none). Connections that
        arrive meanwhile wait in its backlog. `close()` once the gateway has it."""
        if self._server is None:
            return None
        self._server.shutdown()
        self._server.socket.set_inheritable(True)
        return self._server.socket.fileno()

    def close(self) -> None:
        """Closes this process's hold on the address (after `hand_over`, the gateway's
        copy of the socket keeps it)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
