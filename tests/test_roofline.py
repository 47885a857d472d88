"""What bounds a capture: FLOPs against the analytic count, and roofline verdicts."""

from __future__ import annotations

import itertools

import pytest
import torch

from perfmon.captures.roofline import peaks_for

from .conftest import wait_capture


def _capture(mon, model, x, steps: int = 3) -> dict:
    cap = mon.capture("m", steps=steps)
    with torch.inference_mode():
        for _ in range(steps):
            model(x)
    meta = wait_capture(mon, cap["id"])
    assert meta["outcome"] == "ok", (meta.get("error"), meta)
    return meta


def test_linear_flops_match_the_analytic_count(make_monitor) -> None:
    """A capture of an MLP reports FLOPs within 5% of 2*M*K*N per Linear layer, per step."""
    mon = make_monitor()
    batch, dims = 64, (256, 512, 128)
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.ReLU(),
                                         torch.nn.Linear(dims[1], dims[2])), name="m")
    meta = _capture(mon, model, torch.randn(batch, dims[0]), steps=3)
    analytic = 3 * sum(2 * batch * k * n for k, n in itertools.pairwise(dims))
    assert meta["compute"]["flops"] == pytest.approx(analytic, rel=0.05)
    addmm = [op for op in meta["summary"] if op["name"] == "aten::addmm"]
    assert addmm and all(op["flops"] > 0 and op["achieved_flops_per_second"] > 0 for op in addmm)
    assert meta["compute"]["achieved_flops_per_second"] > 0
    # on CPU there is no peak to judge against, and perfmon says so rather than invent one
    assert meta["compute"]["peak_source"] == "unknown peak" and "mfu_ratio" not in meta["compute"]
    assert {op["bound"] for op in meta["summary"]} <= {"unknown peak", "launch-bound"}


class Elementwise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * 2.0 + 1.0)


def test_elementwise_ops_are_memory_bound_and_big_matmuls_compute_bound(make_monitor) -> None:
    """With peaks given (1 TFLOP/s, 100 GB/s), elementwise ops are memory-bound and a big matmul compute-bound."""
    mon = make_monitor(peak_flops=1e12, peak_bandwidth=1e11)
    model = mon.wrap(Elementwise(), name="m")
    meta = _capture(mon, model, torch.randn(1024, 1024), steps=2)
    verdicts = {op["name"]: op["bound"] for op in meta["summary"]}
    for op in ("aten::mul", "aten::add", "aten::sigmoid"):
        assert verdicts[op] == "memory-bound", (op, verdicts)
    mul = next(op for op in meta["summary"] if op["name"] == "aten::mul")
    assert mul["arithmetic_intensity"] == pytest.approx(0.25)  # one FLOP per 4-byte float read
    assert meta["compute"]["peak_source"].startswith("settings")

    mon2 = make_monitor(peak_flops=1e12, peak_bandwidth=1e11)
    mm = mon2.wrap(torch.nn.Linear(1024, 1024, bias=False), name="m")
    meta2 = _capture(mon2, mm, torch.randn(1024, 1024), steps=1)
    big = next(op for op in meta2["summary"] if op["name"] in ("aten::mm", "aten::matmul", "aten::addmm")
               and op["flops"])
    assert big["bound"] == "compute-bound" and big["arithmetic_intensity"] > 10


def test_peak_table_matches_gpu_names_and_settings_win() -> None:
    """Device names map to the most specific table entry; settings override; unknown devices get None."""
    assert peaks_for("NVIDIA H100 PCIe").bandwidth == 2.0e12
    assert peaks_for("NVIDIA H100 80GB HBM3").bandwidth == 3.35e12
    assert peaks_for("Tesla T4").flops_16bit == 65e12
    assert peaks_for("NVIDIA A100-SXM4-80GB").source.startswith("table: A100-SXM4-80GB")
    assert peaks_for("Some CPU") is None and peaks_for(None) is None
    custom = peaks_for("NVIDIA H100 PCIe", peak_flops=1e15, peak_bandwidth=1e12)
    assert custom.flops_32bit == 1e15 and custom.source.startswith("settings")
    assert peaks_for("NVIDIA H100 PCIe").flops(["c10::BFloat16"]) == 756e12
    assert peaks_for("NVIDIA H100 PCIe").flops(["float"]) == 51e12


