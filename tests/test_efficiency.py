"""Live efficiency: each signature's FLOPs and bytes counted once off the request thread, over sampled time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import perfmon

from .conftest import cache_key, value, wait_until


def _timed_calls(model: Any, x: torch.Tensor, n: int) -> list[float]:
    """Call ``model(x)`` ``n`` times, each timed by the test's own clock (seconds)."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            t0 = time.perf_counter()
            model(x)
            out.append(time.perf_counter() - t0)
    return out


def _efficiency(mon: perfmon.Monitor, model: str, stage: str | None = None) -> dict[str, Any]:
    m = mon.stats()["models"][model]
    return (m["stages"][stage] if stage else m)["efficiency"]


def _counted(mon: perfmon.Monitor, model: str, stage: str | None = None) -> dict[str, Any]:
    """Resolve the samples, then wait for the counting thread to count their signature."""
    mon.flush()
    return wait_until(lambda: (e := _efficiency(mon, model, stage)).get("flops_per_call") is not None and e,
                      what=f"{model}'s signature to be counted")


def _reference() -> FlopCounterMode:
    """torch's own counter, with its SDPA formula for CPU's fused attention kernel (which its registry lacks: on CPU,
    transformers' default attention runs it)."""
    def formula(q: Any, k: Any, v: Any, *_: Any, out_shape: Any = None, **__: Any) -> int:
        return int(sdpa_flop_count(q, k, v))  # FlopCounterMode hands a custom formula the shapes

    return FlopCounterMode(display=False,
                           custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: formula})


def _monitor(make_monitor: Any, **kw: Any) -> perfmon.Monitor:
    # Not started: no resolver thread wakes during the timed calls; flush() resolves them, then the counter runs.
    kw.setdefault("sample_rate", 1.0)
    return make_monitor(warmup_calls=0, stats_window_seconds=3600, **kw)


@pytest.mark.parametrize(("layers", "width", "batch"), [(4, 512, 256), (1, 4096, 1)],
                         ids=["matmul-bound", "memory-bound"])
def test_flops_and_bytes_per_second_match_the_layer_shapes_over_the_tests_own_time(make_monitor, layers: int,
                                                                                   width: int, batch: int) -> None:
    """A Linear stack's counted FLOPs and bytes equal its shapes' exactly, and perfmon's FLOP/s and bytes/s are
    within 10% of shapes / the time the test measured itself for the same calls (matmul- and memory-bound)."""
    mon = _monitor(make_monitor)
    model = mon.wrap(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).eval(), name="lin")
    x = torch.randn(batch, width)
    _timed_calls(model, x, 1)  # the signature's first call: cold, not in the steady window
    took = _timed_calls(model, x, 30)
    eff = _counted(mon, "lin")
    flops = layers * 2 * batch * width * width  # 2*B*in*out per layer; torch's formula counts no bias
    moved = layers * 4 * (width * width + width + 2 * batch * width)  # fp32 weight, bias, input, output per layer
    assert eff["samples"] == eff["counted_samples"] == 30 and eff["unknown_ratio"] == 0.0
    assert eff["flops_per_call"] == flops and eff["bytes_per_call"] == moved
    seconds = sum(took)
    assert eff["flops_per_second"] == pytest.approx(flops * len(took) / seconds, rel=0.10)
    assert eff["bytes_per_second"] == pytest.approx(moved * len(took) / seconds, rel=0.10)
    assert value(mon, "perfmon_model_flops_per_second", model="lin") == pytest.approx(eff["flops_per_second"], rel=1e-3)
    assert value(mon, "perfmon_model_bytes_per_second", model="lin") == pytest.approx(eff["bytes_per_second"], rel=1e-3)
    # A CPU has no peak: no MFU or MBU, and /stats says why.
    assert eff["mfu_ratio"] is None and eff["mbu_ratio"] is None and "no peak for cpu" in eff["peak_note"]
    assert value(mon, "perfmon_model_mfu_ratio", model="lin") is None
    assert value(mon, "perfmon_model_peak_info", model="lin", device="cpu", source="") is None


