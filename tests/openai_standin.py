"""A stand-in for a service's Serve proxy on port 8000, for ``ray-train-eks endpoint`` and ``chat``:
an OpenAI-compatible ``/v1/models`` and a streamed ``/v1/chat/completions`` (server-sent events, one
``data:`` line a chunk, then ``data: [DONE]``, as vLLM's OpenAI server and Ray Serve LLM send them),
on 127.0.0.1. It records the requests it answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from http_json import send_json


class OpenAIStandIn:
    """``models``: the ids ``/v1/models`` lists; the answer to a chat is ``reply`` (split in words);
    ``key``: a bearer key every request must carry (401 otherwise), as a service served with
    ``--internal-lb`` checks."""

    def __init__(self, models: list[str], reply: str = "Hello from the service.", key: str | None = None) -> None:
        self.models, self.reply, self.requests, self.key = list(models), reply, [], key
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, code: int, body: dict) -> None:
                send_json(self, code, body)

            def _refused(self) -> bool:
                if standin.key and self.headers.get("Authorization") != f"Bearer {standin.key}":
                    self._json(401, {"detail": "a bearer key is required"})
                    return True
                return False

            def do_GET(self):
                standin.requests.append(("GET", self.path, None))
                if self._refused():
                    return
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in standin.models]})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                standin.requests.append(("POST", self.path, body))
                if self._refused():
                    return
                if self.path != "/v1/chat/completions" or body.get("model") not in standin.models:
                    self._json(404, {"object": "error", "message": f"model {body.get('model')!r} not found"})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                words = standin.reply.split(" ")
                for index, word in enumerate(words):
                    chunk = {"object": "chat.completion.chunk", "model": body["model"],
                             "choices": [{"index": 0, "delta": {"content": word + (" " if index < len(words) - 1 else "")}}]}
                    self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.address = ("127.0.0.1", self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
