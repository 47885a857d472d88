"""A wrapped model behaves exactly like the bare one."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import traceback
import weakref
from typing import Any

import pytest
import torch

import perfmon

from .conftest import value


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_outputs_identical_for_real_models(make_monitor) -> None:
    """Outputs of a wrapped MLP and Transformer encoder equal the bare model's bit for bit."""
    mon = make_monitor(sample_rate=0.05).start()
    torch.manual_seed(1)
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True),
        num_layers=2, enable_nested_tensor=False).eval()
    mlp = _mlp().eval()
    wrapped = {"mlp": mon.wrap(mlp, name="mlp"), "enc": mon.wrap(enc, name="enc")}
    with torch.inference_mode():
        for _ in range(20):
            x = torch.randn(3, 16)
            assert torch.equal(wrapped["mlp"](x), mlp(x))
            s = torch.randn(2, 5, 32)
            assert torch.equal(wrapped["enc"](s), enc(s))
            # keyword arguments pass through unchanged
            mask = torch.zeros(2, 5, dtype=torch.bool)
            assert torch.equal(wrapped["enc"](s, src_key_padding_mask=mask), enc(s, src_key_padding_mask=mask))


def test_user_exceptions_pass_through_unchanged(make_monitor) -> None:
    """The user's exception reaches the caller as the same object, with its traceback into the model."""
    mon = make_monitor(sample_rate=1.0)
    mlp = _mlp()
    model = mon.wrap(mlp, name="mlp")
    bad = torch.randn(2, 7)
    with pytest.raises(RuntimeError) as bare:
        mlp(bad)
    for _ in range(5):  # cold (timed) and steady calls alike
        with pytest.raises(RuntimeError) as wrapped:
            model(bad)
        assert str(wrapped.value) == str(bare.value)
        frames = [f.name for f in traceback.extract_tb(wrapped.value.__traceback__)]
        assert "forward" in frames

    class Boom(Exception):
        pass

    def explode(x: torch.Tensor) -> torch.Tensor:
        raise Boom("mine")

    fn = mon.instrument(explode, name="explode")
    err = Boom("x")
    with pytest.raises(Boom, match="mine"):
        fn(torch.ones(1))

    def raise_given(e: BaseException) -> None:
        raise e

    same = mon.instrument(raise_given, name="given")
    with pytest.raises(Boom) as caught:
        same(err)
    assert caught.value is err


def test_a_builtin_modules_forward_runs_with_no_frame_in_front_and_shows_torchs_source(make_monitor) -> None:
    """A wrapped torch module (nn.Linear) runs torch's own forward code called straight from ``_call_impl`` (no
    trampoline frame: it cost every call ~100 ns), and a traceback through it shows torch's source lines."""
    import linecache

    mon = make_monitor()
    model = mon.wrap(torch.nn.Linear(4, 4), name="linear")
    assert type(model).forward.__code__.co_code == torch.nn.Linear.forward.__code__.co_code
    torch_file = torch.nn.Linear.forward.__code__.co_filename
    for _ in range(3):  # cold (timed) and steady calls alike
        with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
            model(torch.randn(2, 5))
        frames = traceback.extract_tb(caught.value.__traceback__)
        names = [f.name for f in frames]
        at = names.index("forward")
        assert names[at - 1] == "_call_impl"  # torch's own caller, nothing of perfmon's between
        forward = frames[at]
        assert forward.filename.endswith(torch_file) and forward.lineno is not None
        assert forward.line and forward.line == linecache.getline(torch_file, forward.lineno).strip()


def test_module_api_is_preserved(make_monitor) -> None:
    """eval/train/to/state_dict/attributes/isinstance/containers work on the wrapped module, and stay monitored."""
    mon = make_monitor()
    bare = _mlp()
    model = mon.wrap(bare, name="mlp")
    assert isinstance(model, torch.nn.Sequential) and isinstance(model, torch.nn.Module)
    assert isinstance(model, perfmon.MonitoredModule)
    assert model.eval() is model and not bare.training
    assert model.train() is model and bare.training
    assert model.to(torch.float64) is model and bare[0].weight.dtype == torch.float64
    model = model.float().requires_grad_(False)
    assert isinstance(model, perfmon.MonitoredModule)
    assert list(model.state_dict()) == list(bare.state_dict())
    assert len(model) == 3 and isinstance(model[0], torch.nn.Linear)
    assert [type(m) for m in model] == [type(m) for m in bare]
    model.custom_flag = 7  # attribute writes land on the module
    assert bare.custom_flag == 7 and model.custom_flag == 7
    assert model is bare and model.perfmon_name == "mlp"
    assert type(model).__name__ == "Sequential" and type(model).__qualname__ == "Sequential"
    assert repr(model) == repr(torch.nn.Sequential(*bare))
    model(torch.randn(2, 16))
    mon.flush()
    assert mon.stats()["models"]["mlp"]["calls"] == 1