def test_an_embedding_lookup_moves_its_rows_not_its_table(make_monitor) -> None:
    """An embedding lookup's bytes are the rows it returns (read, then written) and its indices, not the whole
    vocabulary; a lookup has no FLOPs."""
    mon = _monitor(make_monitor)
    model = mon.wrap(torch.nn.Embedding(10_000, 64), name="emb")
    _timed_calls(model, torch.randint(0, 10_000, (2, 16)), 3)
    eff = _counted(mon, "emb")
    assert eff["flops_per_call"] == 0 and eff["bytes_per_call"] == 2 * (2 * 16 * 64 * 4) + 2 * 16 * 8


def test_mfu_and_mbu_against_configured_peaks(make_monitor) -> None:
    """With peak_flops/peak_bandwidth set, MFU = FLOP/s over the peak and MBU = bytes/s over the bandwidth, and the
    peak's source is exported beside them."""
    mon = _monitor(make_monitor, peak_flops=2e12, peak_bandwidth=1e11)
    model = mon.wrap(torch.nn.Linear(256, 256), name="m")
    _timed_calls(model, torch.randn(8, 256), 5)
    eff = _counted(mon, "m")
    assert eff["mfu_ratio"] == pytest.approx(eff["flops_per_second"] / 2e12)
    assert eff["mbu_ratio"] == pytest.approx(eff["bytes_per_second"] / 1e11)
    assert eff["peak_source"] == "settings (peak_flops, peak_bandwidth)" and eff["peak_flops_per_second"] == 2e12
    assert value(mon, "perfmon_model_mfu_ratio", model="m") == pytest.approx(eff["mfu_ratio"], rel=1e-3)
    assert value(mon, "perfmon_model_mbu_ratio", model="m") == pytest.approx(eff["mbu_ratio"], rel=1e-3)
    assert value(mon, "perfmon_model_peak_info", model="m", stage="", device="cpu",
                 source="settings (peak_flops, peak_bandwidth)") == 1.0


def test_each_dtype_of_a_shape_is_priced_by_its_own_count(make_monitor) -> None:
    """A one-tensor call is keyed on its shape alone, so fp32 and bf16 calls of one shape share a signature; their
    bytes are each dtype's own: the calls before a switch keep fp32's, those after have bf16's, and after a switch
    back the fp32 calls are priced as fp32 again (one count per dtype, counted once)."""
    mon = _monitor(make_monitor)
    model = torch.nn.Linear(256, 256).eval()
    wrapped = mon.wrap(model, name="sw")
    x = torch.randn(8, 256)

    def moved(size: int) -> int:  # weight, bias, input and output in a dtype of ``size`` bytes
        return size * (256 * 256 + 256 + 2 * 8 * 256)

    def window(samples: int) -> dict[str, Any]:
        mon.flush()
        return wait_until(lambda: (e := _efficiency(mon, "sw"))["counted_samples"] == samples and e,
                          what=f"{samples} counted samples")

    _timed_calls(wrapped, x, 11)  # the first call is cold: 10 steady fp32 samples
    assert _counted(mon, "sw")["bytes_per_call"] == moved(4)
    model.to(torch.bfloat16)
    _timed_calls(wrapped, x.to(torch.bfloat16), 11)  # the first call in bf16 is cold again
    mixed = window(20)
    assert mixed["samples"] == 20 and mixed["bytes_per_call"] == (10 * moved(4) + 10 * moved(2)) / 20
    assert mixed["flops_per_call"] == 2 * 8 * 256 * 256
    model.to(torch.float32)
    _timed_calls(wrapped, x, 10)  # fp32 was seen with this shape: warm
    back = window(30)
    assert back["samples"] == 30 and back["bytes_per_call"] == (20 * moved(4) + 10 * moved(2)) / 30
    assert mon.stats()["flop_counting"]["counts"]["ok"] == 2


