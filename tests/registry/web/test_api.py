"""The JSON API on a real uvicorn server: reads, downloads (Range, ETag, verification), writes behind a
bearer token, 404s, and path traversal attempts."""

from __future__ import annotations

import hashlib
import http.client
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from registry import open_registry
from tests.registry.conftest import Backend
from tests.registry.helpers import flip_byte, request
from tests.registry.web.conftest import VARIANTS
from tests.registry.web.server import serving

HTTP = httpx.Client(timeout=30)  # one client: creating one per request costs ~100 ms (its TLS context)
Q8 = "acme/tiny/Q8_0@1"
Q8_FILE = "tiny-Q8_0.gguf"
Q8_BYTES = VARIANTS["Q8_0"][2][Q8_FILE]
Q8_SHA = hashlib.sha256(Q8_BYTES).hexdigest()


def url(base: str, ref: str, name: str) -> str:
    return f"{base}/api/v1/versions/{ref}/-/files/{name}"


def raw_get(base: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client-side normalisation of ``..`` or percent-escapes)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_openapi_schema_lists_every_endpoint(small_server: str) -> None:
    schema = HTTP.get(f"{small_server}/api/v1/openapi.json").json()
    paths = set(schema["paths"])
    for p in ("/api/v1/models", "/api/v1/models/{model}", "/api/v1/models/{model}/-/table",
              "/api/v1/variants/{variant}/-/versions", "/api/v1/versions/{ref}", "/api/v1/versions/{ref}/-/results",
              "/api/v1/versions/{ref}/-/files", "/api/v1/versions/{ref}/-/files/{name}",
              "/api/v1/versions/{ref}/-/lineage", "/api/v1/versions/{ref}/-/aliases/{alias}",
              "/api/v1/versions/{ref}/-/state"):
        assert p in paths, p
    reference = HTTP.get(f"{small_server}/api").text  # the endpoint list, rendered from the schema
    assert "/api/v1/versions/{ref}/-/files/{name}" in reference and "Range" in reference


def test_models_with_filters(small_server: str) -> None:
    get = lambda **q: [m["name"] for m in HTTP.get(f"{small_server}/api/v1/models", params=q).json()]  # noqa: E731
    assert get() == ["acme/tiny", "other"]
    assert get(format="awq") == ["acme/tiny"]
    assert get(architecture="MambaForCausalLM") == ["other"]
    assert get(q="TIN") == ["acme/tiny"]
    assert get(q="nothing-like-it") == []
    detail = HTTP.get(f"{small_server}/api/v1/models/acme/tiny").json()
    assert detail["model"]["formats"] == ["awq", "exl2", "gguf"]
    assert {v["variant"]: v["version"] for v in detail["variants"]}["Q8_0"] == 2


def test_table_rows_carry_metrics_and_reasons(small_server: str) -> None:
    rows = {r["variant"]: r for r in HTTP.get(f"{small_server}/api/v1/models/acme/tiny/-/table").json()}
    assert rows["Q4_K_M"]["kld"] == 3e-3 and rows["Q4_K_M"]["top1_pct"] == pytest.approx(95.0)
    assert rows["Q4_K_M"]["pp_tok_s"] == 1000.0 and rows["Q4_K_M"]["tg_tok_s"] == 120.0
    assert rows["Q8_0"]["ppl"] == 10.0 and rows["Q8_0"]["aliases"] == {"latest": 2, "production": 1}
    assert rows["F16"]["kld"] is None and rows["F16"]["quality_reason"] == "not evaluated"
    assert rows["Q2_K"]["quality_reason"] == "evaluation failed" and "runner crashed" in rows["Q2_K"]["quality_error"]
    assert rows["Q2_K"]["speed_reason"] == "evaluation failed"
    assert rows["EXL2-4.0bpw"]["kld"] == 2.8e-3 and rows["EXL2-4.0bpw"]["speed_reason"] == "engine unavailable"
    assert rows["EXL2-4.0bpw"]["bpw"] == 4.0 and rows["AWQ-W4-G128-asym"]["quant"] == "W4 g128 asym"
    assert rows["AWQ-W4-G128-asym"]["size"] == sum(len(b) for b in VARIANTS["AWQ-W4-G128-asym"][2].values())