def test_torch_save_of_a_wrapped_model_saves_the_bare_module(make_monitor) -> None:
    """torch.save/pickle of a monitored model round-trips to an equivalent bare module."""
    mon = make_monitor()
    bare = _mlp()
    model = mon.wrap(bare, name="mlp")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is torch.nn.Sequential
    x = torch.randn(2, 16)
    assert torch.equal(loaded(x), bare(x))
    mon.flush()
    assert mon.stats()["models"]["mlp"]["calls"] == 1  # the loaded copy is not monitored
    assert type(pickle.loads(pickle.dumps(model))) is torch.nn.Sequential


def test_wrap_rejects_double_wrap_duplicate_names_and_non_callables(make_monitor) -> None:
    """Wrapping twice, reusing a name, or wrapping a non-callable fails with a clear error."""
    mon = make_monitor()
    model = mon.wrap(_mlp(), name="a")
    with pytest.raises(perfmon.WrapError):
        mon.wrap(model)
    with pytest.raises(perfmon.ConfigError, match="already monitored"):
        mon.wrap(_mlp(), name="a")
    with pytest.raises(perfmon.WrapError):
        mon.wrap(42)
    small = make_monitor(max_models=1)
    small.wrap(_mlp(), name="one")
    with pytest.raises(perfmon.ConfigError, match="max_models"):
        small.wrap(_mlp(), name="two")


def test_instrumented_method_binds_to_its_instance(make_monitor) -> None:
    """@monitor.instrument on a method keeps `self` and keeps the function's metadata."""
    mon = make_monitor()

    class Pipeline:
        def __init__(self) -> None:
            self.scale = 3

        @mon.instrument(name="pipeline.step")
        def step(self, x: int) -> int:
            """Scale x."""
            return x * self.scale

    p = Pipeline()
    assert p.step(2) == 6 and Pipeline.step.__doc__ == "Scale x."
    assert Pipeline.step.__wrapped__.__name__ == "step"
    mon.flush()
    assert mon.stats()["models"]["pipeline.step"]["calls"] == 1


class _Small(torch.nn.Module):
    """A user-defined model (torch.compile compiles its __call__ frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Staged(torch.nn.Module):
    """A generative-looking model (its forward takes ``past_key_values``): its calls go through stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        return torch.relu(self.a(x))


@pytest.mark.parametrize("make", [_Small, lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
                                  _Staged], ids=["user-module", "nn.Sequential", "staged"])
@pytest.mark.parametrize("order", ["compile(wrap(m))", "wrap(compile(m))"])
def test_torch_compile_in_both_orders_counts_every_call_with_no_graph_break(make_monitor, make, order) -> None:
    """torch.compile around a wrapped model, or a wrapped compiled model: every call counted and timed, outputs
    unchanged, one graph per input shape and zero graph breaks from perfmon."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mon = make_monitor(sample_rate=1.0)
    torch.manual_seed(0)
    bare = make()
    reference = copy.deepcopy(bare)
    if order == "compile(wrap(m))":
        model = torch.compile(mon.wrap(bare, name="m"), backend="eager")
    else:
        model = mon.wrap(torch.compile(bare, backend="eager"), name="m")
    with torch.inference_mode():
        for i in range(8):
            x = torch.randn(2 + i % 2, 8)
            assert torch.allclose(model(x), reference(x))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # one per input shape: no recompiles on the call counter
    mon.flush()
    stats = mon.stats()["models"]["m"]
    assert stats["calls"] == 8 and stats["sampled"] == 8


_COMPILE_AFTER_A_WRAP = """
import json, sys
import torch
from prometheus_client import CollectorRegistry
import perfmon

started = sys.argv[1] == "started"
# No FLOP counts and no profiler preparation: start() then imports nothing of torch.compile's.
mon = perfmon.Monitor(port=None, log_level="error", registry=CollectorRegistry(), sample_rate=1.0,
                      count_flops=False, prepare_profiler=False, regression=None)
if started:
    mon.start()
hooks = len(sys.meta_path)
model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), name="m")
imported_at_wrap = "torch._dynamo" in sys.modules
compiled = torch.compile(model, backend="eager")  # imports torch._dynamo; the first call traces
from torch._dynamo.utils import counters

with torch.inference_mode():
    for i in range(8):
        x = torch.randn(2 + i % 2, 8)
        assert torch.allclose(compiled(x), torch.relu(model[0](x)))