def test_calls_in_a_dtype_the_model_left_before_their_count_are_unknown_not_mispriced(make_monitor) -> None:
    """A model converted (fp32 to bf16) before its fp32 calls were counted: the count runs on the model as it is
    then, so it would price fp32 inputs with bf16 weights, a call that never happened (147,968 bytes for 279,552).
    Those calls are unknown, with the reason; the bf16 calls are priced as bf16."""
    mon = _monitor(make_monitor)
    model = torch.nn.Linear(256, 256).eval()
    wrapped = mon.wrap(model, name="late")
    x = torch.randn(8, 256)
    _timed_calls(wrapped, x, 11)  # not flushed: nothing is counted yet
    model.to(torch.bfloat16)
    _timed_calls(wrapped, x.to(torch.bfloat16), 11)
    mon.flush()
    eff = wait_until(lambda: (e := _efficiency(mon, "late"))["counted_samples"] == 10 and e["unknown"] and e,
                     what="the bf16 calls counted and the fp32 ones refused")
    assert eff["samples"] == 20 and eff["unknown_ratio"] == 0.5
    assert eff["bytes_per_call"] == 2 * (256 * 256 + 256 + 2 * 8 * 256)
    (why, n), = eff["unknown"].items()
    assert n == 10 and "moved to torch.bfloat16 before its torch.float32 calls were counted" in why


def test_a_tiny_gpt2_prefill_is_counted_like_flopcountermode(make_monitor) -> None:
    """A random tiny GPT-2's prefill forward counts the FLOPs torch's FlopCounterMode counts running it for real, under
    stage="prefill"; its decode steps (a KV-cache object) are unknown, with the reason, never guessed."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad(), _reference() as reference:
        gpt2(ids)
    mon = _monitor(make_monitor)
    model = mon.wrap(gpt2, name="gpt2")
    with torch.no_grad():
        for _ in range(4):
            out = model(ids)
        for _ in range(4):
            model(ids[:, :1], **{cache_key(gpt2): out[cache_key(gpt2)]})
    eff = _counted(mon, "gpt2", "prefill")
    assert eff["flops_per_call"] == reference.get_total_flops() > 0
    assert value(mon, "perfmon_model_flops_per_second", model="gpt2", stage="prefill") > 0
    decode = _efficiency(mon, "gpt2", "decode")
    assert decode["counted_samples"] == 0 and decode["unknown_ratio"] == 1.0
    assert any("DynamicCache" in why for why in decode["unknown"]), decode["unknown"]
    assert value(mon, "perfmon_model_flops_unknown_ratio", model="gpt2", stage="decode") == 1.0
    assert value(mon, "perfmon_model_flops_per_second", model="gpt2", stage="decode") is None


class _Attention(torch.nn.Module):
    """One 4-head self-attention block, through ``scaled_dot_product_attention`` or written out in matmuls."""

    def __init__(self, fused: bool, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.fused, self.heads = fused, heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5, -1) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def test_fused_attention_on_cpu_is_counted_like_the_same_attention_in_matmuls(make_monitor) -> None:
    """On CPU scaled_dot_product_attention runs a fused kernel torch's FLOP registry has no formula for: it counted 0
    (the call read 20 % low, nothing unknown). It counts what its two matmuls do, as written out by hand."""
    batch, seq, width = 4, 32, 64
    hand = 2 * batch * seq * width * 3 * width + 2 * batch * seq * width * width + 2 * (2 * batch * seq * seq * width)
    mon = _monitor(make_monitor)
    models = {"fused": mon.wrap(_Attention(True), name="fused"), "matmuls": mon.wrap(_Attention(False), name="matmuls")}
    x = torch.randn(batch, seq, width)
    with torch.no_grad():
        for model in models.values():
            for _ in range(3):
                model(x)
    for name in models:
        eff = _counted(mon, name)
        assert (eff["flops_per_call"], eff["unknown_ratio"]) == (hand, 0.0), name


def test_generate_prefill_with_its_fresh_cache_is_counted(make_monitor) -> None:
    """generate() passes its prefill a DynamicCache it just made (empty): the prefill is counted as
    FlopCounterMode counts the same real forward (an empty cache of the same class); decode steps stay unknown."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 1000, (2, 16))
    seen: list[tuple[Any, dict[str, Any]]] = []
    hook = gpt2.register_forward_pre_hook(lambda _m, a, k: seen.append((a, dict(k))), with_kwargs=True)
    with torch.no_grad():
        gpt2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    hook.remove()
    args, kwargs = seen[0]  # the prefill, as generate() called it: replay it with a new empty cache of that class
    key = cache_key(gpt2)
    kwargs[key] = type(kwargs[key])()
    with torch.no_grad(), _reference() as reference:
        gpt2(*args, **kwargs)
    mon = _monitor(make_monitor)
    model = mon.wrap(gpt2, name="gpt2")
    with torch.no_grad():
        for _ in range(4):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    eff = _counted(mon, "gpt2", "prefill")
    assert eff["flops_per_call"] == reference.get_total_flops() > 0
    assert _efficiency(mon, "gpt2", "decode")["counted_samples"] == 0


