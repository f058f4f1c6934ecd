"""A certificate authority, a server certificate and a client certificate made on the spot (the
``cryptography`` package), for the stand-in API server's HTTPS and x509 client authentication."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_ca_and_certificates(folder: Path, *, server_name: str, client_name: str) -> dict[str, str]:
    """ca.pem, server.pem/server-key.pem (for ``server_name``, an IP address) and client.pem/client-key.pem
    (CN ``client_name``) in ``folder``; their paths by role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, extensions=()):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer)).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(file: str, data: bytes) -> str:
        (folder / file).write_bytes(data)
        return str(folder / file)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = certificate("test-ca", ca_key, "test-ca", ca_key, ca=True)
    server = certificate(server_name, server_key, "test-ca", ca_key, extensions=(
        x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_name))]),
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])))
    client = certificate(client_name, client_key, "test-ca", ca_key,
                         extensions=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),))
    pem = serialization.Encoding.PEM
    return {"ca": write("ca.pem", ca.public_bytes(pem)),
            "server_cert": write("server.pem", server.public_bytes(pem)), "server_key": write("server-key.pem", pem_key(server_key)),
            "client_cert": write("client.pem", client.public_bytes(pem)), "client_key": write("client-key.pem", pem_key(client_key))}