mon.flush()
stats = mon.stats()["models"]["m"]
mon.stop()
print(json.dumps({"imported_at_wrap": imported_at_wrap, "breaks": sum(counters["graph_break"].values()),
                  "graphs": counters["stats"]["unique_graphs"], "calls": stats["calls"], "sampled": stats["sampled"],
                  "hooks_left": len(sys.meta_path) - hooks,
                  "loader": type(sys.modules["torch._dynamo"].__loader__).__name__}))
"""


@pytest.mark.parametrize("started", ["started", "never started"])
def test_torch_compile_after_the_wrap_imports_dynamo_still_compiles_the_model_whole(started: str) -> None:
    """The usual order, ``torch.compile(monitor.wrap(model))``, in a process where nothing imported torch._dynamo
    before the wrap: torch.compile imports it and traces on the first call, before any housekeeping tick. Unmarked,
    Dynamo traced the hot path: 7 graph breaks and 10 graphs for 8 calls of 2 shapes (it specialised on the call
    counter). perfmon marks as that import completes: zero breaks, one graph a shape, and no import hook left."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _COMPILE_AFTER_A_WRAP, started], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["imported_at_wrap"] is False  # the case under test happened
    assert got == {"imported_at_wrap": False, "breaks": 0, "graphs": 2, "calls": 8, "sampled": 8, "hooks_left": 0,
                   "loader": "SourceFileLoader"}


@pytest.mark.parametrize("make", [_Small, _Staged], ids=["plain", "staged"])
@pytest.mark.parametrize("when", ["compile after wrap", "compile before wrap"])
def test_module_compile_of_a_wrapped_model_runs_the_compiled_call_and_counts(make_monitor, make, when) -> None:
    """module.compile() on a wrapped model, or wrapping a module.compile()d one: calls go through the compiled call
    (one graph) and still count. perfmon calls ``_call_impl`` directly when it can (a frame less); a compiled call
    needs the full ``nn.Module.__call__``, and wrapping a compiled module used to skip it (no graph at all)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mon = make_monitor(sample_rate=1.0)
    bare = make()
    reference = copy.deepcopy(bare)
    if when == "compile before wrap":
        bare.compile(backend="eager")
        model = mon.wrap(bare, name="m")
    else:
        model = mon.wrap(bare, name="m")
        model.compile(backend="eager")
    x = torch.randn(2, 8)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.allclose(model(x), reference(x))
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
    mon.flush()
    assert mon.stats()["models"]["m"]["calls"] == 3


class _Ragged(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.values().sum() if x.layout == torch.jagged else x.to_padded_tensor(0.0).sum()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("tracked", [True, False], ids=["signatures", "no signatures"])
def test_nested_tensor_calls_pass_through_counted_as_one_signature(make_monitor, layout, tracked) -> None:
    """A nested tensor (a ragged batch) passes through a wrapped module as through the bare one: a strided one has
    no ``shape`` (reading it raises, and the hot path's did, into the user's call), a jagged one's holds a symbolic
    size new with each batch. Every call counted, no internal error, and one signature whatever the raggedness."""
    from .conftest import hist_count, value

    mon = make_monitor(sample_rate=1.0, warmup_calls=1, track_signatures=tracked)
    bare = _Ragged()
    model = mon.wrap(_Ragged(), name="ragged")
    torch.manual_seed(0)
    with torch.inference_mode():
        for i in range(12):
            nt = torch.nested.nested_tensor([torch.randn(1 + i % 4, 3), torch.randn(2 + i % 3, 3)], layout=layout)
            assert torch.equal(model(nt), bare(nt))
    assert mon.flush(timeout=10)
    stats = mon.stats()["models"]["ragged"]
    assert stats["calls"] == 12 and not stats["errors"] and stats["sampled"] == 12
    assert not value(mon, "perfmon_internal_errors_total", stage="instrument")
    if tracked:
        assert stats["input_signatures"] == 1
        assert (hist_count(mon, "ragged", "cold"), hist_count(mon, "ragged", "steady")) == (1, 11)


class _Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


def test_torch_jit_script_takes_a_wrapped_module_and_a_parent_of_one(make_monitor) -> None:
    """TorchScript compiles every property of a module's class and refused perfmon's (``perfmon_name``): scripting a
    wrapped module, or a parent holding one, raised. Both script now, with the bare module's outputs; the wrapped
    module's own (eager) calls still count, and a scripted copy runs without perfmon as it runs no Python call."""
    mon = make_monitor(sample_rate=1.0)
    torch.manual_seed(0)
    bare = _Small()
    model = mon.wrap(copy.deepcopy(bare), name="m")
    x = torch.randn(2, 8)
    assert torch.allclose(torch.jit.script(model)(x), bare(x))
    assert torch.allclose(torch.jit.script(_Outer(model))(x), bare(x) + 1)
    model(x)
    mon.flush()
    assert mon.stats()["models"]["m"]["calls"] == 1
    assert model.perfmon_name == "m"


