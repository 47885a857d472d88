"""Who may use the control API: loopback and Host/Origin checks, the token, and throttling bad credentials.

``/metrics``, ``/healthz`` and ``/stats`` are open. The control and trace routes (``/profile``,
``/profiles...``) need ``Authorization: Bearer <token>`` when a token is set; with no token they are
served only by the agent's own server bound to a loopback address, to a peer connecting from a loopback
address, with the ``X-Perfmon`` header (``authorize``). ``AuthThrottle`` refuses addresses that keep
failing, before the agent's server routes anything of theirs.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import time
from collections.abc import Mapping

from ..config import Config
from .wire import Response

__all__ = ["CONTROL_HEADER", "AuthThrottle", "authorize", "host_names_agent", "is_loopback", "owner_without_token"]

#: Sent by perfmon's own clients (the CLI, the status page) on every control and trace request when no
#: token is set: a cross-site page cannot send it without a CORS preflight, which the agent never grants.
CONTROL_HEADER = "X-Perfmon"


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``text`` spells (brackets, an IPv6 zone and IPv4-mapped IPv6 unwrapped), else None."""
    if not text:
        return None
    try:
        addr = ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_loopback(address: str | None) -> bool:
    """True for a configured host that is loopback: an IP address on the loopback network, or the name
    ``localhost`` itself; any other name (``localhost.corp.example``, ``127.example.com``) is never."""
    return address == "localhost" or _loopback_ip(address)


def _loopback_ip(address: str | None) -> bool:
    """True only for an IP address on the loopback network; a name, ``localhost`` included, is never."""
    addr = _ip(address)
    return addr is not None and addr.is_loopback


def owner_without_token(bound: str | None, peer: str | None) -> bool:
    """Whether a request may use the control API with no token: the socket is bound to a loopback address
    and the peer connected from one (addresses as the sockets report them, never the configured string:
    a name, even ``localhost``, never counts here)."""
    return _loopback_ip(bound) and _loopback_ip(peer)


def host_names_agent(host: str, bound: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a ``Host`` header value names this agent (what stops DNS rebinding).

    Accepted: ``localhost``, a loopback address, the bound address, any IP address when bound to all
    addresses (or when mounted: the bound address is the host server's), and the ``allowed_hosts``
    names. A rebinding attack needs a DNS name of the attacker's, which none of these is.
    """
    name = host.strip().lower()
    if "@" in name:  # user info is no part of a host ("localhost:1@evil.example" names evil.example)
        return False
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if not name:
        return False
    if "*" in allowed or name in {a.lower().rstrip(".") for a in allowed} or name == "localhost":
        return True
    addr = _ip(name)
    if addr is None:
        return False
    bound_addr = _ip(bound)
    return addr.is_loopback or bound_addr is None or bound_addr.is_unspecified or addr == bound_addr


def authorize(config: Config, headers: Mapping[str, str], peer: str | None, *, bound: str | None,
              mounted: bool) -> Response | None:
    """None when a control or trace request may go on, else the 401/403 answer (see the module docstring).

    Either way a ``Host`` must name the agent and an ``Origin`` must be the agent's own: a web page in a
    browser on the machine can neither rebind a name to the agent nor send a request cross-site.
    """
    token = config.token
    if token is None and mounted:
        return _forbidden("control API disabled", "the agent is mounted in another server and no token is set; "
                          "set PERFMON_TOKEN (or token=) and send 'Authorization: Bearer <token>'")
    host = headers.get("host")
    if host is not None and not host_names_agent(host, bound, config.allowed_hosts):
        return _forbidden("forbidden Host", f"Host {host[:100]!r} does not name this agent; use its address or "
                          "localhost, or add the name to allowed_hosts (PERFMON_ALLOWED_HOSTS)")
    origin = headers.get("origin")
    if origin is not None and (host is None or origin.lower().partition("://")[2] != host.lower()
                               or not origin.lower().startswith(("http://", "https://"))):
        return _forbidden("cross-origin request refused",
                          f"Origin {origin[:100]!r} is not this agent's own origin")
    if token is None:
        if not owner_without_token(bound, peer):
            where = (f"listening on {config.host}" if not _loopback_ip(bound)
                     else f"asked from {peer or 'an unknown address'}, not loopback")
            return _forbidden("control API disabled",
                              f"the agent is {where} and no token is set; set PERFMON_TOKEN (or token=) and "
                              "send 'Authorization: Bearer <token>'")
        if not headers.get(CONTROL_HEADER.lower()):
            return _forbidden(f"missing {CONTROL_HEADER} header",
                              f"send '{CONTROL_HEADER}: 1' (perfmon's CLI and status page do): a request without "
                              "it could come from a web page in a browser on this machine")
        return None
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    # Constant-time comparison: the response time must not reveal how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), token.encode()):
        return Response.json(401, {"error": "unauthorized", "detail": "send 'Authorization: Bearer <token>'"},
                             [("WWW-Authenticate", 'Bearer realm="perfmon"')])
    return None


def _forbidden(error: str, detail: str) -> Response:
    return Response.json(403, {"error": error, "detail": detail})


class AuthThrottle:
    """Refuse addresses that keep sending bad credentials, before their requests are routed.

    A client over ``limit`` failed authentications within one second is refused (429) for
    ``block_seconds``. Scrapes and health checks from a blocked address still go through; a right token does not
    (its request is refused before its credential is compared: comparing it would answer every guess), so a flood
    from an address the operator shares (a NAT, ``kubectl port-forward``'s 127.0.0.1) locks the operator out while
    it lasts (docs/reliability.md).
    """

    def __init__(self, limit: int = 20, block_seconds: float = 1.0) -> None:
        self.limit = limit
        self.block = block_seconds
        self._failures: dict[str, collections.deque[float]] = {}
        self._blocked: dict[str, float] = {}

    def failed(self, address: str) -> None:
        now = time.monotonic()
        if len(self._failures) > 4096 and address not in self._failures:
            self._failures.clear()  # bounded: many distinct addresses just reset the window
        q = self._failures.setdefault(address, collections.deque())
        q.append(now)
        while q and now - q[0] > 1.0:
            q.popleft()
        if len(q) > self.limit:
            if len(self._blocked) > 4096:  # bounded: forget blocks that have expired
                self._blocked = {a: t for a, t in self._blocked.items() if t > now}
            self._blocked[address] = now + self.block
            q.clear()

    def blocked(self, address: str) -> bool:
        until = self._blocked.get(address)
        if until is None:
            return False
        if time.monotonic() >= until:
            self._blocked.pop(address, None)
            return False
        return True
