"""Who may talk to a worker: the shared secret, its challenge-response, TLS contexts, loopback checks.

Standard library only (the torch-free proxy imports it). The threat model is in docs/CONTRACT.md §8.

The secret never travels and is never on a command line: it comes from a file (`--secret-file`) or
the environment (`DRAFTRELAY_SECRET`). With a secret configured, the worker answers a HELLO with a
CHALLENGE carrying a fresh 32-byte nonce; the client answers AUTH with
HMAC-SHA256(secret, AUTH_LABEL || nonce || HELLO payload), which also binds the identity the client
claimed. Only then does the worker look at the HELLO's fields or reserve rows.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import ssl
import stat

SECRET_ENV = "DRAFTRELAY_SECRET"
AUTH_LABEL = b"draftrelay-auth-v1\0"
NONCE_SIZE = 32
MAC_SIZE = 32
MIN_SECRET = 16  # bytes: shorter secrets are guessable offline from one captured exchange


class SecretError(ValueError):
    """A secret file or variable that cannot be used; the message says which and why."""


def _check_secret(raw: bytes, where: str) -> bytes:
    s = raw.strip()
    if len(s) < MIN_SECRET:
        raise SecretError(f"{where}: the secret has {len(s)} bytes, at least {MIN_SECRET} are needed "
                          f"(e.g. `openssl rand -hex 32 > FILE`)")
    return s


def read_secret_file(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace stripped). Refuses files others can read."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            raw = f.read(65536)
    except OSError as exc:
        raise SecretError(f"secret file {path}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"secret file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; "
                          f"chmod 600 {path}")
    return _check_secret(raw, f"secret file {path}")


def load_secret(path: str = "", env: dict | None = None) -> bytes | None:
    """The secret from `path` if given, else from $DRAFTRELAY_SECRET, else None (no authentication)."""
    if path:
        return read_secret_file(path)
    value = (os.environ if env is None else env).get(SECRET_ENV, "")
    if not value:
        return None
    return _check_secret(value.encode(), f"${SECRET_ENV}")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def auth_mac(secret: bytes, nonce: bytes, hello_payload: bytes) -> bytes:
    return hmac.new(secret, AUTH_LABEL + bytes(nonce) + bytes(hello_payload), hashlib.sha256).digest()


def verify_mac(secret: bytes, nonce: bytes, hello_payload: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(auth_mac(secret, nonce, hello_payload), bytes(mac))


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback one ('' and 0.0.0.0 are not)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    try:
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
    except ValueError:
        return False


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """TLS 1.2+ server context from PEM files; ValueError naming the file that does not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot load: {exc}") from None
    return ctx


def client_tls_context(ca: str = "", verify: bool = True) -> ssl.SSLContext:
    """TLS client context: the system's CAs, or `ca` (a PEM file: a private CA or the worker's own
    self-signed certificate). verify=False encrypts without checking who answers (tests only)."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS CA file {ca}: cannot load: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
