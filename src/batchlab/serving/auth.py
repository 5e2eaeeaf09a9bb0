"""Who may use the server: the API key every /v1 route needs, and the refusal to listen
beyond this machine without one.

``require_key`` reads the key from the ``AppState`` that ``create_app`` keeps on
``app.state.batchlab``; without a key it lets everything through.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Depends, Request

from .protocol import error


class Unauthorized(Exception):
    """A /v1 request without the server's API key."""


async def require_key(request: Request) -> None:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer
    <api_key>`` (compared in constant time, so response times leak nothing about the key).
    Without a key (``AppState.api_key`` is None) it lets everything through."""
    api_key = request.app.state.batchlab.api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise Unauthorized


AUTH = Depends(require_key)  # on every /v1 route


def check_exposure(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to listen beyond this machine without an API key (unless ``insecure``)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty; give a real key, e.g. --api-key $(openssl rand -hex 8)")
    if api_key or insecure:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine "
            "could use the model and read what others send. Give --api-key KEY (clients then send "
            "'Authorization: Bearer KEY'), or --insecure if the network is yours alone."
        )


async def unauthorized(request: Request, exc: Unauthorized):
    """A 401 that tells the client how to send the key."""
    response = error(
        401,
        "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response
