"""Live efficiency at its edges: inputs and models whose count would be wrong or costly; unknown, with the reason."""

from __future__ import annotations

from typing import Any

import torch

import perfmon

from .conftest import wait_until


def _settled(mon: perfmon.Monitor, model: str) -> dict[str, Any]:
    """Resolve the samples, then wait until the model's signature is counted or known to be uncountable."""
    mon.flush()
    return wait_until(lambda: (e := mon.stats()["models"][model]["efficiency"]).get("samples")
                      and not any(w.startswith("not counted yet") for w in e["unknown"]) and e,
                      what=f"{model}'s signature to be counted or refused")


class _SumOfLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, parts: dict[Any, torch.Tensor]) -> torch.Tensor:
        return sum((self.lin(v).sum() for v in parts.values()), torch.zeros(()))


def test_a_dict_with_a_key_that_cannot_be_described_is_unknown_not_undercounted(make_monitor) -> None:
    """A dict argument with a tuple key is unknown ("a dict key of type tuple"): dropping that entry would count a
    call with fewer tensors than the real one."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, stats_window_seconds=3600)
    model = mon.wrap(_SumOfLinears(), name="parts")
    parts = {("a", 1): torch.randn(2, 8), "b": torch.randn(4, 8)}
    with torch.no_grad():
        for _ in range(3):
            model(parts)
    eff = _settled(mon, "parts")
    assert eff["flops_per_call"] is None and eff["counted_samples"] == 0, eff
    assert any(w == "a dict key of type tuple" for w in eff["unknown"]), eff


class _WithTable(torch.nn.Module):
    """A model holding data that is not a tensor (a lookup table as bytes): deepcopy would copy it for real."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.table = {"rows": bytearray(nbytes)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_model_holding_much_non_tensor_data_is_not_copied(make_monitor) -> None:
    """A model holding more than MAX_COPIED_BYTES of non-tensor data is unknown with the reason, not deep-copied
    (the copy would hold that memory for as long as the model lives); one holding less is counted."""
    from perfmon.agent.flopcount import MAX_COPIED_BYTES

    # Started: torch's fake-tensor imports happen in start(), not in the first count (whose time the share charges).
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, stats_window_seconds=3600).start()
    models = {"big": mon.wrap(_WithTable(MAX_COPIED_BYTES + 1), name="big"),
              "small": mon.wrap(_WithTable(1024), name="small")}
    with torch.no_grad():
        for model in models.values():
            for _ in range(3):
                model(torch.ones(2, 8))
    big, small = _settled(mon, "big"), _settled(mon, "small")
    assert big["flops_per_call"] is None and any("of data that is not a tensor" in w for w in big["unknown"]), big
    assert small["flops_per_call"] == 2 * 2 * 8 * 8, small
    assert mon.stats()["flop_counting"]["counts"]["skipped"] == 1


class _ManyParameters(torch.nn.Module):
    """Thousands of parameters (a copy costs ~0.5 ms each), one of them used."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(4)) for _ in range(4000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table[0]


def test_the_timeout_cuts_the_copy_too(make_monitor) -> None:
    """flop_count_timeout_seconds bounds making the fake copy (seconds holding the GIL for a model of thousands of
    parameters), not only the fake forward: the count times out, its signature unknown with the reason."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, stats_window_seconds=3600, flop_count_timeout_seconds=0.05)
    model = mon.wrap(_ManyParameters(), name="many")
    with torch.no_grad():
        for _ in range(3):
            model(torch.ones(4))
    eff = _settled(mon, "many")
    assert any(w.startswith("counting took longer than 0.05 s") for w in eff["unknown"]), eff
    assert mon.stats()["flop_counting"]["counts"]["timeout"] == 1


_EXIT_DURING_A_COUNT = """
import sys, threading, torch, perfmon
from prometheus_client import CollectorRegistry

COUNTING = threading.Event()

class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if type(x).__name__ == "FakeTensor":  # the copy's forward, on the counting thread
            COUNTING.set()
        for _ in range(200_000):
            x = self.lin(x)
        return x

mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), sample_rate=1.0, warmup_calls=0, regression=None,
                      prepare_profiler=False, log_level="error", trace_dir=sys.argv[1],
                      flop_count_timeout_seconds=600).start()
model = mon.wrap(Slow(), name="slow")
with torch.no_grad():
    model(torch.ones(1, 8))
    model(torch.ones(1, 8))
mon.flush()
assert COUNTING.wait(60), "the count never started"
sys.exit(0)  # the interpreter exits while the count runs
"""


