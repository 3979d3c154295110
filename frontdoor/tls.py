"""TLS for the front doors, from certificate files (PEM): the same files serve HTTP and gRPC.

    front_door: {tls: {cert: /etc/tandem/tls.crt, key: /etc/tandem/tls.key, client_ca: null}}

`client_ca` set: clients must present a certificate signed by it (mutual TLS). TLS 1.2 at least.
Files are read once at start; a missing or unreadable one stops the start with its name.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


class TlsError(ValueError):
    """A certificate or key file is missing, unreadable or does not match."""


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsError(f"cannot read the {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class ServerTls:
    cert: str
    key: str
    client_ca: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """For the HTTP door (asyncio's create_server)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(self.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"cannot use the TLS certificate {self.cert} with key {self.key}"
                           f"{f' and client CA {self.client_ca}' if self.client_ca else ''}: {e}") from None
        return ctx

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For the gRPC door. Checked with ssl first, so a bad pair fails here with its file names."""
        self.ssl_context()
        pair = (read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))
        ca = read_pem(self.client_ca, "client CA") if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