@pytest.mark.parametrize("signatures", [True, False])
def test_torch_jit_trace_of_a_wrapped_module_warns_nothing_from_perfmon(make_monitor, signatures: bool) -> None:
    """Under ``torch.jit.trace`` sizes are traced tensors: perfmon's own reading of a call's rows and work (a new
    signature, a timed call) warned ``TracerWarning: Converting a tensor to a Python integer`` pointing at perfmon's
    code, as though the user's trace were wrong. The trace warns nothing from perfmon, runs as the bare module, and
    the tracing calls count."""
    import warnings

    mon = make_monitor(sample_rate=1.0, track_signatures=signatures)
    torch.manual_seed(0)
    bare = _Small()
    model = mon.wrap(copy.deepcopy(bare), name="m")
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, x)
    package = os.path.dirname(perfmon.__file__)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if os.path.abspath(w.filename).startswith(package)]
    assert ours == []
    assert torch.allclose(traced(x), bare(x))
    mon.flush()
    assert mon.stats()["models"]["m"]["calls"] >= 1


def test_moving_a_model_makes_its_next_calls_cold(make_monitor) -> None:
    """After ``.to(device)`` the first call of a known shape is cold on the new device (kernel selection,
    workspaces): the device label follows the module, and steady state is not polluted by the move."""
    from .conftest import hist_count

    mon = make_monitor(sample_rate=1.0, warmup_calls=0)
    model = mon.wrap(torch.nn.Linear(8, 8), name="lin")
    for _ in range(3):
        model(torch.randn(2, 8))
    model = model.to("meta")  # a device every CPU build has
    model(torch.randn(2, 8, device="meta"))
    model(torch.randn(2, 8, device="meta"))
    assert mon.flush(timeout=10)
    assert hist_count(mon, "lin", "cold", device="cpu") == 1
    assert hist_count(mon, "lin", "steady", device="cpu") == 2
    assert hist_count(mon, "lin", "cold", device="meta") == 1
    assert hist_count(mon, "lin", "steady", device="meta") == 1


def test_a_calls_signature_is_its_work_not_its_bookkeeping() -> None:
    """Keyword calls (a Hugging Face decode step): the same work is one signature whatever the attention mask
    or positions; a new input shape, dtype, or a tensor inside a tuple changing shape, is a new one."""
    from collections import namedtuple

    from perfmon.agent.phases import signature

    Pair = namedtuple("Pair", "a b")

    class Cache:
        pass

    def step(ids: torch.Tensor, mask_len: int, pair: Pair | None = None) -> object:
        kw = {"input_ids": ids, "past_key_values": Cache(), "attention_mask": torch.ones(1, mask_len),
              "cache_position": torch.tensor([mask_len]), "use_cache": True}
        if pair is not None:
            kw["extra"] = pair
        return signature((), kw)

    ids = torch.ones(1, 1, dtype=torch.long)
    assert step(ids, 9) == step(torch.zeros(1, 1, dtype=torch.long), 10)  # bookkeeping moved, work did not
    assert step(ids, 9) != step(torch.ones(2, 1, dtype=torch.long), 9)  # batch 2
    assert step(ids, 9) != step(ids.int(), 9)  # dtype
    assert step(ids, 9, Pair(torch.ones(2), 1)) != step(ids, 9, Pair(torch.ones(3), 1))  # one level into a tuple
    assert signature((torch.nn.Parameter(torch.ones(2)),), {}) == signature((torch.ones(2),), {})
    assert signature((torch.ones(2), 3), {}) == signature((torch.ones(2), 4), {})  # an int: its type only
    # Keyword values are looked into by their type (remembered per type): a tensor subclass and a list are,
    # every time, and so is a namedtuple first seen after many other types.
    p1, p2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    for _ in range(2):
        assert signature((), {"w": p1}) != signature((), {"w": p2})
        assert signature((), {"xs": [torch.ones(2)]}) != signature((), {"xs": [torch.ones(3)]})
    for i in range(300):  # more types than the kind cache keeps
        signature((), {"v": type(f"T{i}", (), {})()})
    Late = namedtuple("Late", "t")
    assert signature((), {"x": Late(torch.ones(2))}) != signature((), {"x": Late(torch.ones(3))})
    assert signature((), {"c": Cache()}) == (("c", "Cache"),)


