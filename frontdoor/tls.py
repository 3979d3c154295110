"""TLS for the front doors, from certificate files (PEM): the same files serve HTTP and gRPC.

    front_door: {tls: {cert: /etc/tandem/tls.crt, key: /etc/tandem/tls.key, client_ca: null}}

`client_ca` set: clients must present a certificate signed by it (mutual TLS). TLS 1.2 at least.
A missing or unreadable file stops the start with its name.

The files are read again on SIGHUP (`DoorTls.reload`), so a renewed certificate (cert-manager's, say)
is served without a restart: each new connection, on either door, is handshaken with the newest
certificate, key and client CA; connections already open keep theirs. A reload whose files cannot be
used is refused and the running ones kept. Switching TLS or mutual TLS on or off needs a restart.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import grpc
from pydantic import BaseModel, ConfigDict, Field


class TlsError(ValueError):
    """A certificate or key file is missing, unreadable or does not match."""


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsError(f"cannot read the {what} {path}: {e.strerror}") from None


class ServerTls(BaseModel):
    """The doors' certificate files: front_door.tls in the deployment file."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    cert: str = Field(min_length=1)  # PEM certificate (chain)
    key: str = Field(min_length=1)  # PEM private key
    client_ca: str | None = None  # PEM CA: clients must present a certificate it signed (mutual TLS)

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

    def grpc_config(self) -> grpc.ServerCertificateConfiguration:
        """The files as the gRPC door's certificate configuration. Checked with ssl first, so a bad pair
        fails here with its file names."""
        self.ssl_context()
        pair = (read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))
        ca = read_pem(self.client_ca, "client CA") if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)


class DoorTls:
    """Both doors' TLS, live: `ssl_context` (HTTP) and `grpc_credentials` are made once and serve every
    connection with the newest files `reload` has read. TlsError (from the constructor or `reload`)
    names a file that cannot be used."""

    def __init__(self, files: ServerTls):
        self.files = files
        self._newest = files.ssl_context()
        self._grpc_next: grpc.ServerCertificateConfiguration | None = None  # taken by the next gRPC handshake
        self.ssl_context = files.ssl_context()
        self.ssl_context.sni_callback = self._newest_context  # called on every ClientHello, SNI or not
        self.grpc_credentials = grpc.dynamic_ssl_server_credentials(
            files.grpc_config(), self._next_grpc_config, require_client_authentication=files.client_ca is not None)

    def reload(self, files: ServerTls) -> Callable[[], str]:
        """Read `files` once (TlsError when they cannot serve: nothing changes); the call returned makes
        them served from the next handshake on, and says so in words."""
        if (files.client_ca is None) != (self.files.client_ca is None):
            raise TlsError("switching mutual TLS (front_door.tls.client_ca) on or off needs a restart")
        newest, grpc_config = files.ssl_context(), files.grpc_config()

        def take() -> str:
            self.files, self._newest, self._grpc_next = files, newest, grpc_config
            return f"TLS certificate {files.cert} read again"
        return take

    def _newest_context(self, connection, server_name, context) -> None:
        connection.context = self._newest

    def _next_grpc_config(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before every handshake: a new configuration once after a reload, else None (keep)."""
        config, self._grpc_next = self._grpc_next, None
        return config
