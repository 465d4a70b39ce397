"""The service's bearer token: where it comes from, and the ASGI middleware that demands it on every route.

The token is the operator's (`--token` or PAGEFLEET_SERVE_TOKEN) or made on first start
(`secrets.token_urlsafe`) and kept in a file only its owner can read (0600). Only its SHA-256 digest
travels to the Serve replica, so the secret never sits in Ray's deployment state; a request's token
is hashed and compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

DEFAULT_TOKEN_FILE = "~/.config/pagefleet/serve-token"
TOKEN_ENV = "PAGEFLEET_SERVE_TOKEN"
MIN_TOKEN_CHARS = 16


def resolve_token(token: str | None = None, token_file: str | None = None) -> tuple[str, str]:
    """(token, where it came from): the given token, else the token file's, else a new one written there (0600)."""
    given = token or os.environ.get(TOKEN_ENV)
    if given:
        if len(given.strip()) < MIN_TOKEN_CHARS:
            raise ValueError(f"the serve token must have at least {MIN_TOKEN_CHARS} characters; pass a longer --token "
                             f"(or {TOKEN_ENV}), or leave both unset to have one made")
        return given.strip(), "--token" if token else f"${TOKEN_ENV}"
    path = Path(os.path.expanduser(token_file or DEFAULT_TOKEN_FILE))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"token file {path} must be owned by you and readable by you alone: run `chmod 600 {path}` "
                         "(or delete it to have a new token made)")
    text = path.read_text().strip()
    if len(text) < MIN_TOKEN_CHARS:
        raise ValueError(f"token file {path} holds no token of at least {MIN_TOKEN_CHARS} characters; delete it to "
                         "have a new one made")
    return text, str(path)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <token>`, else 401 (JSON `detail`)."""

    def __init__(self, app: Any, token_sha256: str) -> None:
        self.app = app
        self.token_sha256 = token_sha256

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": "missing or wrong bearer token: send `Authorization: Bearer <token>` with the "
                                     "token from the token file `pagefleet serve` printed"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, presented = values[0].decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return False
        return hmac.compare_digest(token_digest(presented.strip()), self.token_sha256)