def test_version_endpoints(small_server: str) -> None:
    v = HTTP.get(f"{small_server}/api/v1/versions/acme/tiny/Q8_0@production").json()
    assert v["ref"] == Q8 and v["number"] == 1
    assert HTTP.get(f"{small_server}/api/v1/versions/acme/tiny/Q8_0").json()["number"] == 2  # latest
    versions = HTTP.get(f"{small_server}/api/v1/variants/acme/tiny/Q8_0/-/versions").json()
    assert [x["number"] for x in versions] == [1, 2]
    results = HTTP.get(f"{small_server}/api/v1/versions/{Q8}/-/results").json()
    assert [r["kind"] for r in results] == ["quality", "speed"]
    files = HTTP.get(f"{small_server}/api/v1/versions/{Q8}/-/files").json()
    assert files == [{"name": Q8_FILE, "sha256": Q8_SHA, "size": len(Q8_BYTES),
                      "url": f"/api/v1/versions/{Q8}/-/files/{Q8_FILE}"}]
    lineage = HTTP.get(f"{small_server}/api/v1/versions/{Q8}/-/lineage").json()
    assert lineage["source"]["commit"] == "c0ffee" * 6 + "ab12" and lineage["tool"]["name"] == "synthetic-fixture"
    audit = HTTP.get(f"{small_server}/api/v1/audit", params={"model": "acme/tiny", "variant": "Q8_0"}).json()
    assert any(e["action"] == "alias.set" and e["name"] == "production" for e in audit)


@pytest.mark.parametrize("path", [
    "/api/v1/models/nope", "/api/v1/models/acme/nope", "/api/v1/models/nope/-/table",
    "/api/v1/versions/acme/tiny/NOPE", "/api/v1/versions/acme/tiny/Q8_0@99", "/api/v1/versions/acme/tiny/Q8_0@nope",
    "/api/v1/versions/nope/Q8_0@1/-/files", "/api/v1/variants/acme/tiny/NOPE/-/versions",
    f"/api/v1/versions/{Q8}/-/files/missing.gguf", f"/api/v1/versions/acme/tiny/Q8_0@7/-/files/{Q8_FILE}",
    "/api/v1/versions/acme/tiny/Q8_0@1/-/results/x", "/api/v1/no-such-endpoint",
])
def test_unknown_references_are_404_json(small_server: str, path: str) -> None:
    r = HTTP.get(small_server + path)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == "not_found"


@pytest.mark.parametrize("path", ["/models/nope", "/versions/acme/tiny/Q8_0@99", "/versions/acme/tiny/NOPE"])
def test_unknown_pages_are_404_html(small_server: str, path: str) -> None:
    r = HTTP.get(small_server + path)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "not in the registry" in r.text or "does not exist" in r.text


def test_full_download_with_etag(small_server: str) -> None:
    r = HTTP.get(url(small_server, Q8, Q8_FILE))
    assert r.status_code == 200 and r.content == Q8_BYTES
    assert r.headers["etag"] == f'"{Q8_SHA}"' and r.headers["accept-ranges"] == "bytes"
    assert r.headers["content-length"] == str(len(Q8_BYTES))
    assert r.headers["content-disposition"] == f"attachment; filename*=UTF-8''{Q8_FILE}"
    assert "immutable" in r.headers["cache-control"]  # a pinned version never changes
    assert "immutable" not in HTTP.get(url(small_server, "acme/tiny/Q8_0@latest", Q8_FILE)).headers["cache-control"]
    again = HTTP.get(url(small_server, Q8, Q8_FILE), headers={"If-None-Match": f'"{Q8_SHA}"'})
    assert again.status_code == 304 and again.content == b""
    other = HTTP.get(url(small_server, Q8, Q8_FILE), headers={"If-None-Match": '"' + "0" * 64 + '"'})
    assert other.status_code == 200
    head = HTTP.head(url(small_server, Q8, Q8_FILE))
    assert head.status_code == 200 and head.headers["etag"] == f'"{Q8_SHA}"' and head.content == b""
    assert head.headers["content-length"] == str(len(Q8_BYTES))


@pytest.mark.parametrize(("header", "first", "last"), [
    ("bytes=0-9", 0, 9), ("bytes=100-", 100, len(Q8_BYTES) - 1), ("bytes=-16", len(Q8_BYTES) - 16, len(Q8_BYTES) - 1),
    ("bytes=9990-20000", 9990, len(Q8_BYTES) - 1), ("bytes=-999999", 0, len(Q8_BYTES) - 1),
])
def test_range_download(small_server: str, header: str, first: int, last: int) -> None:
    r = HTTP.get(url(small_server, Q8, Q8_FILE), headers={"Range": header})
    assert r.status_code == 206
    assert r.content == Q8_BYTES[first:last + 1]
    assert r.headers["content-range"] == f"bytes {first}-{last}/{len(Q8_BYTES)}"
    assert r.headers["etag"] == f'"{Q8_SHA}"'