class _Mixed(torch.nn.Module):
    """Every op torch counts FLOPs for (conv2d, mm, addmm, bmm, baddbmm, mul, add), a record_function and a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("block"):
            y = self.lin(x) * 2.0 + 1.0
        z = torch.bmm(y.view(2, 4, 16), y.view(2, 16, 4))
        return (torch.sigmoid(y).sum() + self.conv(img).sum() + torch.mm(y, y.t()).sum()
                + torch.baddbmm(z, z, z).sum() + torch.add(y, y).sum())


@pytest.mark.parametrize("with_stack", [False, True])
def test_trace_summary_matches_torch_function_events(tmp_path, with_stack: bool) -> None:
    """The child's summary from the Chrome trace has the rows, counts, FLOPs, bytes and times of prof.events()."""
    from perfmon.captures.profiler import torch_profiler
    from perfmon.captures.records import CaptureOptions
    from perfmon.captures.roofline import aggregate
    from perfmon.captures.trace_summary import summarise

    model = _Mixed()
    prof = torch_profiler(CaptureOptions(record_shapes=True, with_stack=with_stack), cuda=False)
    prof.start()
    for _ in range(3):
        model(torch.randn(8, 16), torch.randn(2, 3, 9, 9))
    prof.stop()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as f:
        got = {(r["name"], str(r["input_shapes"])): r for r in summarise(f.read)["rows"]}
    want = {(r["name"], str(r["input_shapes"])): r for r in aggregate(prof.events())}
    # Ops and annotations on both sides. With stacks, torch 2.11's FunctionEvents leave out the Python
    # builtins (``<built-in function any>``) that its trace holds; 2.13 lists them in both.
    ops = {k for k in got.keys() | want.keys() if k[0].startswith("aten::") or k[0] == "block"}
    assert {k for k in got if k in ops} == {k for k in want if k in ops}
    assert sum(r["flops"] for r in want.values()) > 0
    # torch 2.11's FunctionEvents carry no input dtypes (the trace does): compare them where they exist.
    with_dtypes = any(w["dtypes"] for w in want.values())
    for key in ops:
        g, w = got[key], want[key]
        assert (g["calls"], g["flops"]) == (w["calls"], w["flops"]), key
        if with_dtypes:
            assert (g["input_bytes_estimate"], g["dtypes"]) == (w["input_bytes_estimate"], w["dtypes"]), key
        if g["flops"]:  # the trace's own dtypes, whatever the FunctionEvents say
            assert set(g["dtypes"]) <= {"float", "double"} and g["dtypes"], key
            assert g["input_bytes_estimate"] or all(s == "[]" for s in g["input_shapes"]), key  # 0-dim: 0 bytes
        # (Python-function events, open at the window's edges, end differently: not compared. With stacks,
        # the trace nests Python builtins in the annotation, which torch 2.11's FunctionEvents leave out of
        # its self time; 2.13 agrees with the trace.)
        fields = ["cpu_time_total_seconds"]
        if not (with_stack and key[0] == "block"):
            fields.append("self_cpu_time_total_seconds")
        for field in fields:
            assert g[field] == pytest.approx(w[field], rel=1e-3, abs=1e-6), (key, field)


def test_trace_summary_gives_the_device_busy_span() -> None:
    """Kernels, copies and memsets bound the device span (first start to last end, seconds); a CPU trace has none.

    The exporter takes the longer of it and the host window for achieved FLOP/s and MFU: on a real H100
    the host window alone gave MFU 4.7 for back-to-back matmuls that the device ran after the host stopped.
    """
    import io
    import json

    from perfmon.captures.trace_summary import summarise

    host = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 10,
            "args": {"External id": 1}}
    device = [{"ph": "X", "cat": cat, "name": "k", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
               "args": {"External id": 1}}
              for cat, ts, dur in (("kernel", 5, 1000), ("gpu_memcpy", 2000, 500), ("gpu_memset", 1500, 10))]
    trace = json.dumps({"traceEvents": [host, *device]}).encode()
    got = summarise(io.BytesIO(trace).read)
    assert got["device_span_seconds"] == pytest.approx((2500 - 5) / 1e6)
    assert got["rows"][0]["self_device_time_total_seconds"] == pytest.approx(1510 / 1e6)
    cpu_only = summarise(io.BytesIO(json.dumps({"traceEvents": [host]}).encode()).read)
    assert cpu_only["device_span_seconds"] is None


