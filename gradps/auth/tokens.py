"""Tokens: one cluster secret, every token derived from it as
`gradps1.<subject>.<HMAC-SHA256(secret, subject)>`, checked in constant time."""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

ADMIN, SHARD, WORKER = "admin", "shard", "worker"
ROLES = (ADMIN, SHARD, WORKER)
# In a Rule: the calls a worker makes with its own token (`worker-<id>`), as itself only.
OWN_WORKER = "worker-<id>"
# Where a client's token comes from when none is given; and a service's secret.
TOKEN_ENV, TOKEN_FILE_ENV = "GRADPS_TOKEN", "GRADPS_TOKEN_FILE"
SECRET_ENV, SECRET_FILE_ENV = "GRADPS_SECRET", "GRADPS_SECRET_FILE"
# The trailing metadata of JoinWorker that carries the joined worker's own token.
WORKER_TOKEN_KEY = "gradps-worker-token"
# A secret shorter than this is refused: tokens are only as strong as it is.
MIN_SECRET_CHARS = 16
_PREFIX = "gradps1"


@dataclass(frozen=True)
class Caller:
    """Who a checked token speaks for: a role, and for a joined worker its id."""

    role: str
    worker_id: int | None = None


class ClusterSecret:
    """The secret every token derives from: mints tokens and checks them."""

    def __init__(self, secret: str) -> None:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster secret has {len(secret)} characters; it needs at least {MIN_SECRET_CHARS}")
        self._key = secret.encode()

    def _mac(self, subject: str) -> str:
        digest = hmac.new(self._key, f"{_PREFIX}.{subject}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def token(self, role: str, worker_id: int | None = None) -> str:
        """The token of `role`, or of one worker when `worker_id` is given (role worker)."""
        if role not in ROLES or (worker_id is not None and role != WORKER):
            raise ValueError(f"no token for role {role!r}; roles: {', '.join(ROLES)}")
        subject = role if worker_id is None else f"{WORKER}-{worker_id}"
        return f"{_PREFIX}.{subject}.{self._mac(subject)}"

    def check(self, token: str) -> Caller | None:
        """The caller `token` speaks for; None for anything this secret did not mint."""
        prefix, _, rest = token.partition(".")
        subject, _, mac = rest.partition(".")
        caller = _subject(subject)
        if prefix != _PREFIX or caller is None:
            return None
        # Constant time: a wrong MAC takes as long however many of its characters are right.
        if not hmac.compare_digest(self._mac(subject).encode(), mac.encode("utf-8", "replace")):
            return None
        return caller


def _subject(subject: str) -> Caller | None:
    if subject in ROLES:
        return Caller(subject)
    name, _, number = subject.partition("-")
    if name == WORKER and number.isdigit() and len(number) <= 10 and number == str(int(number)):
        return Caller(WORKER, int(number))
    return None
