"""The HTTP surface over real sockets, the WSGI and ASGI apps, and promtool's lint."""

from __future__ import annotations

import asyncio
import gzip
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

import perfmon

from .conftest import http, promtool_check, wait_until


def _get(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return http(url, method=method, headers=headers)


@pytest.fixture
def served(make_monitor):
    mon = make_monitor(port=0, sample_rate=0.5).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for n in (1, 2, 2, 2, 3):
        model(torch.randn(n, 4))
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 5))
    mon.flush()
    return mon


def test_url_and_port_zero(served) -> None:
    """port=0 picks a free port on 127.0.0.1 and url reports it."""
    assert served.url.startswith("http://127.0.0.1:") and not served.url.endswith(":0")


def test_metrics_over_http_pass_promtool(served) -> None:
    """/metrics in the text format passes `promtool check metrics` with no finding."""
    status, headers, body = _get(served.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert 'perfmon_forward_calls_total{model="lin",stage=""} 6.0' in text
    assert 'perfmon_forward_errors_total{exception="RuntimeError",model="lin"} 1.0' in text
    assert "process_resident_memory_bytes" in text and "perfmon_info{" in text
    result = promtool_check(body)
    assert result.returncode == 0, result.stderr.decode() + result.stdout.decode()
    assert result.stderr.decode().strip() == "" and result.stdout.decode().strip() == ""


def test_openmetrics_and_gzip_on_request(served) -> None:
    """The Accept header selects OpenMetrics; Accept-Encoding: gzip compresses."""
    status, headers, body = _get(served.url + "/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    status, headers, body = _get(served.url + "/metrics", headers={"Accept-Encoding": "gzip"})
    assert headers.get("content-encoding") == "gzip" and b"perfmon_forward_calls_total" in gzip.decompress(body)


def test_healthz_and_stats(served) -> None:
    """/healthz is ok while running; /stats is JSON with exact counts and per-phase percentiles in seconds."""
    status, _, body = _get(served.url + "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, headers, body = _get(served.url + "/stats")
    assert status == 200 and headers["content-type"] == "application/json"
    lin = json.loads(body)["models"]["lin"]
    assert lin["calls"] == 6 and lin["errors"] == {"RuntimeError": 1}
    assert lin["latency"]["cold"]["duration"]["count"] == 4  # 3 warm-up calls + the first (3, 4) input
    assert lin["latency"]["cold"]["duration"]["p50_seconds"] > 0
    assert lin["cold_start_seconds"] > 0 and lin["time_to_first_forward_seconds"] > 0


def test_unknown_path_404_and_wrong_method_405(served) -> None:
    """Unknown paths get a JSON 404; POST to a GET route gets 405 with Allow."""
    status, headers, body = _get(served.url + "/nope")
    assert status == 404 and json.loads(body)["error"] == "not found"
    status, headers, body = _get(served.url + "/metrics", method="POST")
    assert status == 405 and headers["allow"] == "GET, HEAD" and "not allowed" in json.loads(body)["error"]
    status, headers, body = _get(served.url + "/healthz", method="HEAD")
    assert status == 200 and body == b""


def test_stop_closes_the_port(make_monitor) -> None:
    """After stop() the port refuses connections."""
    mon = make_monitor(port=0).start()
    url = mon.url
    assert _get(url + "/healthz")[0] == 200
    mon.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/healthz", timeout=2)
    assert mon.url is None


def test_start_is_idempotent(make_monitor) -> None:
    """Calling start() twice keeps one server and one URL."""
    mon = make_monitor(port=0)
    assert mon.start() is mon
    url = mon.url
    mon.start()
    assert mon.url == url


def test_wsgi_app_serves_the_same_routes(make_monitor) -> None:
    """The WSGI app answers /metrics and 404s like the agent's own server."""
    mon = make_monitor()
    mon.wrap(torch.nn.Linear(2, 2), name="w")(torch.ones(1, 2))
    app = perfmon.make_wsgi_app(mon)
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics"}, start_response))
    assert seen["status"] == "200 OK" and b'perfmon_forward_calls_total{model="w",stage=""} 1.0' in body
    b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/x"}, start_response))
    assert seen["status"].startswith("404")


def test_asgi_app_serves_the_same_routes(make_monitor) -> None:
    """The ASGI app answers /stats and /metrics."""
    mon = make_monitor()
    mon.wrap(torch.nn.Linear(2, 2), name="a")(torch.ones(1, 2))
    app = mon.asgi_app

    async def call(path: str) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        await app({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)
        return sent[0]["status"], sent[1]["body"]

    status, body = asyncio.run(call("/stats"))
    assert status == 200 and json.loads(body)["models"]["a"]["calls"] == 1
    status, body = asyncio.run(call("/metrics"))
    assert status == 200 and b"perfmon_forward_calls_total" in body


def _control(port: int, method: str, path: str, headers: dict[str, str],
             body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """One request to the agent with exactly these headers (http.client adds none but Host when not given)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_control_routes_refuse_rebinding_cross_site_and_simple_requests(make_monitor) -> None:
    """No token, loopback: a foreign Host or Origin, a missing X-Perfmon header and a non-JSON POST are refused."""
    mon = make_monitor(port=0).start()
    port = int(mon.url.rsplit(":", 1)[1])
    own = f"127.0.0.1:{port}"
    ok = {"Host": own, "X-Perfmon": "1"}
    assert _control(port, "GET", "/profiles", ok)[0] == 200
    assert _control(port, "GET", "/profiles", {**ok, "Origin": f"http://{own}"})[0] == 200  # its own page
    assert _control(port, "GET", "/profiles", {**ok, "Host": f"localhost:{port}"})[0] == 200
    status, body = _control(port, "GET", "/profiles", {**ok, "Host": f"attacker.example:{port}"})  # DNS rebinding
    assert status == 403 and body["error"] == "forbidden Host"
    status, body = _control(port, "GET", "/profiles", {**ok, "Host": f"localhost.corp.example:{port}"})
    assert status == 403 and body["error"] == "forbidden Host"
    status, body = _control(port, "POST", "/profile", {**ok, "Origin": "http://evil.example",
                                                        "Content-Type": "application/json"}, b"{}")
    assert status == 403 and "cross-origin" in body["error"]
    assert _control(port, "GET", "/profiles", {**ok, "Origin": "null"})[0] == 403
    # what a no-cors fetch from a web page can send: no custom header, a text/plain body
    status, body = _control(port, "POST", "/profile", {"Host": own, "Content-Type": "text/plain"}, b'{"steps": 100}')
    assert status == 403 and "X-Perfmon" in body["error"]
    status, body = _control(port, "GET", f"/profiles/{'f' * 22}/trace", {"Host": own})
    assert status == 403 and "X-Perfmon" in body["error"]
    status, body = _control(port, "POST", "/profile", {**ok, "Content-Type": "text/plain"}, b'{"model": "zzz"}')
    assert status == 415 and "JSON" in body["error"]
    status, body = _control(port, "POST", "/profile", {**ok, "Content-Type": "application/json; charset=utf-8"},
                            b'{"model": "zzz"}')
    assert status == 404 and "zzz" in body["error"]  # past every check: the model is unknown
    doc = json.loads(_get(mon.url + "/openapi.json")[2])
    assert {"403", "415"} <= set(doc["paths"]["/profile"]["post"]["responses"])


def test_with_a_token_host_and_origin_are_still_checked(make_monitor) -> None:
    """With a token no X-Perfmon is needed, but Host must still name the agent (allowed_hosts adds names)."""
    mon = make_monitor(port=0, token="token-12345678", allowed_hosts=("perfmon.example.svc",)).start()
    port = int(mon.url.rsplit(":", 1)[1])
    auth = {"Authorization": "Bearer token-12345678"}
    assert _control(port, "GET", "/profiles", {"Host": f"127.0.0.1:{port}", **auth})[0] == 200
    assert _control(port, "GET", "/profiles", {"Host": f"perfmon.example.svc:{port}", **auth})[0] == 200
    assert _control(port, "GET", "/profiles", {"Host": "attacker.example", **auth})[0] == 403
    assert _control(port, "GET", "/profiles", {"Host": f"127.0.0.1:{port}"})[0] == 401
    assert perfmon.Config.from_env({"PERFMON_ALLOWED_HOSTS": "a.svc, b.svc"}).allowed_hosts == ("a.svc", "b.svc")


def test_a_token_read_with_its_newline_works_and_one_no_header_can_carry_is_refused(make_monitor) -> None:
    """`token=open(secret).read()` keeps the file's newline: the ends of a header value never arrive, so the token is
    taken stripped (as PERFMON_TOKEN is; as given, nobody could ever authenticate). A token an HTTP header cannot
    carry (non-ASCII, a control character) is a ConfigError when the monitor is made, not a 401 for everyone."""
    mon = make_monitor(port=0, token=" secret-token-2\n").start()
    port = int(mon.url.rsplit(":", 1)[1])
    own = {"Host": f"127.0.0.1:{port}"}
    assert _control(port, "GET", "/profiles", {**own, "Authorization": "Bearer secret-token-2"})[0] == 200
    assert _control(port, "GET", "/profiles", {**own, "Authorization": "Bearer secret-token"})[0] == 401
    assert perfmon.Config.from_env({"PERFMON_TOKEN": "secret-token-2\n"}).token == "secret-token-2"
    for bad in ("sécret-tökén", "secret\x00token", "a\nsecret-token", "  short  ", "\u00a0secret-token\u00a0"):
        with pytest.raises(perfmon.ConfigError, match="token") as refused:
            perfmon.Config(token=bad)
        assert bad.strip() not in str(refused.value)  # a secret: never echoed


def test_the_no_token_decision_uses_socket_addresses_not_names() -> None:
    """Loopback means a loopback IP as the sockets report it: names that merely start like one never count."""
    from perfmon.http.security import host_names_agent, owner_without_token

    assert owner_without_token("127.0.0.1", "127.0.0.1") and owner_without_token("::1", "::1")
    assert owner_without_token("127.0.0.1", "::ffff:127.0.0.5")
    for bound, peer in [("127.0.0.1", "10.0.0.7"), ("0.0.0.0", "127.0.0.1"), ("localhost.corp.example", "127.0.0.1"),
                        ("127.evil.example", "127.0.0.1"), ("localhost", "127.0.0.1"), ("127.0.0.1", None),
                        ("127.0.0.1", "localhost")]:
        assert not owner_without_token(bound, peer), (bound, peer)
    assert host_names_agent("127.0.0.1:9478", "127.0.0.1") and host_names_agent("[::1]:9478", "127.0.0.1")
    assert host_names_agent("LOCALHOST:1", "127.0.0.1") and host_names_agent("10.1.2.3:9478", "0.0.0.0")
    assert not host_names_agent("10.1.2.3:9478", "10.9.9.9") and not host_names_agent("127.0.0.1.nip.io", "127.0.0.1")
    assert not host_names_agent("attacker.example", None) and host_names_agent("svc", "10.0.0.1", ("svc",))


def test_mounted_apps_need_a_token_and_then_check_host(make_monitor) -> None:
    """Mounted: 403 on control routes without a token; with one, a foreign Host is refused like the agent's own."""
    import io

    def call(app: Any, host: str, token: str | None) -> str:
        got: list[str] = []
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/profiles", "HTTP_HOST": host, "wsgi.input": io.BytesIO()}
        if token:
            environ["HTTP_AUTHORIZATION"] = f"Bearer {token}"
        b"".join(app(environ, lambda status, headers: got.append(status)))
        return got[0].split()[0]

    bare = make_monitor()
    assert call(perfmon.make_wsgi_app(bare), "127.0.0.1:8000", None) == "403"
    guarded = make_monitor(token="token-12345678")
    app = perfmon.make_wsgi_app(guarded)
    assert call(app, "127.0.0.1:8000", "token-12345678") == "200"
    assert call(app, "attacker.example:8000", "token-12345678") == "403"


def test_a_mounted_apps_capture_links_lead_to_the_capture(make_monitor) -> None:
    """Mounted at /perfmon, POST /perfmon/profile answered links to /profiles/<id>: a 404 on the user's app. Links
    start with the mount point (ASGI root_path, set by a real FastAPI mount; WSGI SCRIPT_NAME)."""
    import io

    fastapi = pytest.importorskip("fastapi")
    auth = [(b"authorization", b"Bearer token-12345678"), (b"host", b"127.0.0.1")]

    async def call(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        headers = [*auth, (b"content-type", b"application/json")] if body else auth
        await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                   "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                   "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)},
                  receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], json.loads(answer)

    mon = make_monitor(token="token-12345678")
    mon.wrap(torch.nn.Linear(2, 2), name="m")
    app = fastapi.FastAPI()
    app.mount("/perfmon", mon.asgi_app)
    status, made = asyncio.run(call(app, "POST", "/perfmon/profile", b'{"model": "m", "steps": 1}'))
    assert status == 202, made
    assert made["links"]["self"] == f"/perfmon/profiles/{made['id']}"
    status, got = asyncio.run(call(app, "GET", made["links"]["self"]))
    assert status == 200 and got["id"] == made["id"]

    other = make_monitor(token="token-12345678")
    other.wrap(torch.nn.Linear(2, 2), name="m")
    seen: list[str] = []
    environ = {"REQUEST_METHOD": "POST", "SCRIPT_NAME": "/ops/perfmon", "PATH_INFO": "/profile",
               "HTTP_HOST": "127.0.0.1", "HTTP_AUTHORIZATION": "Bearer token-12345678",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": "13", "wsgi.input": io.BytesIO(b'{"model":"m"}')}
    body = json.loads(b"".join(perfmon.make_wsgi_app(other)(environ, lambda status, headers: seen.append(status))))
    assert seen[0].startswith("202") and body["links"]["trace"] == f"/ops/perfmon/profiles/{body['id']}/trace"


def test_a_capture_in_flight_can_be_cancelled_and_a_new_one_armed_at_once(make_monitor) -> None:
    """A capture armed for a model nobody calls held the slot for capture_arm_timeout_seconds (60 s): every other
    capture was a 409 meanwhile, and `perfmon profile` timing out left it so. DELETE /profiles/{id} ends it: an armed
    one at once (outcome aborted, who asked in its error), a recording one at its thread's next call. An unknown
    id is a 404, one that has ended a 409; the token is needed as for every control route."""
    mon = make_monitor(port=0, token="token-12345678").start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    port = int(mon.url.rsplit(":", 1)[1])
    auth = {"Host": f"127.0.0.1:{port}", "Authorization": "Bearer token-12345678", "User-Agent": "perfmon-cli"}
    json_auth = {**auth, "Content-Type": "application/json"}
    status, armed = _control(port, "POST", "/profile", json_auth, b'{"model": "m", "steps": 2}')
    assert status == 202
    assert _control(port, "POST", "/profile", json_auth, b'{"model": "m"}')[0] == 409  # the slot is held
    assert _control(port, "DELETE", f"/profiles/{armed['id']}", {"Host": auth["Host"]})[0] == 401
    status, ended = _control(port, "DELETE", f"/profiles/{armed['id']}", auth)
    assert status == 200 and ended["outcome"] == "aborted" and "perfmon-cli" in ended["error"]
    assert mon.profile(armed["id"])["outcome"] == "aborted"
    status, again = _control(port, "DELETE", f"/profiles/{armed['id']}", auth)
    assert status == 409 and "ended" in again["error"]
    assert _control(port, "DELETE", f"/profiles/{'0' * 22}", auth)[0] == 404
    status, second = _control(port, "POST", "/profile", json_auth, b'{"model": "m", "steps": 50, "max_seconds": 30}')
    assert status == 202  # at once
    model(torch.ones(1, 2))  # starts recording
    assert mon.profile(second["id"])["status"] == "recording"
    status, ending = _control(port, "DELETE", f"/profiles/{second['id']}", auth)
    assert status == 202 and ending["status"] == "recording"
    done = wait_until(lambda: (m := mon.profile(second["id"])) and m.get("outcome") and m,
                      between=lambda: model(torch.ones(1, 2)), what="the cancelled recording to end")
    assert done["outcome"] == "aborted" and done["steps_recorded"] < 50 and "perfmon-cli" in (done["error"] or "")
    assert _control(port, "PUT", f"/profiles/{second['id']}", auth)[0] == 405
