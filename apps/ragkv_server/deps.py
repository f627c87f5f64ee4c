"""The routes' FastAPI dependencies: the app's service and settings, and the API-key scopes.

With API keys configured every route but ``/healthz`` needs one (``Authorization: Bearer KEY`` or
``X-API-Key: KEY``): reads a read or write key, anything that writes a write key; missing or unknown
key: 401, a read-only key on a write: 403. Without keys no route declares a security scheme (open
reads are not "ignored auth"), and the service warns when bound beyond loopback.

Collections: a request works in one collection, named by the ``X-Ragkv-Collection`` header (default:
``default``, or a limited key's first collection). A key limited to collections gets 403 for naming
another one; inside its collections, ids of other collections are 404 like unknown ones (the routes
pass the collection down: :mod:`ragkv_server.service`).
"""

import hmac
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from ragkv.rag.collections import COLLECTION_PATTERN, DEFAULT_COLLECTION
from ragkv_server.config import Settings
from ragkv_server.errors import ForbiddenError, UnauthorizedError
from ragkv_server.service import Service

#: the request header naming the collection a request works in
COLLECTION_HEADER = "X-Ragkv-Collection"


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


@dataclass(frozen=True)
class Caller:
    """Who is calling: the key's scope ('write', 'read'; None when no keys are configured) and the
    collections it is limited to (None: every collection)."""

    scope: str | None = None
    collections: tuple[str, ...] | None = None

    def default_collection(self) -> str:
        """Where a request that names no collection goes: ``default``, or a limited key's first."""
        return DEFAULT_COLLECTION if self.collections is None else self.collections[0]


def caller_of(settings: Settings, key: str) -> Caller | None:
    """The :class:`Caller` of a presented key (None: unknown); constant-time comparisons, all keys tried."""
    found = None
    for scope, keys in (("write", settings.api_keys), ("read", settings.read_api_keys)):
        for k in keys:
            if hmac.compare_digest(k.key.get_secret_value().encode(), key.encode()) and found is None:
                found = Caller(scope, k.collections)
    return found


def scope_of(settings: Settings, key: str) -> str | None:
    """'write', 'read' or None (unknown) for a presented key."""
    caller = caller_of(settings, key)
    return caller.scope if caller is not None else None


def keys_configured(settings: Settings) -> bool:
    """Whether any API key (write or read) is configured: then every route but /healthz needs one."""
    return bool(settings.api_keys or settings.read_api_keys)


async def caller_scope(
    settings: SettingsDep,
    bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
    header_key: str | None = Security(_api_key_header),
) -> Caller:
    """The :class:`Caller` (scope None when no keys are configured); 401 without a known key."""
    if not keys_configured(settings):
        return Caller()
    key = bearer.credentials if bearer is not None else header_key
    if not key:
        raise UnauthorizedError("this endpoint needs an API key (Authorization: Bearer KEY or X-API-Key)")
    caller = caller_of(settings, key)
    if caller is None:
        raise UnauthorizedError("unknown API key")
    return caller


async def write_scope(caller: Annotated[Caller, Depends(caller_scope)]) -> Caller:
    """:func:`caller_scope`, and 403 for a read-only key."""
    if caller.scope == "read":
        raise ForbiddenError("this API key is read-only; ingest and delete need a write key")
    return caller


async def admin_scope(caller: Annotated[Caller, Depends(write_scope)]) -> Caller:
    """:func:`write_scope`, and 403 for a key limited to collections (admin work spans them all)."""
    if caller.collections is not None:
        raise ForbiddenError("this API key is limited to collections; admin routes need an unlimited key")
    return caller


async def open_scope() -> Caller:
    """No API keys configured: every caller may write, in every collection (loopback development)."""
    return Caller()


def collection_of(caller: Caller, name: str | None) -> str:
    """The collection a request works in: ``name`` (the header) or the caller's default; 403 when the
    caller's key is limited to other collections (whether ``name`` exists is not looked at)."""
    coll = caller.default_collection() if name is None else name
    if caller.collections is not None and coll not in caller.collections:
        raise ForbiddenError(f"this API key may not use collection {coll!r}")
    return coll


def collection_dependency(scope_dep: Any) -> Any:
    """A dependency giving the request's collection, for the caller that ``scope_dep`` resolves."""

    async def request_collection(
        caller: Annotated[Caller, Depends(scope_dep)],
        name: Annotated[
            str | None,
            Header(
                alias=COLLECTION_HEADER,
                pattern=COLLECTION_PATTERN,
                description="the collection this request works in (1-64 letters, digits, _ . -); "
                "default: `default`, or a limited key's first collection",
            ),
        ] = None,
    ) -> str:
        return collection_of(caller, name)

    return request_collection


@dataclass(frozen=True)
class Auth:
    """The auth dependencies routes declare: ``read`` / ``write`` / ``admin`` route dependencies,
    ``scope`` (the :class:`Caller` as a parameter) and ``collection`` (the request's collection as a
    parameter); none that declares a security scheme when no keys are configured."""

    read: list[Any]
    write: list[Any]
    admin: list[Any]
    scope: Any
    collection: Any

    @classmethod
    def of(cls, settings: Settings) -> "Auth":
        """The dependencies for ``settings``' API keys."""
        if not keys_configured(settings):
            return cls([], [], [], open_scope, collection_dependency(open_scope))
        return cls(
            [Depends(caller_scope)],
            [Depends(write_scope)],
            [Depends(admin_scope)],
            caller_scope,
            collection_dependency(caller_scope),
        )
