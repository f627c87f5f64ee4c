"""The routes' FastAPI dependencies: the app's service and settings, and the API-key scopes.

With API keys configured every route but ``/healthz`` needs one (``Authorization: Bearer KEY`` or
``X-API-Key: KEY``): reads a read or write key, anything that writes a write key; missing or unknown
key: 401, a read-only key on a write: 403. Without keys no route declares a security scheme (open
reads are not "ignored auth"), and the service warns when bound beyond loopback.
"""

import hmac
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from apps.config import Settings
from apps.errors import ForbiddenError, UnauthorizedError
from apps.service import Service


async def get_service(request: Request) -> Service:
    """The app's :class:`Service` (async: no thread-pool hop per request)."""
    return request.app.state.service


async def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings` (its limits and defaults)."""
    return request.app.state.settings


ServiceDep = Annotated[Service, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer KEY`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key: `X-API-Key: KEY`")


def scope_of(settings: Settings, key: str) -> str | None:
    """'write', 'read' or None (unknown) for a presented key; constant-time comparisons, all keys tried."""
    found = None
    for scope, keys in (("write", settings.api_keys), ("read", settings.read_api_keys)):
        for k in keys:
            if hmac.compare_digest(k.get_secret_value().encode(), key.encode()) and found is None:
                found = scope
    return found


def keys_configured(settings: Settings) -> bool:
    """Whether any API key (write or read) is configured: then every route but /healthz needs one."""
    return bool(settings.api_keys or settings.read_api_keys)


async def caller_scope(
    settings: SettingsDep,
    bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
    header_key: str | None = Security(_api_key_header),
) -> str | None:
    """The caller's scope ('read' or 'write'; None when no keys are configured); 401 without a known key."""
    if not keys_configured(settings):
        return None
    key = bearer.credentials if bearer is not None else header_key
    if not key:
        raise UnauthorizedError("this endpoint needs an API key (Authorization: Bearer KEY or X-API-Key)")
    scope = scope_of(settings, key)
    if scope is None:
        raise UnauthorizedError("unknown API key")
    return scope


async def write_scope(scope: Annotated[str | None, Depends(caller_scope)]) -> str | None:
    """:func:`caller_scope`, and 403 for a read-only key."""
    if scope == "read":
        raise ForbiddenError("this API key is read-only; ingest and delete need a write key")
    return scope


async def open_scope() -> None:
    """No API keys configured: every caller may write (loopback development)."""
    return None


@dataclass(frozen=True)
class Auth:
    """The auth dependencies routes declare: ``read`` / ``write`` route dependencies and ``scope``, the
    caller's scope as a parameter; none that declares a security scheme when no keys are configured."""

    read: list[Any]
    write: list[Any]
    scope: Any

    @classmethod
    def of(cls, settings: Settings) -> "Auth":
        """The dependencies for ``settings``' API keys."""
        if not keys_configured(settings):
            return cls([], [], open_scope)
        return cls([Depends(caller_scope)], [Depends(write_scope)], caller_scope)
