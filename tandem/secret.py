"""The deployment secret: what a worker listening beyond loopback requires of every caller.

It comes from the environment, never from a command line (where any local user could read it in
/proc): `TANDEM_SECRET` holds it, or `TANDEM_SECRET_FILE` names a file holding it (a Compose or
Kubernetes secret mounted as a file). The orchestrator sends it as the request parameter
`tandem_secret` on every call to a worker; the worker compares it in constant time.
"""

from __future__ import annotations

import os

from tandem.status import InvalidArgument

PARAMETER = "tandem_secret"
MIN_CHARS = 16


class SecretError(InvalidArgument):
    """The secret is missing where it is required, or unreadable, or too short."""


def load_secret(required: bool = False) -> str | None:
    """The secret from TANDEM_SECRET or TANDEM_SECRET_FILE; None when neither is set (and not required)."""
    value = os.environ.get("TANDEM_SECRET")
    path = os.environ.get("TANDEM_SECRET_FILE")
    if value is None and path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except OSError as e:
            raise SecretError(f"cannot read the deployment secret from TANDEM_SECRET_FILE={path}: {e}") from None
    if value is None:
        if required:
            raise SecretError("this worker listens beyond 127.0.0.1, so it needs the deployment secret: set "
                              "TANDEM_SECRET_FILE to a file holding it (or TANDEM_SECRET); never pass it as an "
                              "argument")
        return None
    value = value.strip()
    if len(value) < MIN_CHARS:
        raise SecretError(f"the deployment secret must be at least {MIN_CHARS} characters (e.g. "
                          f"`head -c 32 /dev/urandom | base64`)")
    return value


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
