"""TLS on the orchestrator's channel to each worker, and the rule that keeps the secret off the wire.

Workers serve gRPC with TLS when given a certificate (`tandem worker --tls-cert/--tls-key`, Triton's
`--grpc-use-ssl`); the orchestrator verifies them against `ca` (the deployment's `worker_tls.ca`).
Workers found by address (a headless Service's pod IPs) cannot have those addresses in their
certificates: `server_name` is then the name their certificates carry, checked instead.

The deployment secret (tandem/secret.py) travels as a request parameter on every call. It is sent
to a worker on loopback in any case, and to any other worker only over TLS: `secret_refusal` says why
a channel must not carry it, and the channel then sends nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.secret import is_loopback


class WorkerTlsFiles(BaseModel):
    """The files of worker TLS: `worker_tls` in the deployment file (ops/deployment.py)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    ca: str = Field(min_length=1)  # PEM CA that signed the workers' certificates
    server_name: str | None = None  # the name in their certificates, when they are dialled by address
    cert: str | None = None  # local workers serve gRPC with this certificate and key
    key: str | None = None

    @model_validator(mode="after")
    def _pair(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("worker_tls.cert and worker_tls.key go together")
        return self


@dataclass(frozen=True)
class WorkerTls:
    ca: bytes  # PEM: the CA that signed the workers' certificates
    server_name: str | None = None  # the name to check in their certificates instead of the dialled address

    @classmethod
    def from_files(cls, ca_path: str, server_name: str | None = None) -> "WorkerTls":
        with open(ca_path, "rb") as f:
            return cls(f.read(), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def url_host(url: str) -> str:
    return url.rpartition(":")[0].strip("[]")


def secret_refusal(url: str, auth: tuple, tls: WorkerTls | None) -> str | None:
    """Why a channel to `url` carrying `auth` (the secret) must send nothing, or None when it may."""
    if not auth or tls is not None or is_loopback(url_host(url)):
        return None
    return (f"not sending the deployment secret to the worker at {url} in the clear: it is beyond loopback and "
            f"the deployment has no worker_tls (give the workers --tls-cert/--tls-key and the orchestrator "
            f"worker_tls.ca)")
