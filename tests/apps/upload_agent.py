"""A serving process with trace_store set, driven line by line over stdin (tests/test_upload_s3.py).

Each line is a JSON command; each answer one JSON line on stdout:
``{"cmd": "capture"}`` takes a one-step capture and waits for its outcome; ``{"cmd": "serve", "seconds": s}``
calls the model in a loop and reports the count, the slowest call and the p99; ``{"cmd": "stats"}`` the
uploader's counters; ``{"cmd": "quit"}`` stops the monitor and exits. Settings come from PERFMON_* variables.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import perfmon


def main() -> None:
    monitor = perfmon.Monitor(port=None, regression=None, prepare_profiler=False, log_format="json",
                              log_level="error", trace_upload_timeout_seconds=2.0,
                              trace_upload_max_backoff_seconds=1.0).start()
    model = monitor.wrap(torch.nn.Linear(8, 8), name="encoder")
    x = torch.ones(2, 8)
    assert monitor.uploads is not None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "capture":
            cap = monitor.capture("encoder", steps=1)
            deadline = time.monotonic() + 60
            meta = None
            while time.monotonic() < deadline:
                with torch.inference_mode():
                    model(x)
                meta = monitor.profile(cap["id"])
                if meta is not None and meta.get("outcome"):
                    break
                time.sleep(0.02)
            out = {"id": cap["id"], "outcome": (meta or {}).get("outcome")}
        elif cmd["cmd"] == "serve":
            took: list[float] = []
            end = time.monotonic() + float(cmd["seconds"])
            while time.monotonic() < end:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model(x)
                took.append(time.perf_counter() - t0)
            took.sort()
            out = {"calls": len(took), "max_seconds": took[-1] if took else 0.0,
                   "p99_seconds": took[int(0.99 * (len(took) - 1))] if took else 0.0}
        elif cmd["cmd"] == "stats":
            s = monitor.uploads.stats
            out = {"uploads": s.uploads, "dropped": s.dropped, "spool_files": s.spool_files,
                   "uploaded": sorted(monitor.uploads._uploaded), "last_error": monitor.uploads.last_error}
        else:
            monitor.stop()
            print(json.dumps({"bye": True}), flush=True)
            return
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
