"""The control API's client side: what ``perfmon profile`` and ``perfmon profiles`` do."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

__all__ = ["ControlError", "list_profiles", "run_profile"]


class ControlError(Exception):
    """The agent refused or could not be reached; the message says why."""


def _request(url: str, *, token: str | None, method: str = "GET", payload: Any = None,
             timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"User-Agent": "perfmon-cli", "Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            detail = json.loads(body)
        except ValueError:
            detail = {"error": body[:200].decode(errors="replace")}
        msg = detail.get("error", "") + (f" ({detail['detail']})" if detail.get("detail") else "")
        raise ControlError(f"{method} {url}: HTTP {e.code}: {msg}") from None
    except OSError as e:
        raise ControlError(f"{method} {url}: {e}") from None


def run_profile(url: str, *, token: str | None, model: str | None = None, steps: int | None = None,
                max_seconds: float | None = None, out: str | None = None, timeout: float = 120.0,
                stdout: TextIO = sys.stdout) -> int:
    """Trigger a capture, wait for it, download its trace and print the top ops."""
    base = url.rstrip("/")
    payload = {k: v for k, v in (("model", model), ("steps", steps), ("max_seconds", max_seconds)) if v is not None}
    _, _, body = _request(f"{base}/profile", token=token, method="POST", payload=payload)
    cap_id = json.loads(body)["id"]
    print(f"capture {cap_id} armed; waiting for the model's next calls...", file=stdout, flush=True)
    deadline = time.monotonic() + timeout
    meta: dict[str, Any] = {}
    last = None
    while time.monotonic() < deadline:
        _, _, body = _request(f"{base}/profiles/{cap_id}", token=token)
        meta = json.loads(body)
        if meta.get("status") != last:
            last = meta.get("status")
            print(f"  {last} (steps recorded: {meta.get('steps_recorded', 0)})", file=stdout, flush=True)
        if meta.get("outcome"):
            break
        time.sleep(0.2)
    else:
        raise ControlError(f"capture {cap_id} did not finish within {timeout:g} s (status {meta.get('status')})")
    if meta["outcome"] == "failed":
        raise ControlError(f"capture {cap_id} failed: {meta.get('error')}")
    _, _, trace = _request(f"{base}/profiles/{cap_id}/trace", token=token, timeout=timeout)
    name = meta.get("trace_file") or f"{cap_id}.pt.trace.json.gz"
    target = Path(out) if out else Path(name)
    target.write_bytes(trace)
    print(f"trace: {target} ({len(trace)} bytes; open in https://ui.perfetto.dev or TensorBoard)", file=stdout)
    _print_ops(meta.get("summary") or [], stdout)
    compute = meta.get("compute") or {}
    if compute.get("achieved_flops_per_second"):
        mfu = f", MFU {compute['mfu_ratio']:.1%}" if compute.get("mfu_ratio") is not None else ""
        print(f"\nwindow: {compute['achieved_flops_per_second'] / 1e9:.2f} GFLOP/s achieved{mfu} "
              f"(peak: {compute.get('peak_source')})", file=stdout)
    return 0


def _print_ops(ops: list[dict[str, Any]], stdout: TextIO) -> None:
    if not ops:
        return
    device = any(op.get("self_device_time_total_seconds") for op in ops)
    key = "self_device_time_total_seconds" if device else "self_cpu_time_total_seconds"
    print(f"\n{'op':<34} {'calls':>6} {'self ' + ('device' if device else 'CPU') + ' ms':>13} {'total CPU ms':>12} "
          f"{'GFLOP':>8} {'GFLOP/s':>8}  bound", file=stdout)
    for op in ops[:15]:
        rate = op.get("achieved_flops_per_second")
        cpu_ms = op["cpu_time_total_seconds"] * 1e3
        print(f"{op['name'][:34]:<34} {op['calls']:>6} {op[key] * 1e3:>13.3f} {cpu_ms:>12.3f} "
              f"{(op.get('flops') or 0) / 1e9:>8.3f} {'-' if rate is None else f'{rate / 1e9:.1f}':>8}  "
              f"{op.get('bound') or '-'}", file=stdout)


def list_profiles(url: str, *, token: str | None, timeout: float = 30.0, stdout: TextIO = sys.stdout) -> int:
    """Print the agent's captures, newest first."""
    _, _, body = _request(f"{url.rstrip('/')}/profiles", token=token, timeout=timeout)
    profiles = json.loads(body)["profiles"]
    if not profiles:
        print("no captures", file=stdout)
        return 0
    print(f"{'id':<24} {'model':<16} {'trigger':<11} {'status':<10} {'outcome':<8} {'steps':>5}  armed at", file=stdout)
    for p in profiles:
        print(f"{p['id']:<24} {p['model'][:16]:<16} {p['trigger']:<11} {p['status']:<10} {p.get('outcome') or '-':<8} "
              f"{p.get('steps_recorded', 0):>5}  {p.get('armed_at', '')}", file=stdout)
    return 0