def test_range_edge_cases(small_server: str) -> None:
    target = url(small_server, Q8, Q8_FILE)
    bad = HTTP.get(target, headers={"Range": f"bytes={len(Q8_BYTES)}-"})
    assert bad.status_code == 416 and bad.headers["content-range"] == f"bytes */{len(Q8_BYTES)}"
    assert HTTP.get(target, headers={"Range": "bytes=-0"}).status_code == 416
    for ignored in ("items=0-5", "bytes=5-2", "bytes=0-1,4-5", "garbage"):
        r = HTTP.get(target, headers={"Range": ignored})
        assert r.status_code == 200 and r.content == Q8_BYTES, ignored
    # If-Range with another digest: the file changed as far as the client knows, send all of it.
    stale = HTTP.get(target, headers={"Range": "bytes=0-9", "If-Range": '"' + "1" * 64 + '"'})
    assert stale.status_code == 200 and stale.content == Q8_BYTES
    fresh = HTTP.get(target, headers={"Range": "bytes=0-9", "If-Range": f'"{Q8_SHA}"'})
    assert fresh.status_code == 206 and fresh.content == Q8_BYTES[:10]


def test_nested_file_name_downloads(small_server: str) -> None:
    r = HTTP.get(url(small_server, "acme/tiny/AWQ-W4-G128-asym@1", "nested/dir/part.bin"))
    assert r.status_code == 200 and r.content == b"nested"
    assert r.headers["content-disposition"].endswith("''part.bin")


TRAVERSALS = [
    "../../../registry.db", "..%2F..%2F..%2Fregistry.db", "%2e%2e/%2e%2e/%2e%2e/registry.db",
    "%2e%2e%2f%2e%2e%2f%2e%2e%2fregistry.db", "..%252F..%252Fregistry.db", "/etc/passwd", "%2Fetc%2Fpasswd",
    "..\\..\\registry.db", "..%5C..%5Cregistry.db", f"../{Q8_FILE}", f"./{Q8_FILE}", f"x/../{Q8_FILE}",
    "%00", f"{Q8_FILE}%00.txt", "blobs/sha256/" + Q8_SHA[:2] + "/" + Q8_SHA,
]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_attempts_never_leave_the_file_list(small_server: str, name: str) -> None:
    prefix = f"/api/v1/versions/{Q8}/-/files/"
    status, body = raw_get(small_server, prefix + name)
    assert status in (400, 404), (status, body[:100])
    assert b"SQLite format 3" not in body and b"root:" not in body and Q8_BYTES not in body


@pytest.mark.parametrize("path", [
    "/static/../registry.db", "/static/%2e%2e/%2e%2e/registry.db", "/static/..%2F..%2Fregistry.db",
    "/static//etc/passwd", "/static/%2Fetc%2Fpasswd", "/api/v1/versions/acme/tiny/Q8_0@1/../../../registry.db",
    "/versions/..%2F..%2Fregistry.db", "/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
])
def test_traversal_elsewhere_is_refused(small_server: str, path: str) -> None:
    status, body = raw_get(small_server, path)
    assert status in (400, 404), (status, body[:100])
    assert b"SQLite format 3" not in body and b"root:" not in body


def _alias(base: str, token: str | None, alias: str = "candidate", ref: str = Q8) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return HTTP.put(f"{base}/api/v1/versions/{ref}/-/aliases/{alias}", headers=headers, json={"note": "web test"})


