"""What a deployment's doors and worker links need before anything starts, checked up front.

Everything here fails with a DeploymentError whose message is one line naming the cause, before any
worker is started: keys required beyond loopback and missing, a certificate that cannot be read, a
front-door port another process holds, the secret about to go to a worker beyond loopback in the clear.
On SIGHUP (`reload_doors`) the doors' keys and TLS files are read again under the same rules.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

import grpc

from control.worker_tls import WorkerTls, secret_refusal
from frontdoor.api_keys import ApiKeyError, ApiKeys, resolve_keys
from frontdoor.tls import DoorTls, TlsError
from ops.deployment import Deployment, DeploymentError


@dataclass(frozen=True)
class DoorSecurity:
    keys: ApiKeys | None = None
    tls: DoorTls | None = None  # both doors' TLS
    worker_tls: WorkerTls | None = None  # the orchestrator's channel to the workers
    local_worker_tls: tuple[str, str] | None = None  # (cert, key) the local workers serve with

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.ssl_context if self.tls else None

    @property
    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        return self.tls.grpc_credentials if self.tls else None


def door_security(dep: Deployment) -> DoorSecurity:
    fd = dep.front_door
    try:
        keys = resolve_keys(fd.host, fd.api_key_file, fd.no_api_key, fd.open_probes, dep.prefix_cache.per_api_key)
        tls = DoorTls(fd.tls) if fd.tls else None
    except (ApiKeyError, TlsError) as e:
        raise DeploymentError(str(e)) from None
    if dep.limits.max_in_flight_per_key and keys is None:
        raise DeploymentError("limits.max_in_flight_per_key limits each API key holder, and no API keys are "
                              "configured: set TANDEM_API_KEY or --api-key-file, or leave it out")
    wt = dep.worker_tls
    worker_tls = local = None
    if wt is not None:
        try:
            worker_tls = WorkerTls.from_files(wt.ca, wt.server_name)
        except OSError as e:
            raise DeploymentError(f"cannot read worker_tls.ca {wt.ca}: {e.strerror}") from None
        local = (wt.cert, wt.key) if wt.cert else None
    return DoorSecurity(keys, tls, worker_tls, local)


def reload_doors(security: DoorSecurity, dep: Deployment) -> str:
    """SIGHUP: the running doors take the deployment's API keys and TLS files read again
    (frontdoor/api_keys.py: ApiKeys.rotate; frontdoor/tls.py: DoorTls.reload); returns what changed, in words.
    DeploymentError, and nothing changed, when either cannot be taken."""
    fd, said = dep.front_door, []
    try:
        files = fd.tls
        if (files is None) != (security.tls is None):
            raise TlsError("switching the front doors' TLS on or off needs a restart")
        take_tls = security.tls.reload(files) if files is not None else None  # read, not yet served
        if security.keys is None:
            said.append("API keys stay off (switching them on needs a restart)")
        else:
            said.append(security.keys.rotate(resolve_keys(fd.host, fd.api_key_file, fd.no_api_key, fd.open_probes,
                                                          dep.prefix_cache.per_api_key)))
        if take_tls is not None:
            said.append(take_tls())
    except (ApiKeyError, TlsError) as e:
        raise DeploymentError(str(e)) from None
    return "; ".join(said)


def check_secret_links(dep: Deployment, secret: str | None, worker_tls: WorkerTls | None) -> None:
    """Refuse a deployment that would send its secret in the clear to a worker it lists by address.
    (Workers found by DNS are held to the same rule by each channel, control/worker_tls.py.)"""
    auth = (("secret", secret),) if secret else ()
    for pool in (dep.prefill, dep.decode):
        for url in pool.urls:
            why = secret_refusal(url, auth, worker_tls)
            if why:
                raise DeploymentError(why)
        if pool.dns and secret and worker_tls is None:
            raise DeploymentError(f"not sending the deployment secret to the workers of {pool.dns} in the clear: "
                                  f"set worker_tls (the workers' CA, and server_name for addresses found by DNS)")


def port_refusal(host: str, port: int) -> str | None:
    """Why nothing can listen on host:port now (another process holds it, ...), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return f"{host}:{port}: {e.strerror}"
    return None


def check_ports_free(dep: Deployment) -> None:
    """Both front-door ports can be listened on now (port 0: any free port, always fine)."""
    fd = dep.front_door
    for door, port in (("HTTP", fd.http_port), ("gRPC", fd.grpc_port)):
        why = port_refusal(fd.host, port) if port else None
        if why:
            raise DeploymentError(f"the {door} front door cannot listen on {why} (choose another with "
                                  f"--{door.lower()}-port)")
