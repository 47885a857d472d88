"""`perfmon profile`, `profiles` and `diff` as a new user meets them: piped into `head`, `--out` naming a directory,
a capture left armed by a timeout or Ctrl-C, an op table with one row per input shape, steps recorded vs used."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from .conftest import wait_until
from .test_cli_hostile import TRACE, A, Agent, B, Reply, _json, assert_one_error_line, meta, profile_routes, run

ROOT = Path(__file__).resolve().parents[1]


def _perfmon(*argv: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m perfmon argv...`` in a child, stdout and stderr pipes."""
    return subprocess.Popen([sys.executable, "-m", "perfmon", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- a reader that closes stdout early (| head) ----------------------------------------------------------

def _many_captures(n: int) -> dict[str, Any]:
    return {"profiles": [{**meta(f"{i:022x}"), "summary": None, "ops": None} for i in range(n)]}


@pytest.mark.parametrize("command", ["profiles", "profile", "diff"])
def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(command: str, tmp_path: Path) -> None:
    """`perfmon ... | head -3`: when the reader closes the pipe the command exits 141 (a shell's status for a writer
    SIGPIPE killed) with nothing on stderr — no BrokenPipeError traceback, no "Exception ignored" at exit."""
    closed = threading.Event()
    routes: dict[tuple[str, str], Reply] = {
        **profile_routes(meta()), ("GET", "/profiles"): _json(_many_captures(3000)),  # ~600 KiB: past a pipe's buffer
        ("GET", f"/profiles/{B}"): _json(meta(B))}

    def answer(method: str, path: str) -> Reply:
        if command != "profiles":
            closed.wait(30)  # the first line is printed after this answer: the pipe is closed by then
        return routes.get((method, path), (404, [], b'{"error": "no"}'))

    with Agent(handler=answer) as agent:
        argv = {"profiles": ["profiles", "--url", agent.url], "profile": ["profile", "--url", agent.url],
                "diff": ["diff", "--url", agent.url, A, B]}[command]
        with _perfmon(*argv, cwd=tmp_path) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            if command == "profiles":
                for _ in range(3):
                    proc.stdout.readline()
            proc.stdout.close()
            closed.set()
            rc = proc.wait(timeout=60)
            err = proc.stderr.read()
    assert rc == 141 and err == "", (rc, err)


def test_a_closed_pipe_in_process_is_exit_141_too(capsys: Any) -> None:
    """`main()` called in a process (a test, a tool) whose stdout is no file descriptor: still 141, no traceback."""
    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    with Agent({("GET", "/profiles"): _json(_many_captures(2))}) as agent:
        saved, sys.stdout = sys.stdout, Closed()  # type: ignore[assignment]
        try:
            from perfmon.cli import main

            rc = main(["profiles", "--url", agent.url])
        finally:
            sys.stdout = saved
    assert rc == 141 and capsys.readouterr().err == ""


# -- profile --out: a directory or a file ----------------------------------------------------------------

def test_profile_out_takes_a_directory_or_a_file(tmp_path: Path, capsys: Any) -> None:
    """`profile --out DIR` writes DIR/<the trace's name> and prints that path, as `profiles --download --out DIR`
    does (it was refused: "is a directory", exit 2); `--out DIR/name.gz` still writes exactly that file."""
    (tmp_path / "traces").mkdir()
    with Agent(profile_routes(meta())) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "traces"))
        assert rc == 0, err
        target = tmp_path / "traces" / "h_1.1.pt.trace.json.gz"
        assert target.read_bytes() == TRACE and f"trace: {target} (" in out
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "mine.gz"))
    assert rc == 0, err
    assert (tmp_path / "mine.gz").read_bytes() == TRACE and sorted(os.listdir(tmp_path)) == ["mine.gz", "traces"]


