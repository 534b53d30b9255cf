"""The control plane's typed app state and its token checks, shared by every route module
(`app`, `cluster`), so the route modules import this, not each other."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.dataplane import DataPlane
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.namespaces import Registry

CONFIG = web.AppKey("config", DaemonConfig)
DATA_SOCKET = web.AppKey("data_socket", socket.socket)
REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", Metrics)
DATAPLANE = web.AppKey("dataplane", DataPlane)
CLEARS = web.AppKey("clears", ThreadPoolExecutor)  # namespace clears wait here (see app.clear)


def token_grant(request: web.Request) -> str | None:
    """The tenant the request's bearer token grants (ADMIN for all), None for none."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""  # (schemes: any case)
    return request.app[CONFIG].tenant_of(token)


def grant_of(request: web.Request) -> str:
    """The tenant the request's bearer token grants (ADMIN for all); 401 without one."""
    grant = token_grant(request)
    if grant is None:
        raise web.HTTPUnauthorized(text="bad or missing token: send Authorization: Bearer TOKEN\n",
                                   headers={"WWW-Authenticate": "Bearer"})
    return grant


def require_admin(request: web.Request) -> None:
    if grant_of(request) != ADMIN:
        raise web.HTTPForbidden(text="this endpoint needs an admin token (one with no tenant)\n")
