"""API keys: where the server reads them, how a call's credential is checked, and the prefix-cache
salt a key gives its callers.

A key comes from ``--api-key-file`` (one key a line: several keys, one per tenant), else the
``SCORER_API_KEY`` environment variable, else ``--api-key`` (which shows in ``ps``: discouraged).
A call carries it as ``Authorization: Bearer KEY``: an HTTP header, or gRPC's ``authorization``
metadata. Every key is compared in constant time.

With ``--cache-salt-from-key`` a call's prefix-cache salt is derived from the key it authenticated
with (and the salt it sent, if any): callers of different keys never share cached prompt K/V,
so neither can learn from ``usage.cached_prompt_tokens`` or latency what the other sent (see
docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..settings import API_KEY_ENV

AUTHORIZATION = "authorization"


class Unauthenticated(Exception):
    """A call without a valid ``Authorization: Bearer KEY``."""


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[str, ...]

    @classmethod
    def of(cls, keys: ApiKeys | str | None) -> ApiKeys | None:
        return ApiKeys((keys,)) if isinstance(keys, str) else keys

    def match(self, authorization: str | bytes | None) -> str:
        """The key an ``Authorization`` value (``Bearer KEY``) carries; raises Unauthenticated
        unless it is one of these."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").partition(" ")
        sent = token.strip().encode()
        found = ""
        for key in self.keys:  # all of them: the time taken does not tell which matched
            if hmac.compare_digest(sent, key.encode()) and scheme.lower() == "bearer":
                found = key
        if not found:
            raise Unauthenticated("authorization: Bearer <api key> required")
        return found

    def allows(self, authorization: str | bytes | None) -> bool:
        try:
            return bool(self.match(authorization))
        except Unauthenticated:
            return False


def load_keys(api_key: str | None, api_key_file: str | None, environ: Mapping[str, str] = os.environ):
    """The server's keys from the first of ``--api-key-file``, ``SCORER_API_KEY`` and ``--api-key``
    that is set, or None (no key asked). The file's lines are keys; blank ones and ``#`` comments
    are skipped (the settings checked it holds one)."""
    if api_key_file:
        lines = Path(api_key_file).read_text().splitlines()
        return ApiKeys(tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#")))
    return ApiKeys.of(environ.get(API_KEY_ENV) or api_key)


def key_salt(key: str, salt: str) -> str:
    """The prefix-cache salt of a call authenticated with ``key`` that sent ``salt``: a digest, so
    no key shows in the cache, and calls of other keys (whatever salt they send) never match it."""
    return hashlib.sha256(f"{len(key)}:{key}:{salt}".encode()).hexdigest()


def metrics_guard(settings):
    """With ``--metrics-auth``: whether an ``Authorization`` value may read /metrics (one of the
    server's keys); else None (open)."""
    keys = load_keys(settings.api_key, settings.api_key_file) if settings.metrics_auth else None
    return None if keys is None else keys.allows
