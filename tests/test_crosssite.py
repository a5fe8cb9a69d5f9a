"""Cross-site rules: what a web page the operator opens can and cannot make a loopback
server do."""

import pytest

from moefit.serve.crosssite import CrossSite
from moefit.serve.protocol import ApiError

LOCAL = CrossSite(loopback_bind=True)
JSON = {"host": "127.0.0.1:8080", "content-type": "application/json"}


def refused(cs, method, path, headers) -> int:
    with pytest.raises(ApiError) as e:
        cs.check(method, path, headers)
    return e.value.status


def test_a_simple_cross_site_post_is_refused():
    headers = {"host": "127.0.0.1:8080", "content-type": "text/plain", "origin": "https://evil.example"}
    assert refused(LOCAL, "POST", "/v1/chat/completions", headers) == 403
    assert refused(LOCAL, "POST", "/v1/chat/completions", {**headers, "origin": "http://127.0.0.1:8080"}) == 415


def test_dns_rebinding_is_refused_by_the_host_check():
    rebound = {"host": "evil.example:8080", "origin": "http://evil.example:8080", "content-type": "application/json"}
    assert refused(LOCAL, "POST", "/v1/completions", rebound) == 403
    assert refused(LOCAL, "GET", "/v1/status", {"host": "evil.example"}) == 403


def test_the_servers_own_page_and_plain_clients_are_served():
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "localhost"):
        LOCAL.check("POST", "/v1/chat/completions", {"host": host, "content-type": "application/json; charset=utf-8",
                                                     "origin": f"http://{host}"})
    LOCAL.check("POST", "/v1/chat/completions", JSON)                  # curl, SDKs: no Origin
    LOCAL.check("GET", "/v1/models", {"host": "127.0.0.1:8080"})


def test_an_allowed_origin_is_served_with_cors_headers_and_a_public_bind_skips_the_host_check():
    cs = CrossSite(loopback_bind=False, allowed_origins=("https://app.example",))
    cs.check("POST", "/v1/chat/completions", {**JSON, "host": "gpu-box:8080", "origin": "https://app.example"})
    assert cs.cors_headers("https://app.example")["Access-Control-Allow-Origin"] == "https://app.example"
    assert cs.cors_headers("https://evil.example") == {}
    assert refused(cs, "POST", "/v1/chat/completions", {**JSON, "origin": "null"}) == 403