def test_profile_help_says_out_takes_a_directory(capsys: Any) -> None:
    """`perfmon profile --help` says --out takes a directory (the trace under its own name) or a file."""
    with pytest.raises(SystemExit):
        run(capsys, "profile", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "a directory to write the trace into under its own name" in text and "or the file to write" in text


# -- a capture the CLI stopped waiting for ---------------------------------------------------------------

def _stuck(status: str) -> dict[tuple[str, str], Reply]:
    """An agent whose capture A never finishes: it stays in ``status``."""
    return {("POST", "/profile"): _json({"id": A}),
            ("GET", f"/profiles/{A}"): _json({**meta(), "status": status, "outcome": None, "steps_recorded": 0})}


def test_a_timed_out_profile_says_until_when_its_capture_stays_armed(capsys: Any) -> None:
    """A `profile` that runs out its --timeout with the capture still armed says that the capture stays armed on the
    agent, refusing other captures (409), about how long (the default capture_arm_timeout_seconds from arming), and
    how to fetch it later, when the agent has no route to cancel it (an older agent)."""
    with Agent(_stuck("armed")) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--timeout", "1")
    assert_one_error_line(rc, err)
    assert "did not finish in time" in err and "stays armed on the agent" in err and "409" in err
    found = re.search(r"in about (\d+) s, with the default 60 s", err)
    assert found and 55 <= int(found.group(1)) <= 60, err
    assert f"perfmon profiles --url {agent.url} --download {A}" in err


def test_a_timed_out_profile_cancels_its_armed_capture(capsys: Any) -> None:
    """An agent with DELETE /profiles/{id}: the CLI takes back the capture it stopped waiting for, so the slot is
    free for the next capture at once (it stayed armed, refusing others with a 409, for up to 60 s)."""
    routes = {**_stuck("armed"),
              ("DELETE", f"/profiles/{A}"): _json({**meta(), "status": "done", "outcome": "aborted",
                                                   "error": "cancelled by http (perfmon-cli)"})}
    with Agent(routes) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--timeout", "1")
    assert_one_error_line(rc, err)
    assert "did not finish in time" in err and "was cancelled on the agent" in err and "409" not in err


def test_a_timed_out_profile_that_is_recording_says_it_ends_on_its_own(capsys: Any) -> None:
    """Timed out while the capture records: it ends on its own (no word of arming), and can be fetched later."""
    with Agent(_stuck("recording")) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--timeout", "1")
    assert_one_error_line(rc, err)
    assert "it is recording on the agent and ends on its own" in err and "armed" not in err.split(";", 1)[1]


def test_ctrl_c_while_profile_waits_is_exit_130_saying_the_capture_stays_armed(tmp_path: Path) -> None:
    """SIGINT while `profile` waits: exit 130, one line saying the capture stays armed and how to fetch it (it was a
    KeyboardInterrupt traceback)."""
    with Agent(_stuck("armed")) as agent, _perfmon("profile", "--url", agent.url, cwd=tmp_path) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert "armed; waiting" in proc.stdout.readline()
        # In its wait loop once it has asked for the capture's state (SIGINT before would end argparse's set-up).
        wait_until(lambda: any(m == "GET" and p == f"/profiles/{A}" for m, p, _ in agent.requests),
                   what="the CLI polling the capture")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    assert rc == 130, err
    assert err.startswith("perfmon: interrupted: ") and err.count("\n") == 1 and "stays armed" in err, err
    assert "Traceback" not in err


# -- the op table's rows per input shape; steps recorded vs used -----------------------------------------

def _row(shapes: list[str] | None, ms: float, calls: int) -> dict[str, Any]:
    return {"name": "aten::mm", "calls": calls, "self_cpu_time_total_seconds": ms / 1e3,
            "self_device_time_total_seconds": 0.0, "cpu_time_total_seconds": ms / 1e3, "flops": 0,
            "achieved_flops_per_second": None, "bound": "compute", "input_shapes": shapes}


def test_profile_op_table_shows_each_rows_input_shapes_and_the_steps_used(tmp_path: Path, capsys: Any) -> None:
    """The op table holds a row per (op, input shapes): with shapes it has an input-shapes column telling the
    aten::mm rows apart (they were three identical names), and it says its totals span the 5 steps recorded while the
    per-step figures use 4 (the warm-up step left out), as `diff` does."""
    summary = [_row(["[16, 32]", "[32, 64]"], 3.0, 2), _row(["[8, 32]", "[32, 64]"], 2.0, 2),
               _row(["[8, 48]", "[48, 64]"], 1.0, 1)]
    with Agent(profile_routes(meta(summary=summary, steps=4))) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path))
    assert rc == 0, err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert lines[head].endswith("input shapes")
    assert [line.split("  ")[-1].strip() for line in lines[head + 1: head + 4]] == [
        "[16, 32], [32, 64]", "[8, 32], [32, 64]", "[8, 48], [48, 64]"]
    assert lines[head - 1] == ("top ops: totals over the 5 steps recorded; per-step figures (diff, vs baseline) use "
                               "4: the first step, the profiler's warm-up, is left out")


def test_profile_op_table_without_shapes_has_no_shape_column(tmp_path: Path, capsys: Any) -> None:
    """A capture taken with record_shapes off has no shapes: no empty column; malformed shapes are one error line."""
    with Agent(profile_routes(meta(summary=[_row(None, 1.0, 5)], steps=4))) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path))
    assert rc == 0, err
    assert "input shapes" not in out and "steps recorded; per-step figures" in out
    for bad in ({"x": 1}, [1, 2], "[1, 2]"):
        with Agent(profile_routes(meta(summary=[_row(bad, 1.0, 5)]))) as agent:  # type: ignore[arg-type]
            rc, _, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "x.gz"))
        assert_one_error_line(rc, err)
        assert "summary[0].input_shapes is malformed" in err and not (tmp_path / "x.gz").exists()


def test_profiles_lists_steps_used_of_recorded_as_diff_counts_them(capsys: Any) -> None:
    """`perfmon profiles` shows used/recorded steps (4/5 for a finished 5-step capture, -/3 for one recording), where it
    showed 5 while the capture's metadata and `diff` said 4; `diff` names both counts too."""
    listing = {"profiles": [{**meta(), "steps": 4, "summary": None, "ops": None},
                            {**meta(B), "status": "recording", "outcome": None, "steps_recorded": 3, "steps": 0}]}
    routes = {("GET", "/profiles"): _json(listing), ("GET", f"/profiles/{A}"): _json(meta(steps=4)),
              ("GET", f"/profiles/{B}"): _json(meta(B, steps=4))}
    with Agent(routes) as agent:
        rc, out, err = run(capsys, "profiles", "--url", agent.url)
        assert rc == 0, err
        header, done, recording = out.splitlines()
        assert "used/recorded" in header and done.split()[5] == "4/5" and recording.split()[5] == "-/3"
        rc, out, err = run(capsys, "diff", "--url", agent.url, A, B)
    assert rc == 0, err
    assert out.splitlines()[0].startswith(f"{A} (manual, steps used/recorded 4/5) -> {B} (manual, 4/5)")