def test_the_interpreter_exits_cleanly_during_a_count(tmp_path) -> None:
    """A process that exits while a fake forward is being counted ends with its own status, promptly: the count is
    abandoned at exit (a daemon thread killed inside torch's C++ aborted the process: SIGABRT)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_COUNT, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


_EXIT_WHILE_THE_COUNTER_WAITS = """
import sys, tempfile, threading
import torch, transformers
from prometheus_client import CollectorRegistry
import perfmon

transformers.logging.set_verbosity_error()
mon = perfmon.Monitor(port=None, log_level="error", registry=CollectorRegistry(), trace_dir=tempfile.mkdtemp(),
                      sample_rate=1.0, warmup_calls=0)  # never started: no stop() at exit
cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
model = mon.wrap(transformers.GPT2LMHeadModel(cfg).eval(), name="gpt2")
with torch.inference_mode():
    for n in (4, 5, 6):  # three prompt lengths: the first count spends the time budget, the others wait for it
        for _ in range(2):
            model.generate(torch.randint(2, 100, (1, n)), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           pad_token_id=0)
        mon.flush()
print("alive" if any(t.name == "perfmon-flops" for t in threading.enumerate()) else "ended")
"""


def test_the_interpreter_exits_cleanly_while_the_counter_waits_on_a_monitor_never_started() -> None:
    """A monitor that was never started (so nothing stops it at exit) whose flush() had signatures counted: the
    counting thread, waiting out its time budget when the script ends, is stopped at exit. It used to be left
    alive into the interpreter's finalization, and the process died with SIGABRT after a clean run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _EXIT_WHILE_THE_COUNTER_WAITS],
                          capture_output=True, text=True, timeout=180)
    assert done.stdout.strip() == "alive", (done.stdout, done.stderr[-2000:])  # the case under test happened
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


_IMPORTS_ON_WHICH_THREAD = """
import sys, tempfile, threading
import torch
from prometheus_client import CollectorRegistry
import perfmon

assert "torch._dynamo" not in sys.modules, "imported before the test could see by whom"


class Watch:  # records the thread that imports torch._dynamo first; finds nothing itself
    seen = []

    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and not self.seen:
            self.seen.append(threading.current_thread().name)
        return None


sys.meta_path.insert(0, Watch())
mon = perfmon.Monitor(port=None, log_level="error", registry=CollectorRegistry(), trace_dir=tempfile.mkdtemp(),
                      sample_rate=1.0, warmup_calls=0, regression=None, prepare_profiler=False)  # never started
model = mon.wrap(torch.nn.Linear(8, 8), name="lin")
with torch.no_grad():
    model(torch.ones(2, 8))
    model(torch.ones(2, 8))
mon.flush()  # resolves the steady sample: its signature is submitted for counting
print(Watch.seen[0] if Watch.seen else "nobody")
"""


def test_a_monitor_never_started_imports_for_its_counts_on_the_flushing_thread() -> None:
    """A monitor never started has no Monitor.start() to import torch's fake-tensor machinery; the flush() that submits
    its first signature does, on the caller's thread, not the counting thread (where the ~1 s import raced the
    caller's own imports and ran on into the next thing it timed: a lent H200 read a 1 ms kernel 20% long)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _IMPORTS_ON_WHICH_THREAD], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "MainThread", (done.stdout, done.stderr[-2000:])


def test_a_series_whose_figures_fail_is_left_out_of_the_scrape_and_counted() -> None:
    """The efficiency collector fails soft: a series whose figures raise (here its device's peak lookup) is left out,
    the fault is counted under stage "efficiency", and the scrape still carries the counting families."""
    from time import perf_counter_ns

    from prometheus_client import CollectorRegistry, generate_latest

    from perfmon.agent.flopcount import FlopCounter
    from perfmon.agent.records import Sample
    from perfmon.faults import InternalErrors
    from perfmon.metrics.efficiency import EfficiencyCollector
    from perfmon.stats.efficiency import Efficiency

    def broken_peaks(device: str) -> None:
        raise RuntimeError(f"no table for {device}")

    eff = Efficiency(FlopCounter(per_minute=1, timeout_seconds=1.0), window_seconds=60.0, peaks=broken_peaks,
                     state_of=lambda model, stage: None)
    eff.observe([Sample("m", "cuda:0", "steady", 0, 0.001, 0.001, perf_counter_ns())])
    internal = InternalErrors()
    registry = CollectorRegistry()
    registry.register(EfficiencyCollector(eff, internal))
    text = generate_latest(registry).decode()
    assert 'perfmon_flop_counts_total{outcome="ok"} 0.0' in text
    assert "perfmon_model_flops_unknown_ratio{" not in text  # the failing series is left out, not half-written
    assert dict(internal.counts()) == {"efficiency": 1}