def test_a_quote_in_an_annotation_name_does_not_break_the_trace(tmp_path) -> None:
    """torch writes ``record_function('a "b"')`` unescaped into the Chrome trace (invalid JSON). The exporter
    escapes it: the summary has the annotation and the gzipped trace it stores is valid JSON."""
    import gzip
    import io
    import json

    from perfmon.captures.profiler import torch_profiler
    from perfmon.captures.records import CaptureOptions
    from perfmon.captures.trace_summary import summarise

    prof = torch_profiler(CaptureOptions(record_shapes=True), cuda=False)
    prof.start()
    with torch.autograd.profiler.record_function('my "quoted" op'):
        torch.randn(8, 8).sum()
    prof.stop()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    raw = path.read_bytes()
    if b'"my "quoted" op"' not in raw:
        pytest.skip("this torch escapes quotes in trace names")  # nothing to repair
    with pytest.raises(ValueError):
        json.loads(raw)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz, open(path, "rb") as f:
        got = summarise(f.read, gz.write)
    assert any(r["name"] == 'my "quoted" op' for r in got["rows"])
    names = {e.get("name") for e in json.loads(gzip.decompress(buf.getvalue()))["traceEvents"]}
    assert 'my "quoted" op' in names and "aten::sum" in names


@pytest.mark.parametrize("trace, names, unchanged", [
    # torch 2.13's layout: a field a line
    (b'{"traceEvents": [\n  {\n    "ph": "X", "cat": "user_annotation",\n    "name": "my "quoted" op",\n'
     b'    "pid": 1, "tid": 1\n  }\n]}\n', ['my "quoted" op'], False),
    # several fields a line, a valid name after the broken one, a "name" inside args
    (b'{"traceEvents": [\n  {"ph": "X", "name": "a "b" c", "pid": 1, "tid": 1},\n'
     b'  {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "args": {"name": "x"}}\n]}\n',
     ['a "b" c', "aten::mm"], False),
    # valid traces pass through byte for byte, escaped quotes included
    (b'{"traceEvents": [\n  {"name": "ok \\"esc\\" one", "ph": "X", "cat": "cpu_op", "pid": 1}\n]}\n',
     ['ok "esc" one'], True),
    (b'{"traceEvents": [{"ph": "X", "name": "aten::add", "cat": "cpu_op"}]}', ["aten::add"], True),
])
def test_the_trace_repair_escapes_bare_quotes_in_names_only(trace: bytes, names: list, unchanged: bool) -> None:
    """``repairing`` (the exporter's reader) makes torch's unescaped names valid JSON in either layout and
    leaves every valid trace exactly as it was."""
    import io
    import json

    from perfmon.captures.trace_summary import repairing

    read = repairing(io.BytesIO(trace).read)
    out = b"".join(iter(lambda: read(1 << 20), b""))
    assert [e.get("name") for e in json.loads(out)["traceEvents"]] == names
    assert (out == trace) is unchanged


@pytest.mark.parametrize("name", ['x"}', '{"k": "v"}', 'a "b" c', '"', 'end"'])
def test_names_with_quotes_and_braces_are_repaired_in_both_layouts(name: str) -> None:
    """Names an attacker (or an unlucky user) can give ``record_function``: the repaired trace holds them intact."""
    import io
    import json

    from perfmon.captures.trace_summary import repairing

    raw = name.encode()
    for trace in (b'{"traceEvents": [\n  {\n    "ph": "X",\n    "name": "' + raw + b'",\n    "pid": 1\n  },\n'
                  b'  {\n    "ph": "X",\n    "name": "aten::mm",\n    "pid": 1\n  }\n]}\n',
                  b'{"traceEvents": [\n  {"ph": "X", "name": "' + raw + b'", "pid": 1},'
                  b' {"ph": "X", "name": "aten::mm", "pid": 1}\n]}\n'):
        read = repairing(io.BytesIO(trace).read)
        out = b"".join(iter(lambda read=read: read(1 << 20), b""))
        assert [e["name"] for e in json.loads(out)["traceEvents"]] == [name, "aten::mm"]
