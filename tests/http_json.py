"""One JSON reply of the tests' stand-in HTTP servers (the API server, the OpenAI-shaped server, the
training's Kubernetes stand-in): the status, the body and its length, as a real server sends them."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