def test_a_dropped_module_is_freed_and_its_name_takes_the_next_version(make_monitor) -> None:
    """A wrapped module the server drops is garbage-collected (the monitor keeps its series, not its weights), and
    its name then takes the model's next version, whose calls continue the same counters."""
    mon = make_monitor().start()
    v1 = mon.wrap(_mlp(), name="enc")
    for _ in range(3):
        v1(torch.randn(2, 16))
    freed = weakref.ref(v1)
    del v1
    gc.collect()
    assert freed() is None
    assert value(mon, "perfmon_forward_calls_total", model="enc") == 3  # its series stay (counters never go back)
    v2 = mon.wrap(_mlp(), name="enc")
    for _ in range(2):
        v2(torch.randn(2, 16))
    assert value(mon, "perfmon_forward_calls_total", model="enc") == 5


def test_an_unwrapped_module_collected_later_leaves_its_successor_wrapped(make_monitor) -> None:
    """Unwrapped, then replaced under its name, an old module's collection does not free the name from the live
    successor: a third module under that name is still refused."""
    mon = make_monitor().start()
    old = mon.wrap(_mlp(), name="enc")
    mon.unwrap(old)
    new = mon.wrap(_mlp(), name="enc")
    del old
    gc.collect()
    with pytest.raises(perfmon.ConfigError, match="already monitored"):
        mon.wrap(_mlp(), name="enc")
    assert new(torch.randn(1, 16)).shape == (1, 4)


def test_a_model_built_from_a_wrapped_ones_class_is_bare(make_monitor) -> None:
    """What code builds from a wrapped model's class (``type(self)(...)``: a slice of an ``nn.Sequential``, a model
    class's own constructor) is a new, bare object of the model's class: the user wrapped one object, and the new one's
    calls are not counted under its name. The wrapped model and its own calls are as before."""
    mon = make_monitor(sample_rate=1.0).start()
    seq = mon.wrap(_mlp(), name="mlp")
    x = torch.randn(3, 16)
    seq(x)
    head = seq[0:2]
    assert type(head) is torch.nn.Sequential and not isinstance(head, perfmon.MonitoredModule)
    assert torch.equal(head(x), torch.relu(seq[0](x)))
    other = type(seq)(torch.nn.Linear(16, 2))
    assert type(other) is torch.nn.Sequential and other(x).shape == (3, 2)
    for _ in range(4):
        head(x)
    assert mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="mlp") == 1
    seq(x)
    assert mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="mlp") == 2
    assert isinstance(seq, perfmon.MonitoredModule) and seq.perfmon_name == "mlp"


def test_from_pretrained_on_a_wrapped_model_loads_a_bare_one(make_monitor, tmp_path) -> None:
    """transformers' ``from_pretrained`` reached through a wrapped model or its class loads a new, bare model with the
    saved weights; generating with it counts nothing under the wrapped model's name."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=101, n_positions=64,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    mon = make_monitor().start()
    model = mon.wrap(transformers.GPT2LMHeadModel(cfg).eval(), name="gpt2")
    model.save_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    for loaded in (model.from_pretrained(tmp_path), type(model).from_pretrained(tmp_path), type(model)(cfg)):
        assert type(loaded) is transformers.GPT2LMHeadModel, type(loaded)
        loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert torch.equal(model.from_pretrained(tmp_path).transformer.wte.weight, model.transformer.wte.weight)
    assert mon.flush()
    stats = mon.stats()
    assert stats["models"].get("gpt2", {}).get("calls", 0) == 0
    assert "gpt2" not in stats.get("generation", {}) or not stats["generation"]["gpt2"]["requests"].get("ok")


def test_activation_checkpointing_of_a_wrapped_module_counts_its_calls_and_no_error(make_monitor) -> None:
    """``torch.utils.checkpoint`` with ``use_reentrant=False`` re-runs a wrapped block's forward in backward and stops
    it with torch's own exception once the activations are recomputed: that is no error of the user's. Gradients are
    the bare model's."""
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    net, bare = Net(), Net()
    bare.load_state_dict(net.state_dict())
    mon = make_monitor(sample_rate=1.0).start()
    mon.wrap(net.block, name="block")
    for _ in range(5):
        x = torch.randn(4, 8)
        for m in (net, bare):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        assert torch.equal(net.block[0].weight.grad, bare.block[0].weight.grad)
    assert mon.flush()
    assert mon.stats()["models"]["block"]["errors"] == {}
    assert value(mon, "perfmon_forward_calls_total", model="block") == 10  # each forward, and its recomputation
