"""A small HTTP proxy on 127.0.0.1 in front of a real server (the tests' MLflow server, moto's S3): it
forwards every request as it came and hands the answer back, and, for the requests a test names (a
method and a path pattern), does what a broken network or server does instead:

- ``stall``: takes the request and never answers (a server that accepts and hangs);
- ``drop``: takes the request and closes the connection without a word;
- ``status``: answers with a status of its own (a 503 with ``Retry-After``, a 403 with a body);
- ``late``: forwards the request (the server acts on it) and hands the answer back only after a delay,
  past the client's timeout (a slow but successful call);
- ``answer``: answers with what a function of the request returns (an endpoint the server lacks);
- ``gateway``: answers with a status of its own at once (a 504, 502 or 408 from a load balancer that gave
  up waiting) while the request reaches the server ``delay_s`` later (the backend still at work on it).

It counts the bytes of the answers' bodies it forwarded (what a client read from the server), and which
requests it saw."""

from __future__ import annotations

import http.client
import re
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from local_s3 import free_port

#: Headers of one hop, never forwarded (RFC 9110, section 7.6.1).
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
              "upgrade", "content-length"}


@dataclass
class Fault:
    """What the proxy does to requests of ``method`` whose path matches ``path`` (a regex), ``times`` times
    (None: until removed)."""

    how: str
    method: str = "*"
    path: str = ".*"
    status: int = 503
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    delay_s: float = 0.0
    times: int | None = None
    #: ``answer``: (method, path, body) -> (status, headers, body).
    respond: Callable[[str, str, bytes], tuple[int, dict, bytes]] | None = None

    def matches(self, method: str, path: str) -> bool:
        return self.method in ("*", method) and re.search(self.path, path) is not None


class FaultProxy:
    """The proxy, serving on ``url`` in its own threads until :meth:`close`."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target_host, self.target_port = parts.hostname, parts.port
        self.faults: list[Fault] = []
        self.seen: list[tuple[str, str]] = []
        self.bytes_out = 0
        self._lock = threading.Lock()
        self._release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # Polled every 50 ms: closing it (each test's teardown) waits one poll, 0.5 s by default.
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def add(self, fault: Fault) -> Fault:
        """Apply ``fault`` from the next request on."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Forward everything again; stalled requests are let go (their connections closed)."""
        with self._lock:
            self.faults.clear()
        self._release.set()
        self._release = threading.Event()

    def close(self) -> None:
        self.clear()
        self.server.shutdown()
        self.server.server_close()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.seen.append((method, path))
            for fault in self.faults:
                if fault.matches(method, path):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self.faults.remove(fault)
                    return fault
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        fault = self._fault_for(handler.command, handler.path)
        if fault is not None and fault.how == "stall":
            self._release.wait(600)
            handler.close_connection = True
            return
        if fault is not None and fault.how == "drop":
            handler.close_connection = True
            return
        if fault is not None and fault.how == "status":
            self._answer(handler, fault.status, list(fault.headers.items()), fault.body)
            return
        if fault is not None and fault.how == "answer":
            status, headers, answer = fault.respond(handler.command, handler.path, body)
            self._answer(handler, status, list(headers.items()), answer)
            return
        if fault is not None and fault.how == "gateway":
            sent = SimpleNamespace(command=handler.command, path=handler.path, headers=handler.headers)
            threading.Timer(fault.delay_s, self._forward, (sent, body)).start()
            self._answer(handler, fault.status, list(fault.headers.items()), fault.body)
            return
        status, headers, answer = self._forward(handler, body)
        if fault is not None and fault.how == "late":
            time.sleep(fault.delay_s)
        self._answer(handler, status, headers, answer)

    def _forward(self, handler: BaseHTTPRequestHandler | SimpleNamespace, body: bytes) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection(self.target_host, self.target_port, timeout=120)
        headers = {key: value for key, value in handler.headers.items() if key.lower() not in HOP_BY_HOP}
        if body or handler.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        connection.request(handler.command, handler.path, body=body, headers=headers)
        response = connection.getresponse()
        answer = response.read()
        connection.close()
        with self._lock:
            self.bytes_out += len(answer)
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
        if handler.command == "HEAD":  # a HEAD's length is the object's (S3's HeadObject: its size)
            kept += [(k, v) for k, v in response.getheaders() if k.lower() == "content-length"]
        return response.status, kept, answer

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, status: int, headers: list, body: bytes) -> None:
        try:
            handler.send_response(status)
            for key, value in headers:
                handler.send_header(key, value)
            if handler.command != "HEAD":
                handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout) meanwhile
            handler.close_connection = True