class _DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())  # reads tensor data: a fake tensor has none


def test_what_cannot_be_counted_is_unknown_with_its_reason(make_monitor) -> None:
    """Forward hooks, a data-dependent forward, a plain function and a model whose signatures are not tracked are
    unknown, each with its reason in /stats; none gets a FLOP/s series, and the outcomes are counted."""
    mon = _monitor(make_monitor)
    hooked = torch.nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *a: None)
    models = {"hooked": mon.wrap(hooked, name="hooked"), "data": mon.wrap(_DataDependent(), name="data"),
              "fn": mon.instrument(lambda x: x @ x.T, name="fn")}
    for model in models.values():
        _timed_calls(model, torch.randn(2, 4), 3)
    untracked = _monitor(make_monitor, track_signatures=False)
    _timed_calls(untracked.wrap(torch.nn.Linear(4, 4), name="plain"), torch.randn(2, 4), 3)
    mon.flush()
    untracked.flush()
    wait_until(lambda: mon.stats()["flop_counting"]["counts"] != {}
               and sum(mon.stats()["flop_counting"]["counts"].values()) >= 3, what="three counts")
    reasons = {name: _efficiency(mon, name)["unknown"] for name in models}
    assert any(why.startswith("forward hooks on the model") for why in reasons["hooked"]), reasons
    assert any("DataDependentOutputException" in why for why in reasons["data"]), reasons
    assert any(why.startswith("not a wrapped module") for why in reasons["fn"]), reasons
    plain = _efficiency(untracked, "plain")
    assert plain["unknown_ratio"] == 1.0 and any(w.startswith("no input signature") for w in plain["unknown"])
    counts = mon.stats()["flop_counting"]["counts"]
    assert counts["skipped"] == 2 and counts["failed"] == 1 and counts["ok"] == 0
    for name in models:
        assert value(mon, "perfmon_model_flops_per_second", model=name) is None
        assert value(mon, "perfmon_model_flops_unknown_ratio", model=name) == 1.0
    assert value(mon, "perfmon_flop_counts_total", outcome="skipped") == 2


