"""The API server's side of ``pods/portforward`` for the stand-in API server (fake_apiserver.py): a
websocket (RFC 6455) carrying Kubernetes' port-forward protocol ``v4.channel.k8s.io``, as the
kubelet's streaming server speaks it (k8s.io/apimachinery ``pkg/util/httpstream/wsstream``): per
port a data channel and an error channel, each opened with a frame of its channel byte and the
port (two bytes, little-endian), then binary frames ``channel byte + data`` both ways. The pod's
port is a local TCP server the test names. What the ``kubernetes`` client's ``PortForward``
(kubernetes/stream/ws_client.py) reads and sends, nothing more: one port a forward, no v5 close
channel, no fragmented frames."""

from __future__ import annotations

import base64
import hashlib
import select
import socket
import struct

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PROTOCOL = "v4.channel.k8s.io"
BINARY, CLOSE = 0x2, 0x8


def accept(handler, port: int) -> None:
    """Answer the upgrade request of ``handler`` (an http.server handler) with 101 and the protocol."""
    key = handler.headers["Sec-WebSocket-Key"].encode()
    handler.send_response(101, "Switching Protocols")
    handler.send_header("Upgrade", "websocket")
    handler.send_header("Connection", "Upgrade")
    handler.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode())
    handler.send_header("Sec-WebSocket-Protocol", PROTOCOL)
    handler.end_headers()
    handler.wfile.flush()


def frame(payload: bytes, opcode: int = BINARY) -> bytes:
    """A server frame (unmasked, final)."""
    head = bytes([0x80 | opcode])
    if len(payload) < 126:
        return head + bytes([len(payload)]) + payload
    if len(payload) < 2**16:
        return head + bytes([126]) + struct.pack(">H", len(payload)) + payload
    return head + bytes([127]) + struct.pack(">Q", len(payload)) + payload


def _exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """A client frame (masked, as RFC 6455 requires of a client): its opcode and payload."""
    first, second = _exact(sock, 2)
    length = second & 0x7F
    if length == 126:
        length = struct.unpack(">H", _exact(sock, 2))[0]
    elif length == 127:
        length = struct.unpack(">Q", _exact(sock, 8))[0]
    mask = _exact(sock, 4) if second & 0x80 else b"\0\0\0\0"
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(_exact(sock, length)))
    return first & 0x0F, payload


def pump(client: socket.socket, target: tuple[str, int], port: int) -> None:
    """Open the two channels, connect to ``target`` and copy bytes until either side closes."""
    client.sendall(frame(bytes([0]) + struct.pack("<H", port)) + frame(bytes([1]) + struct.pack("<H", port)))
    try:
        remote = socket.create_connection(target, timeout=10)
    except OSError as error:
        client.sendall(frame(bytes([1]) + f"error forwarding port {port}: {error}".encode()) + frame(b"", CLOSE))
        return
    try:
        while True:
            readable, _, _ = select.select([client, remote], [], [], 30)
            if not readable:
                continue
            if client in readable:
                opcode, payload = read_frame(client)
                if opcode == CLOSE:
                    return
                if opcode == BINARY and payload[:1] == b"\0" and len(payload) > 1:
                    remote.sendall(payload[1:])
            if remote in readable:
                data = remote.recv(65536)
                if not data:
                    client.sendall(frame(b"", CLOSE))
                    return
                client.sendall(frame(b"\0" + data))
    except (ConnectionError, OSError):
        return
    finally:
        remote.close()
