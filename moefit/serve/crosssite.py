"""Cross-site protection for a server on the operator's own machine.

A web page the operator happens to open can send requests to 127.0.0.1: a "simple"
POST (Content-Type text/plain) needs no CORS preflight, and DNS rebinding makes a foreign
name resolve to loopback. So, before any route runs:

- a POST to the API must say `Content-Type: application/json` (415 otherwise): no simple
  request can reach the engine;
- a request carrying a browser `Origin` is served only when that origin is the server's
  own (scheme://Host) or listed in `--allowed-origins` (403 otherwise);
- on a loopback bind the `Host` header must be a loopback name (403 otherwise), which is
  what defeats DNS rebinding.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from moefit.serve.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "localhost.")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """'127.0.0.1:8080' -> '127.0.0.1', '[::1]:80' -> '::1'."""
    return (urlsplit("//" + host_header).hostname or "") if host_header else ""


@dataclass(frozen=True)
class CrossSite:
    loopback_bind: bool
    allowed_origins: tuple[str, ...] = ()

    def check(self, method: str, path: str, headers) -> None:
        """Raise ApiError (403 / 415) for a request a browser page must not make."""
        host = headers.get("host", "")
        if self.loopback_bind and not is_loopback(host_name(host)):
            raise ApiError(403, f"Host {host!r} is not a loopback name; this server listens on loopback only "
                           "(a foreign name resolving here is DNS rebinding)", kind="permission_error",
                           code="bad_host")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            raise ApiError(403, f"requests from the web origin {origin!r} are not allowed (start the server with "
                           f"--allowed-origins {origin} to allow it)", kind="permission_error",
                           code="origin_not_allowed")
        if method == "POST" and path.startswith("/v1/") and not _is_json(headers.get("content-type", "")):
            raise ApiError(415, "the request body must be sent with Content-Type: application/json",
                           kind="invalid_request_error", code="unsupported_media_type")

    def origin_allowed(self, origin: str, host: str) -> bool:
        if origin in self.allowed_origins or "*" in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == host

    def cors_headers(self, origin: str | None) -> dict:
        """Headers that let an allowed foreign origin read the answer (and pass a preflight)."""
        if origin is None or not (origin in self.allowed_origins or "*" in self.allowed_origins):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Api-Key"}


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")