class _Stateful(torch.nn.Module):
    """A module whose forward changes its own state: an attribute, a buffer in place, a cache."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.add_(1)
        self.last_shape = tuple(x.shape)
        return self.lin(x)


def test_counting_runs_on_a_copy_and_leaves_the_serving_model_alone(make_monitor) -> None:
    """The count's fake forward never runs the user's module: its attributes, buffers and outputs are exactly what the
    serving thread's own calls made, while that thread keeps calling it during the count."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_Stateful(), name="stateful")
    x = torch.randn(8, 64)
    with torch.no_grad():
        model(x)
        model(x)
        expected = model.lin(x)
    mon.flush()  # the steady sample's signature goes to the counting thread
    calls, stop = [2], threading.Event()

    def serve() -> None:
        with torch.no_grad():
            while not stop.is_set():
                assert torch.equal(model(x), expected)
                calls[0] += 1

    server = threading.Thread(target=serve)
    server.start()
    try:
        wait_until(lambda: _efficiency(mon, "stateful").get("flops_per_call") is not None, what="the count")
    finally:
        stop.set()
        server.join()
    assert _efficiency(mon, "stateful")["flops_per_call"] == 2 * 8 * 64 * 64
    assert model.calls == calls[0] and int(model.seen) == calls[0] and model.last_shape == (8, 64)
    assert type(model).__name__ == "_Stateful" and isinstance(model, perfmon.MonitoredModule)


class _Slow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5000):
            x = x + 1
        return x


def test_the_budget_defers_and_the_timeout_gives_up(make_monitor) -> None:
    """At flop_counts_per_minute=1 a second signature waits (deferred, "not counted yet"); a fake forward past
    flop_count_timeout_seconds is abandoned and its signature unknown."""
    mon = _monitor(make_monitor, flop_counts_per_minute=1, flop_count_timeout_seconds=0.05).start()  # stop() ends it
    slow = mon.wrap(_Slow(), name="slow")
    _timed_calls(slow, torch.ones(2), 3)
    mon.flush()
    wait_until(lambda: mon.stats()["flop_counting"]["counts"]["timeout"] == 1, what="the timeout")
    assert any(w.startswith("counting took longer than 0.05 s") for w in _efficiency(mon, "slow")["unknown"])
    other = mon.wrap(torch.nn.Linear(4, 4), name="other")
    _timed_calls(other, torch.ones(2, 4), 3)
    mon.flush()
    wait_until(lambda: mon.stats()["flop_counting"]["counts"]["deferred"] >= 1, what="a deferral")
    eff = _efficiency(mon, "other")
    assert eff["counted_samples"] == 0 and any(w.startswith("not counted yet") for w in eff["unknown"]), eff
    assert value(mon, "perfmon_flop_counts_total", outcome="deferred") >= 1