def _state(base: str, token: str | None, state: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return HTTP.post(f"{base}/api/v1/versions/{Q8}/-/state", headers=headers, json={"state": state})


def test_writes_disabled_without_a_configured_token(small_server: str) -> None:
    for token in (None, "anything"):
        assert _alias(small_server, token).status_code == 403
        assert _state(small_server, token, "validated").status_code == 403
    assert HTTP.delete(f"{small_server}/api/v1/variants/acme/tiny/Q8_0/-/aliases/production").status_code == 403
    assert HTTP.get(f"{small_server}/api/v1/models/acme/tiny").json()["variants"][-1]["aliases"]["production"] == 1


def test_writes_need_the_right_bearer_token(small_registry: Path) -> None:
    reg = open_registry(str(small_registry), create=False)
    before = len(reg.audit_log(limit=1000))
    with serving(str(small_registry), token="s3cret-token") as base:
        missing = _alias(base, None)
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        assert HTTP.put(f"{base}/api/v1/versions/{Q8}/-/aliases/candidate",
                         headers={"Authorization": "Basic czNjcmV0"}).status_code == 401
        assert _alias(base, "wrong").status_code == 403
        assert _state(base, None, "validated").status_code == 401
        assert _state(base, "s3cret-tokenX", "validated").status_code == 403
        assert len(reg.audit_log(limit=1000)) == before  # nothing happened
        ok = _alias(base, "s3cret-token")
        assert ok.status_code == 200 and ok.json()["ref"] == Q8
        assert _state(base, "s3cret-token", "validated").json()["state"] == "validated"
        illegal = _state(base, "s3cret-token", "candidate")
        assert illegal.status_code == 409 and illegal.json()["error"] == "illegal_transition"
        assert _alias(base, "s3cret-token", alias="latest").status_code == 409  # automatic alias
        assert _alias(base, "s3cret-token", alias="12").status_code == 400
        assert _alias(base, "s3cret-token", ref="acme/tiny/Q8_0@9").status_code == 404
        assert _state(base, "s3cret-token", "no-such-state").status_code == 422
        gone = HTTP.delete(f"{base}/api/v1/variants/acme/tiny/Q8_0/-/aliases/production",
                            headers={"Authorization": "Bearer s3cret-token"})
        assert gone.status_code == 204
    assert reg.aliases("acme/tiny", "Q8_0") == {"candidate": 1, "latest": 2}
    assert reg.get_version(Q8).state == "validated"
    events = reg.audit_log("acme/tiny", "Q8_0", limit=3)
    assert [e.action for e in events] == ["alias.delete", "state", "alias.set"]
    assert all(e.actor == "web-api@127.0.0.1" for e in events) and events[2].note == "web test"


def test_corrupt_blob_is_never_served_complete(small_registry: Path) -> None:
    reg = open_registry(str(small_registry), create=False)
    path = reg.blobs.local_path(Q8_SHA)
    assert path is not None
    flip_byte(path, offset=len(Q8_BYTES) // 2)
    with serving(str(small_registry)) as base:
        parts = urlsplit(base)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        conn.request("GET", f"/api/v1/versions/{Q8}/-/files/{Q8_FILE}")
        resp = conn.getresponse()
        assert resp.status == 200  # the status line went out before the digest could be checked...
        with pytest.raises(http.client.IncompleteRead) as info:
            resp.read()  # ...but the body stops short of Content-Length: the client sees a failed download
        assert len(info.value.partial) < len(Q8_BYTES)
        conn.close()
        with pytest.raises(httpx.RemoteProtocolError):
            HTTP.get(url(base, Q8, Q8_FILE))
        # A Range read cannot be hashed; it is served by length (documented), so the flipped byte shows.
        part = HTTP.get(url(base, Q8, Q8_FILE), headers={"Range": "bytes=0-99"})
        assert part.status_code == 206 and part.content == Q8_BYTES[:100]


def test_api_on_each_backend(tmp_path: Path, backend: Backend) -> None:
    """The same reads and a download on SQLite and on a real PostgreSQL server (blobs in a folder)."""
    reg = backend.open()
    v = reg.register_version(request(tmp_path, data=b"pg-bytes" * 300))
    reg.add_result(v.ref, {"kind": "quality", "engine": "llama.cpp", "status": "ok", "window_set_id": "w",
                           "metrics": {"ppl": 12.0, "kld_mean": 0.02, "top1_agreement": 0.9}})
    with serving(backend.location, blobs=backend.blobs) as base:
        (row,) = HTTP.get(f"{base}/api/v1/models/demo/-/table").json()
        # a result stored before exact KLD: its kld_mean was a top-K bound, never the plain "kld"
        assert (row["ref"], row["kld"], row["top1_pct"]) == ("demo/Q8_0@1", None, 90.0)
        assert (row["kld_lower_bound"], row["kld_kind"]) == (0.02, "lower_bound")
        r = HTTP.get(url(base, "demo/Q8_0@1", "demo-Q8_0.gguf"), headers={"Range": "bytes=-8"})
        assert r.status_code == 206 and r.content == b"pg-bytes"
        assert HTTP.get(url(base, "demo/Q8_0@1", "demo-Q8_0.gguf")).content == b"pg-bytes" * 300
        reg.add_result(v.ref, {"kind": "speed", "engine": "llama.cpp", "status": "ok",
                               "metrics": {"decode_tok_per_s": 42.0}})
        assert HTTP.get(f"{base}/api/v1/models/demo/-/table").json()[0]["tg_tok_s"] == 42.0  # cache invalidated