class _Sleepy(torch.nn.Module):
    """A forward whose Python takes 0.3 s (on the fake copy too: counting runs the forward's Python)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return x * 2


def test_the_share_of_wall_time_paces_counts_after_the_first_burst(make_monitor) -> None:
    """flop_count_share: after FLOP_COUNT_BURST_SECONDS of counting the thread waits until the share refills (a
    count holds the GIL): two 0.3 s counts spend the burst, a third signature is deferred, "not counted yet"."""
    from perfmon.agent.flopcount import FLOP_COUNT_BURST_SECONDS

    assert 0.3 < FLOP_COUNT_BURST_SECONDS <= 0.6
    mon = _monitor(make_monitor, flop_count_share=1e-6, flop_count_timeout_seconds=1.5).start()
    model = mon.wrap(_Sleepy(), name="sleepy")
    for width in (1, 2, 3):
        _timed_calls(model, torch.ones(width), 3)
    mon.flush()
    wait_until(lambda: mon.stats()["flop_counting"]["counts"]["deferred"] >= 1, what="a deferral", timeout=20)
    counts = mon.stats()["flop_counting"]["counts"]
    assert counts["ok"] == 2, counts
    eff = _efficiency(mon, "sleepy")
    assert any(w.startswith("not counted yet") for w in eff["unknown"]), eff
    with pytest.raises(perfmon.ConfigError, match="flop_count_share"):
        make_monitor(flop_count_share=0.0)


class _Busy(torch.nn.Module):
    """A forward whose Python holds the GIL for 40 ms before each of its two ops (on the fake copy too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            end = time.perf_counter() + 0.04
            while time.perf_counter() < end:
                pass
            x = x * 2
        return x


def test_a_count_pauses_to_work_a_duty_of_its_time(make_monitor) -> None:
    """FLOP_COUNT_DUTY: a count that works W seconds takes at least W / duty of wall time, pausing with the GIL let go
    (a GIL-bound serving thread then loses about that share while it runs, not half its time in 5 ms stalls); the
    seconds it reports are its work, the pauses apart."""
    from perfmon.agent.flopcount import FLOP_COUNT_DUTY

    assert FLOP_COUNT_DUTY <= 0.25
    mon = _monitor(make_monitor).start()  # start(): torch's fake-tensor imports happen there, not in the count
    model = mon.wrap(_Busy(), name="busy")
    t0 = time.perf_counter()
    _timed_calls(model, torch.ones(3), 3)
    _counted(mon, "busy")
    wall = time.perf_counter() - t0
    work = mon.stats()["flop_counting"]["seconds"]
    assert 0.08 <= work < 0.5, work  # the two 40 ms stretches, not the pauses after them
    assert wall >= 0.9 * work / FLOP_COUNT_DUTY, (wall, work)


class _LongStretch(torch.nn.Module):
    """A forward whose Python holds the GIL for 0.2 s before its op: the count then pauses 1.8 s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
        return x * 2


def test_a_count_stopped_in_its_pause_is_charged_its_work_only() -> None:
    """A count stopped while it pauses is not counted (None, offered again later), and the seconds it reports are the
    work it did, not the pause the stop cut short."""
    import weakref

    from perfmon.agent.abstract import describe
    from perfmon.agent.flopcount import FlopCounter

    counter = FlopCounter(per_minute=60, timeout_seconds=30.0)
    counter.prepare()  # torch's imports, here: not part of the count
    model = _LongStretch()
    stop = threading.Event()
    timer = threading.Timer(0.6, stop.set)  # 0.2 s of work, then 0.4 s into its 1.8 s pause
    timer.start()
    try:
        got = counter.count(weakref.ref(model), describe((torch.ones(3),), {}), stop)
    finally:
        timer.cancel()
    assert got is None
    assert 0.15 <= counter.seconds < 0.45, counter.seconds


def test_count_flops_off_removes_the_stage(make_monitor) -> None:
    """count_flops=False: no efficiency in /stats, no efficiency or counting families in /metrics."""
    mon = _monitor(make_monitor, count_flops=False)
    _timed_calls(mon.wrap(torch.nn.Linear(4, 4), name="m"), torch.ones(2, 4), 3)
    mon.flush()
    stats = mon.stats()
    assert stats["flop_counting"] is None and stats["models"]["m"]["efficiency"] is None
    text = generate_latest(mon.registry).decode()
    assert "perfmon_model_flops" not in text and "perfmon_flop_count" not in text


@pytest.mark.parametrize("started", [True, False], ids=["started", "never-started"])
def test_stop_ends_the_counting_thread(make_monitor, started: bool) -> None:
    """stop() ends the counting thread, even one waiting for the budget's next token; a monitor never started too
    (its flush() submitted the signatures: nothing else would end the thread before the interpreter's exit)."""
    before = {t.ident for t in threading.enumerate() if t.name == "perfmon-flops"}
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, flop_counts_per_minute=1)
    if started:
        mon.start()
    held = []  # a dropped module is freed: its count would be "the module is gone", never deferred
    for width in (8, 16):  # the second signature waits a minute for its token
        held.append(mon.wrap(torch.nn.Linear(width, width), name=f"m{width}"))
        _timed_calls(held[-1], torch.ones(2, width), 3)
    mon.flush()
    wait_until(lambda: mon.stats()["flop_counting"]["counts"]["deferred"] >= 1, what="a deferral")
    t0 = time.monotonic()
    mon.stop()
    assert time.monotonic() - t0 < 5.0
    assert not [t for t in threading.enumerate() if t.name == "perfmon-flops" and t.ident not in before]
