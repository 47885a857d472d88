"""Generate loops: every forward counted however it is called, prefill apart from decode, requests tracked.

A randomly initialised Hugging Face GPT-2 (a tiny config: nothing is downloaded) is the ground truth:
a counting hook on the bare module says how many forwards really ran.
"""

from __future__ import annotations

import copy
import io
import itertools
import os
import sys
import time
from typing import Any

import pytest
import torch

import perfmon

from .conftest import cache_key, in_forked_child, value, wait_capture

transformers = pytest.importorskip("transformers")

PROMPT = 5
NEW = 6


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=64,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _generate(model: Any, batch: int = 2, new: int = NEW, **kw: Any) -> torch.Tensor:
    ids = torch.randint(0, 100, (batch, PROMPT))
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **kw)


def _counting(model: Any) -> itertools.count[int]:
    """Ground truth: a forward pre-hook on the module counts every forward that really ran."""
    seen = itertools.count()

    def hook(module: Any, args: Any) -> None:
        next(seen)

    model.register_forward_pre_hook(hook)
    return seen


def test_generate_counts_every_forward_split_prefill_decode(make_monitor) -> None:
    """After generate(max_new_tokens=k), perfmon counts exactly the forwards that ran: 1 prefill + k-1 decode each."""
    mon = make_monitor(sample_rate=1.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _counting(model)
    for _ in range(3):
        out = _generate(model)
        assert out.shape == (2, PROMPT + NEW)
    ran = next(truth)
    assert ran == 3 * NEW
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == 3
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode") == 3 * (NEW - 1)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="") is None
    assert mon.flush()
    stats = mon.stats()["models"]["gpt2"]
    assert stats["calls"] == ran and set(stats["stages"]) == {"prefill", "decode"}
    # Decode steps are one signature (B x 1 tokens + a cache): the growing attention mask is bookkeeping.
    decode = stats["stages"]["decode"]
    assert decode["input_signatures"] == 1
    cold = decode["latency"]["cold"]["duration"]["count"]
    steady = decode["latency"]["steady"]["duration"]["count"]
    assert cold <= 3 and cold + steady == 3 * (NEW - 1)  # warm-up + the signature's first call, no churn
    assert stats["stages"]["prefill"]["latency"]["cold"]["duration"]["count"] >= 1
    # Without a cache every forward runs the whole sequence again: each is a prefill, none a decode step.
    before = value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill")
    _generate(model, use_cache=False)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == before + NEW
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode") == 3 * (NEW - 1)


def test_another_models_generate_inside_a_generate_is_a_request_of_its_own(make_monitor) -> None:
    """A guard model's generate() run from the first model's stopping criterion: its sequences are requests the
    criterion receives (their tokens as it sees them), and the outer call's are counted as before. (An assistant's
    drafts, nested the same way, are no requests: tests/test_generation_modes.py.)"""
    mon = make_monitor()
    outer = mon.wrap(_gpt2(), name="outer")
    torch.manual_seed(1)
    guard = mon.wrap(_gpt2(), name="guard")
    received = {"requests": 0, "tokens": 0}

    class Guard(transformers.StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            out = guard.generate(input_ids[:, -3:], attention_mask=torch.ones_like(input_ids[:, -3:]),
                                 max_new_tokens=2, min_new_tokens=2, do_sample=False)
            received["requests"] += out.shape[0]
            received["tokens"] += out.shape[0] * (out.shape[1] - 3)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for _ in range(3):
        _generate(outer, stopping_criteria=transformers.StoppingCriteriaList([Guard()]))
    assert received["requests"] == 3 * NEW * 2  # a check a step, two rows each
    assert value(mon, "perfmon_generation_requests_total", model="guard", outcome="ok") == received["requests"]
    assert value(mon, "perfmon_generated_tokens_total", model="guard") == received["tokens"]
    assert value(mon, "perfmon_generation_requests_total", model="outer", outcome="ok") == 3 * 2
    assert value(mon, "perfmon_generated_tokens_total", model="outer") == 3 * 2 * NEW
    assert mon.stats()["internal_errors"] == {}


def test_a_composites_generate_calling_its_wrapped_language_models_counts_each_sequence_once(make_monitor) -> None:
    """A model of the user's whose generate() delegates to its language model's, both wrapped: the language model's
    call is the composite's implementation, left to it. Each sequence the caller receives is one request (the
    composite's), not one under each name; the language model's forwards are counted under its own."""

    class Composite(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None, **kw: Any) -> Any:
            return self.lm(input_ids, past_key_values=past_key_values, **kw)

        def generate(self, input_ids: torch.Tensor, **kw: Any) -> torch.Tensor:
            return self.lm.generate(input_ids, **kw)

    mon = make_monitor()
    lm = mon.wrap(_gpt2(), name="lm")
    truth = _counting(lm)
    outer = mon.wrap(Composite(lm), name="composite")
    for _ in range(3):
        assert _generate(outer).shape == (2, PROMPT + NEW)
    assert value(mon, "perfmon_generation_requests_total", model="lm", outcome="ok") in (None, 0.0)
    assert value(mon, "perfmon_generation_requests_total", model="composite", outcome="ok") == 3 * 2
    assert sum(value(mon, "perfmon_forward_calls_total", model="lm", stage=s) or 0 for s in ("prefill", "decode")) \
        == next(truth) == 3 * NEW


def _signature_runs(fn: Any) -> tuple[Any, itertools.count[int]]:
    """Run ``fn()`` counting the calls of ``phases.signature`` it makes (a profile hook: call counts, no timing)."""
    from perfmon.agent import phases

    code, seen = phases.signature.__code__, itertools.count()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            next(seen)

    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        out = fn()
    finally:
        sys.setprofile(before)
    return out, seen


def test_generate_without_a_cache_is_counted_exactly_and_its_steps_signatures_are_remembered(make_monitor) -> None:
    """generate(use_cache=False) reruns the whole sequence each step: every forward a prefill, counted exactly (the
    hook's count), its rows as items, each length a signature of its own. Once a length's signature is warm, a later
    call's step of that length is not signed again: the model remembers it (reruns.py), across calls."""
    mon = make_monitor(sample_rate=0.01, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _counting(model)
    for _ in range(4):  # each length's cold call and warm-up
        out = _generate(model, use_cache=False)
        assert out.shape == (2, PROMPT + NEW)
    out, signed = _signature_runs(lambda: [_generate(model, use_cache=False) for _ in range(3)])
    ran = next(truth)
    assert ran == 7 * NEW
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == ran
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode") is None
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 2 * ran
    # Only the 3 calls' first forwards (the prompt, before the call is known to run without a cache) are signed.
    assert next(signed) == 3
    mon.flush()
    prefill = mon.stats()["models"]["gpt2"]["stages"]["prefill"]
    assert prefill["input_signatures"] == NEW  # lengths PROMPT .. PROMPT + NEW - 1
    assert prefill["errors"] == {} and mon.stats()["internal_errors"] == {}
    # Another prompt length: its own signatures, counted alike.
    ids = torch.randint(0, 100, (2, PROMPT + 2))
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, use_cache=False)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == next(truth) - 1 == 8 * NEW
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 2 * 8 * NEW


def test_no_cache_steps_remembered_are_timed_when_due_and_pass_the_users_exception_through(make_monitor) -> None:
    """A remembered no-cache step still takes its turn in the sampling (timed, steady: the prefill stage's samples
    grow past its cold calls), and one whose forward raises passes the user's exception through unchanged, counted
    under the stage's errors with the call."""
    mon = make_monitor(sample_rate=0.2, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _counting(model)
    for _ in range(12):
        _generate(model, use_cache=False)
    assert mon.flush()
    prefill = mon.stats()["models"]["gpt2"]["stages"]["prefill"]
    latency = prefill["latency"]
    assert latency["steady"]["duration"]["count"] > 0 and prefill["sampled"] > latency["cold"]["duration"]["count"]
    boom = ValueError("the user's own")

    def fail(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape[-1] == PROMPT + 3:
            raise boom

    before = next(truth)
    model.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(ValueError) as raised:
        _generate(model, use_cache=False)
    assert raised.value is boom
    assert next(truth) - before - 1 == 4  # the prompt, then lengths +1, +2 and the one that raised
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == before + 4
    assert value(mon, "perfmon_forward_errors_total", model="gpt2", exception="ValueError") == 1
    assert mon.stats()["internal_errors"] == {}


def test_a_no_cache_step_whose_other_inputs_change_gets_its_own_signature(make_monitor) -> None:
    """Under cross-attention the encoder's states ride along every no-cache step: a new encoder length is a new
    signature (its cold call timed) though the input's shape and keywords are those of a step seen. Truth: the
    distinct shapes of the forwards' tensor keywords but the bookkeeping, taken by a pre-hook."""
    from perfmon.agent.phases import BOOKKEEPING_KWARGS

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=64, bos_token_id=100,
                                  eos_token_id=100, pad_token_id=100, add_cross_attention=True)
    mon = make_monitor(sample_rate=0.01, sample_floor_seconds=3600.0)
    model = mon.wrap(transformers.GPT2LMHeadModel(cfg).eval(), name="gpt2")
    shapes: set[tuple[Any, ...]] = set()

    def seen(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        shapes.add(tuple((k, tuple(v.shape)) for k, v in kwargs.items()
                         if isinstance(v, torch.Tensor) and k not in BOOKKEEPING_KWARGS))

    model.register_forward_pre_hook(seen, with_kwargs=True)
    ids = torch.randint(0, 100, (1, PROMPT))
    with torch.inference_mode():
        for length in (3, 3, 3, 7, 7, 11):
            model.generate(ids, encoder_hidden_states=torch.randn(1, length, 32), max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, use_cache=False)
    assert len(shapes) == 3 * 4  # 3 encoder lengths x 4 sequence lengths
    assert mon.stats()["models"]["gpt2"]["stages"]["prefill"]["input_signatures"] == len(shapes)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == 6 * 4


def test_a_call_without_a_cache_keyed_like_cached_ones_is_counted_as_prefills(make_monitor) -> None:
    """A server that passes ``use_cache=`` through gives cached and uncached calls the same keywords: the uncached ones
    rerun the whole sequence every step, each forward a prefill, never a decode step (nor run quiet, whose count
    assumes one prefill and then a step a token). Truth: a pre-hook on the inner transformer (so that calls may run
    quiet) and the no-cache premise, every forward the whole sequence."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="gpt2")
    lengths: list[int] = []
    model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs.get("input_ids", args[0] if args else None).shape[-1]),
        with_kwargs=True)
    for _ in range(3):  # cached: taught, then quiet
        _generate(model, use_cache=True)
    before = {s: value(mon, "perfmon_forward_calls_total", model="gpt2", stage=s) for s in ("prefill", "decode")}
    del lengths[:]
    for _ in range(3):
        _generate(model, use_cache=False)
    assert lengths == [PROMPT + i for i in range(NEW)] * 3  # every forward the whole sequence
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == before["prefill"] + 3 * NEW
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode") == before["decode"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_worker_forked_after_warm_up_generates_counts_its_own_items(make_monitor) -> None:
    """A pre-fork server warms its model up in the master: the decode steps' memo (``Stages.last``), quiet
    decoding's lessons and the no-cache steps' memo (reruns.py) then hold signatures of the master's table. A
    worker's forwards are counted in its own table, items included (rows x forwards: the hook's count is the truth),
    not into the master's copies nobody reads."""
    mon = make_monitor().start()
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _counting(model)
    for _ in range(4):  # warm: the decode steps' signature found, quiet decoding taught, no-cache steps remembered
        _generate(model)
        _generate(model, use_cache=False)
    before = next(truth)

    def child() -> dict[str, Any]:
        for _ in range(3):
            _generate(model)
            _generate(model, use_cache=False)
        mon.flush()
        return {"forwards": next(truth) - before - 1,
                "calls": sum(value(mon, "perfmon_forward_calls_total", model="gpt2", stage=s) or 0
                             for s in ("prefill", "decode")),
                "items": value(mon, "perfmon_forward_items_total", model="gpt2")}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with an OpenMP pool of the parent's at work, a forked child can hang in an op
    try:
        got = in_forked_child(child)
    finally:
        torch.set_num_threads(threads)
    assert got["forwards"] == 2 * 3 * NEW
    assert got["calls"] == 2 * 3 * NEW and got["items"] == 2 * 2 * 3 * NEW


@pytest.mark.parametrize("rate", [1.0, 1e-6])
def test_generate_is_tracked_as_requests_with_ttft_and_itl(make_monitor, rate: float) -> None:
    """A monitored model's own generate() counts one request per sequence, its prompt and generated tokens;
    a call whose tokens are timed (every one at generation_sample_rate=1, else the first and a sample) gives one
    TTFT per request and one ITL per later token."""
    mon = make_monitor(sample_rate=0.01, generation_sample_rate=rate, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    for _ in range(4):
        _generate(model, batch=3)
    mon.flush()
    mon.generations.drain()
    timed = 12 if rate == 1.0 else 3  # at 1e-6 (a stride of 1 .. 2e6 - 1 calls) and a floor of an hour: the first
    assert value(mon, "perfmon_generation_requests_total", model="gpt2", outcome="ok") == 12
    assert value(mon, "perfmon_prompt_tokens_total", model="gpt2") == 12 * PROMPT
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == 12 * NEW
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="gpt2") == timed
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="gpt2") == timed * (NEW - 1)
    assert value(mon, "perfmon_generation_output_tokens_count", model="gpt2") == 12  # every request's length
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["time_to_first_token"]["count"] == timed and gen["time_to_first_token"]["p50_seconds"] > 0


def test_generate_with_a_streamer_and_a_failing_generate(make_monitor) -> None:
    """generate(streamer=...) is tracked the same way (the streamer still gets every token); a generate() that
    raises counts its requests as errors and the exception passes through unchanged."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="gpt2")

    class Collect(transformers.generation.streamers.BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.puts = 0
            self.ended = False

        def put(self, value: Any) -> None:
            self.puts += 1

        def end(self) -> None:
            self.ended = True

    streamer = Collect()
    _generate(model, batch=1, streamer=streamer)
    assert streamer.puts == 1 + NEW and streamer.ended  # the prompt, then each new token
    with pytest.raises(ValueError) as caught:
        _generate(model, batch=1, num_beams=2, streamer=Collect())  # transformers refuses streaming beams
    assert "beam" in str(caught.value)
    mon.generations.drain()
    assert value(mon, "perfmon_generation_requests_total", model="gpt2", outcome="ok") == 1
    assert value(mon, "perfmon_generation_requests_total", model="gpt2", outcome="error") == 1
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == NEW


def test_a_token_the_callers_streamer_refuses_is_not_counted_as_received(make_monitor) -> None:
    """A streamer whose put() raises (a server's, writing to a client that left) did not hand that token out: the
    request is an error with the tokens the streamer took, and the exception passes through unchanged."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="gpt2")

    class Gone(Exception):
        pass

    class Client(transformers.generation.streamers.BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.received = 0
            self.prompt = False

        def put(self, value: Any) -> None:
            if not self.prompt:
                self.prompt = True
                return
            if self.received == 3:
                raise Gone("the client disconnected")
            self.received += 1

        def end(self) -> None:
            pass

    client = Client()
    with pytest.raises(Gone):
        _generate(model, batch=1, streamer=client)
    mon.generations.drain()
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"] == {"ok": 0, "error": 1, "cancelled": 0}
    assert client.received == 3 and gen["generated_tokens"] == 3


def test_calls_through_a_parent_a_pipeline_and_forward_are_counted(make_monitor) -> None:
    """The wrapped module is monitored in place: calls from a parent module or an object holding it count."""
    mon = make_monitor()
    inner = torch.nn.Linear(4, 4)
    parent = torch.nn.Sequential(inner, torch.nn.ReLU())
    wrapped = mon.wrap(inner, name="inner")
    assert wrapped is inner

    class Pipeline:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    x = torch.ones(2, 4)
    parent(x)
    Pipeline(inner)(x)
    wrapped(x)
    assert value(mon, "perfmon_forward_calls_total", model="inner") == 3


def test_wrapped_model_survives_save_load_deepcopy_state_dict_and_unwrap(make_monitor) -> None:
    """torch.save/load and deepcopy give the bare class; state_dict round-trips; unwrap restores it exactly."""
    mon = make_monitor()
    bare_cls = transformers.GPT2LMHeadModel
    model = mon.wrap(_gpt2(), name="gpt2")
    assert isinstance(model, bare_cls) and isinstance(model, torch.nn.Module)
    assert isinstance(model, perfmon.MonitoredModule) and type(model).__name__ == "GPT2LMHeadModel"
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is bare_cls
    twin = copy.deepcopy(model)
    assert type(twin) is bare_cls
    ids = torch.randint(0, 100, (1, PROMPT))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert torch.equal(twin(ids).logits, model(ids).logits)
    model.load_state_dict(loaded.state_dict())
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == 2  # the copies count nothing
    same = mon.unwrap(model)
    assert same is model and type(model) is bare_cls and not isinstance(model, perfmon.MonitoredModule)
    _generate(model, batch=1)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == 2
    assert mon.wrap(model, name="gpt2") is model  # wrapped again: the counters continue
    _generate(model, batch=1)
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill") == 3
    assert value(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode") == NEW - 1


def test_custom_stage_callable_labels_a_custom_loop(make_monitor) -> None:
    """wrap(stage=callable) labels a custom decode loop's calls; labels are bounded and a failing callable
    never breaks the call."""
    mon = make_monitor()

    def stage(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        x = args[0]
        if x.shape[0] == 99:
            raise RuntimeError("boom")
        return "prefill" if x.shape[1] > 1 else f"step{x.shape[0]}"

    model = mon.wrap(torch.nn.Linear(4, 4), name="loop", stage=stage)
    model(torch.ones(1, 3, 4))
    for batch in range(1, 12):  # 11 distinct decode labels: beyond 8 stages they become "other"
        model(torch.ones(batch, 1, 4))
    model(torch.ones(99, 1, 4))  # the callable fails: the call still runs, under the first stage
    labels = {k: v for k, v in mon.stats()["models"]["loop"]["stages"].items()}
    assert len(labels) == 8 and "other" in labels and sum(s["calls"] for s in labels.values()) == 13
    assert value(mon, "perfmon_internal_errors_total", stage="stage") == 1
    with pytest.raises(perfmon.ConfigError, match="stage="):
        mon.wrap(torch.nn.Linear(2, 2), name="bad", stage="decode")
    with pytest.raises(perfmon.ConfigError, match="stage="):
        mon.wrap(lambda x: x, name="fn", stage=stage)


def test_a_capture_of_a_generative_model_records_prefill_and_decode_steps(make_monitor) -> None:
    """Arming a capture of a model with stages arms every stage: a generate() call's forwards are its steps."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="gpt2")
    cap = mon.capture("gpt2", steps=NEW)
    _generate(model, batch=1)
    meta = wait_capture(mon, cap["id"], timeout=60)
    assert meta["outcome"] == "ok", meta
    assert meta["steps_recorded"] == NEW
    assert all(s.capture is None for s in mon.models.by_name["gpt2"].stages.values())  # released: timing goes on


def test_a_timed_request_gets_device_time_for_every_step_from_events(make_monitor) -> None:
    """On CUDA (the fake GPU), every step of a timed generate() request is timed with an event pair: device time
    per step by stage, while the host never waited; later untimed requests keep the normal sampling."""
    from perfmon.testing import FakeCuda, FakeGpu

    gpu = FakeGpu()

    class Cache:
        def __init__(self) -> None:
            self.length = 0

        def get_seq_length(self) -> int:
            return self.length

    class Decoder(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: Cache | None = None) -> torch.Tensor:
            gpu.launch(8.0 if input_ids.shape[1] > 1 else 2.0)  # prefill 8 ms, a decode step 2 ms
            if past_key_values is not None:
                past_key_values.length += input_ids.shape[1]
            return input_ids[:, -1:]

        def generate(self, ids: torch.Tensor, steps: int) -> torch.Tensor:
            cache = Cache()
            out = self(ids, past_key_values=cache)
            for _ in range(steps - 1):
                out = self(out, past_key_values=cache)
            return out

    # No low-traffic floor: flush() waits for the signatures' FLOP counts (its first, ~1-2 s of torch imports on a
    # loaded host), and a floor of 1 s would then time a call of the second request.
    mon = make_monitor(cuda=FakeCuda(gpu), sample_rate=0.001, warmup_calls=1, sample_floor_seconds=3600.0)
    model = mon.wrap(Decoder(), name="dec", device="cuda:0")
    model.generate(torch.ones(1, 7, dtype=torch.long), steps=NEW)
    assert mon.resolver.step() == 0  # the host returned before the device finished: nothing resolved yet
    gpu.finish()
    assert mon.flush()

    def steps(stage: str) -> tuple[float, float]:
        count = sum(value(mon, "perfmon_forward_duration_seconds_count", model="dec", device="cuda:0", phase=p,
                          stage=stage) or 0 for p in ("cold", "steady"))
        total = sum(value(mon, "perfmon_forward_duration_seconds_sum", model="dec", device="cuda:0", phase=p,
                          stage=stage) or 0 for p in ("cold", "steady"))
        return count, total

    assert steps("prefill") == (1, pytest.approx(0.008))
    assert steps("decode") == (NEW - 1, pytest.approx(0.002 * (NEW - 1)))
    model.generate(torch.ones(1, 7, dtype=torch.long), steps=NEW)  # not a timed request
    gpu.finish()
    mon.flush()
    assert steps("decode")[0] == NEW - 1  # its decode steps were not timed (past warm-up, 1-in-1000 sampling)


def test_a_pipeline_counts_each_internal_batch_and_the_caller_side_block_times_the_call(make_monitor) -> None:
    """pipeline("text-generation") with batch_size=2 over 4 prompts: the model's generate() per internal batch is
    4 requests with their real prompt tokens and padding apart; the documented caller-side block around the
    pipe() call gives one request whose TTFT is the call's own duration (the client's view)."""
    import time

    tokenizers = pytest.importorskip("tokenizers")
    vocab = {str(i): i for i in range(100)} | {"<eos>": 100}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="0"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>")
    mon = make_monitor(sample_rate=0.01)
    model = mon.wrap(_gpt2(), name="gpt2")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    prompts = ["1 2 3", "4 5 6 7 8", "9 10", "11 12 13 14"]  # batches (3, 5) and (2, 4) tokens: 2 + 2 padding
    pipe(prompts[:1], max_new_tokens=2)  # warm-up, its own request
    t0 = time.perf_counter()
    with mon.generation("pipe") as g:
        out = pipe(prompts, batch_size=2, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        g.token(len(out) * NEW)
    took = time.perf_counter() - t0
    assert mon.flush()
    stats = mon.stats()["generation"]
    assert stats["gpt2"]["requests"]["ok"] == 1 + 4
    assert stats["gpt2"]["generated_tokens"] == 2 + 4 * NEW
    assert stats["gpt2"]["prompt_tokens"] == 3 + 14 and stats["gpt2"]["prompt_padding_tokens"] == 4
    caller = stats["pipe"]
    assert caller["requests"]["ok"] == 1 and caller["generated_tokens"] == 4 * NEW
    assert caller["time_to_first_token"]["max_seconds"] == pytest.approx(took, rel=0.05, abs=0.005)


class _Cache:
    """A KV cache's stand-in: the widths it was fed (its length says whether a step is prefill or decode)."""

    def __init__(self) -> None:
        self.widths: list[int] = []

    def __len__(self) -> int:
        return len(self.widths)


class _ShiftingSteps(torch.nn.Module):
    """A generative module with a generate() of its own whose decode steps change their input's width mid-call
    (as a loop that feeds several tokens a step at times would), against a cache that holds what it was fed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None, use_cache: bool = True) -> Any:
        if past_key_values is not None:
            past_key_values.widths.append(input_ids.shape[-1])
        return self.lin(torch.ones(input_ids.shape[0], 4))

    def generate(self, input_ids: torch.Tensor, widths: tuple[int, ...] = (1, 1, 2, 2, 1)) -> torch.Tensor:
        cache = _Cache()
        self(input_ids=input_ids, past_key_values=cache, use_cache=True)  # prefill: the cache is empty
        for width in widths:
            self(input_ids=torch.ones(input_ids.shape[0], width, dtype=torch.long), past_key_values=cache,
                 use_cache=True)
        return input_ids


class _NewCacheName(torch.nn.Module):
    """A decoder with transformers 5.24's keywords: the KV cache comes as ``cache`` (with ``use_cache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    class Cache:
        """5.24's caches are ``Cache`` objects: their length is ``get_seq_length()``."""

        def __init__(self) -> None:
            self.length = 0

        def get_seq_length(self) -> int:
            return self.length

    def forward(self, input_ids: torch.Tensor, cache: Any = None, use_cache: bool = True) -> Any:
        if isinstance(cache, self.Cache):
            cache.length += input_ids.shape[-1]
        return self.lin(torch.ones(input_ids.shape[0], 4))

    def generate(self, input_ids: torch.Tensor, steps: int = 6) -> torch.Tensor:
        cache = self.Cache()
        for i in range(steps):
            self(input_ids=input_ids if i == 0 else input_ids[:, :1], cache=cache, use_cache=True)
        return input_ids


class _CacheIsSomethingElse(torch.nn.Module):
    """A forward with a ``cache`` argument but no ``use_cache``: not a Hugging Face decoder (the name is common)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: Any = None) -> Any:
        return self.lin(x)


@pytest.mark.parametrize("sample_rate", [1.0, 0.001])
def test_the_kv_cache_under_transformers_5_24s_name_splits_prefill_and_decode(make_monitor, sample_rate) -> None:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: a forward taking ``cache`` and ``use_cache`` is a
    decoder, its own generate()'s steps are split prefill/decode and counted exactly whether timed or on the short
    path; a module whose ``cache`` argument is something else keeps one stage; a step given under ``cache`` an object
    that is no KV cache (continuous batching's paged cache) is not a decode step on that account."""
    mon = make_monitor(sample_rate=sample_rate, warmup_calls=1)
    model = mon.wrap(_NewCacheName(), name="new")
    with torch.inference_mode():
        for _ in range(8):
            model.generate(torch.ones(2, 3, dtype=torch.long), steps=6)
        model(input_ids=torch.ones(2, 1, dtype=torch.long), cache=object(), use_cache=True)  # a paged-like cache
    assert value(mon, "perfmon_forward_calls_total", model="new", stage="prefill") == 8 + 1
    assert value(mon, "perfmon_forward_calls_total", model="new", stage="decode") == 8 * 5
    assert mon.flush()
    assert mon.stats()["generation"]["new"]["requests"]["ok"] == 8 * 2
    other = mon.wrap(_CacheIsSomethingElse(), name="other")
    other(torch.ones(2, 4), cache={"k": 1})
    assert value(mon, "perfmon_forward_calls_total", model="other") == 1


def test_decode_steps_keep_their_signatures_when_a_step_changes_shape(make_monitor) -> None:
    """Inside a model's own generate(), a decode step takes the step before's signature only while its input
    and keywords match: a step of another width is a signature of its own, every call is counted."""
    mon = make_monitor(sample_rate=1.0)
    model = mon.wrap(_ShiftingSteps(), name="steps")
    with torch.inference_mode():
        for _ in range(2):
            model.generate(torch.ones(2, 3, dtype=torch.long))
        model.generate(torch.ones(3, 3, dtype=torch.long), widths=(1, 1))  # another batch size: another one
    assert value(mon, "perfmon_forward_calls_total", model="steps", stage="prefill") == 3
    assert value(mon, "perfmon_forward_calls_total", model="steps", stage="decode") == 12
    assert mon.flush()
    decode = mon.stats()["models"]["steps"]["stages"]["decode"]
    assert decode["input_signatures"] == 3  # 2 x 1, 2 x 2, 3 x 1


def test_decode_steps_at_low_sampling_are_counted_exactly_with_their_items_and_signatures(make_monitor) -> None:
    """At 1-in-1000 sampling almost every decode step of a model's own generate() takes the short path (the step
    before's signature, no stage function): calls and items are still exact per stage, a step of another width or
    batch still gets a signature of its own, and a step that raises is counted and reaches the caller unchanged."""
    mon = make_monitor(sample_rate=0.001, warmup_calls=1)
    model = mon.wrap(_ShiftingSteps(), name="steps")
    widths = (1, 1, 1, 1, 2, 2, 1, 1, 1)
    with torch.inference_mode():
        for _ in range(10):
            model.generate(torch.ones(2, 3, dtype=torch.long), widths=(1,) * len(widths))
        for _ in range(10):  # a step of another width in the middle of the call, the short path taken before it
            model.generate(torch.ones(2, 3, dtype=torch.long), widths=widths)
        for _ in range(5):
            model.generate(torch.ones(3, 3, dtype=torch.long), widths=(1,) * 6)
    assert value(mon, "perfmon_forward_calls_total", model="steps", stage="prefill") == 25
    assert value(mon, "perfmon_forward_calls_total", model="steps", stage="decode") == 20 * len(widths) + 5 * 6
    # Items (the batch dimension), every stage: 20 x 2 rows, 5 x 3 rows, each a prefill and its decode steps.
    assert value(mon, "perfmon_forward_items_total", model="steps") == 2 * 20 * (1 + len(widths)) + 3 * 5 * (1 + 6)
    assert mon.flush()
    decode = mon.stats()["models"]["steps"]["stages"]["decode"]
    assert decode["input_signatures"] == 3  # 2 x 1, 2 x 2, 3 x 1

    class Broken(Exception):
        pass

    def fail(module: Any, args: Any, kwargs: Any) -> None:
        if kwargs["input_ids"].shape[0] == 2 and len(kwargs["past_key_values"].widths) == 4:
            raise Broken("step 4")

    handle = model.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(Broken, match="step 4"), torch.inference_mode():
        model.generate(torch.ones(2, 3, dtype=torch.long), widths=widths)
    handle.remove()
    assert value(mon, "perfmon_forward_errors_total", model="steps", exception="Broken") == 1
    assert value(mon, "perfmon_forward_calls_total", model="steps", stage="decode") == 20 * len(widths) + 5 * 6 + 4


def test_decode_steps_in_a_request_span_or_under_a_capture_leave_the_short_path(make_monitor) -> None:
    """A decode step that would take the short path still stamps an open request span, and reaches a capture armed
    in the middle of a generate() call (every later step of the call is recorded)."""
    mon = make_monitor(sample_rate=0.001, warmup_calls=1)
    model = mon.wrap(_ShiftingSteps(), name="steps")
    widths = (1,) * 8
    ends: list[int] = []
    model.register_forward_hook(lambda module, args, out: ends.append(time.perf_counter_ns()))
    with torch.inference_mode():
        for _ in range(3):
            model.generate(torch.ones(2, 3, dtype=torch.long), widths=widths)
        with mon.request("chat") as req:
            del ends[:]
            model.generate(torch.ones(2, 3, dtype=torch.long), widths=widths)
    assert len(ends) == 1 + len(widths)
    assert req.model == "steps" and req.model_start_ns is not None
    assert req.model_end_ns is not None and req.model_end_ns >= ends[-1]  # the last decode step stamped the span

    armed: list[dict[str, Any]] = []

    def arm(module: Any, args: Any, kwargs: Any) -> None:
        if len(kwargs["past_key_values"].widths) == 3 and not armed:  # mid-call, once the short path is taken
            armed.append(mon.capture("steps", steps=4))

    handle = model.register_forward_pre_hook(arm, with_kwargs=True)
    with torch.inference_mode():
        model.generate(torch.ones(2, 3, dtype=torch.long), widths=widths)
    handle.remove()
    meta = wait_capture(mon, armed[0]["id"], timeout=60)
    assert meta["outcome"] == "ok", meta
    assert meta["steps_recorded"] == 4


def test_a_returned_generate_is_settled_off_its_thread_and_every_read_sees_it(make_monitor) -> None:
    """With the monitor running, a generate() call hands the settling of its requests (token counts, timelines, the
    outcome) to the resolver's next pass instead of doing it between two model calls on the request thread; a read
    right after the call returns (a scrape, /stats) still counts it exactly, whether or not that pass has run."""
    mon = make_monitor().start()
    model = mon.wrap(_gpt2(), name="gpt2")
    handed_over = 0
    for i in range(1, 4):
        _generate(model, batch=1)
        # The resolver's pass (once a second) may run between the return and this read; three calls in a row
        # all meeting one is not a realistic schedule.
        handed_over += len(mon.generations.pending)
        assert value(mon, "perfmon_generation_requests_total", model="gpt2", outcome="ok") == i
        assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == i * NEW
        assert mon.stats()["generation"]["gpt2"]["in_flight"] == 0
    assert handed_over >= 1


def test_beam_search_over_a_prompt_of_embeddings_counts_the_new_tokens(make_monitor) -> None:
    """A decoder-only prompt given as inputs_embeds alone: generate() returns the new tokens alone, and beam search
    (read from the returned sequences) counts all of them, the prompt's real tokens apart."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="gpt2")
    ids = torch.randint(0, 99, (1, PROMPT))
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(ids)
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, num_beams=2, do_sample=False)
    assert out.shape == (1, NEW)  # no prompt in it
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["generated_tokens"] == NEW and gen["prompt_tokens"] == PROMPT


@pytest.mark.parametrize("rate", [1.0, 1e-6])
def test_a_call_that_raises_counts_the_tokens_its_caller_received(make_monitor, rate: float) -> None:
    """generate() raising at its 4th stop check: without a streamer of the caller's no token reached the caller (its
    request counts none, timed or not); with one, the tokens the streamer got. The exception passes unchanged."""

    class Boom(RuntimeError):
        pass

    class RaiseAt(transformers.StoppingCriteria):  # type: ignore[misc]
        def __init__(self, step: int) -> None:
            self.step, self.seen = step, 0

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.seen += 1
            if self.seen == self.step:
                raise Boom("step 4")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class Count(transformers.generation.streamers.BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.puts = 0

        def put(self, value: Any) -> None:
            self.puts += 1

        def end(self) -> None:
            pass

    mon = make_monitor(sample_rate=0.01, generation_sample_rate=rate, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    _generate(model, batch=1)  # the first call (timed either way)
    for streamer in (None, Count()):
        with pytest.raises(Boom):
            _generate(model, batch=1, stopping_criteria=transformers.StoppingCriteriaList([RaiseAt(4)]),
                      streamer=streamer)
    assert streamer is not None and streamer.puts >= 3  # the prompt, then the tokens handed out before the raise
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"] == {"ok": 1, "error": 2, "cancelled": 0}
    assert gen["generated_tokens"] == NEW + streamer.puts - 1


def test_a_generate_of_its_own_that_takes_a_streamer_keeps_the_tap_on_every_call(make_monitor) -> None:
    """A model whose generate() is not transformers' (remote code, a user's) may return anything: whatever the
    generation sample rate, every call gets perfmon's streamer, and its requests count the tokens it put."""

    class OwnLoop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None, use_cache: bool = True) -> Any:
            return self.lin(torch.ones(input_ids.shape[0], 4))

        def generate(self, input_ids: torch.Tensor, streamer: Any = None, steps: int = 4) -> list[str]:
            if streamer is not None:
                streamer.put(input_ids)  # the prompt first, as transformers does
            for _ in range(steps):
                self(input_ids=input_ids[:, :1])
                if streamer is not None:
                    streamer.put(torch.ones(1, dtype=torch.long))
            if streamer is not None:
                streamer.end()
            return ["text"]  # no sequences to count from

    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1e-6, sample_floor_seconds=3600.0)
    model = mon.wrap(OwnLoop(), name="own")
    for _ in range(3):
        assert model.generate(torch.ones(1, 3, dtype=torch.long)) == ["text"]
    mon.generations.drain()
    gen = mon.stats()["generation"]["own"]
    assert gen["requests"]["ok"] == 3 and gen["generated_tokens"] == 12
    assert gen["time_to_first_token"]["count"] == 3


def _ran(model: Any) -> list[None]:
    """Ground truth: a forward pre-hook appends one item for every forward that really ran (read with len())."""
    seen: list[None] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(None))
    return seen


def _calls(mon: perfmon.Monitor, stage: str) -> float:
    return value(mon, "perfmon_forward_calls_total", model="gpt2", stage=stage) or 0.0


def test_lean_decode_steps_are_counted_in_batches_and_exactly_when_the_call_ends(make_monitor) -> None:
    """Inside transformers' own generate(), the decode steps after a checked one run the forward and leave their
    counting to the next checked step or the call's end (at most LEAN_STEPS of them): a read while the call runs
    misses no more than that, a read after it returns (or raises) counts every forward, with its items; a step that
    raises in between is counted once and reaches the caller unchanged. (The calls ask for their cache implementation
    by name: a call that asks for none would run quiet, its decode steps counted from its cache when it returns:
    test_quiet_calls_count_their_decode_steps_from_the_cache_when_they_return.)"""
    from perfmon.agent.active import LEAN_STEPS

    mon = make_monitor(sample_rate=0.001, warmup_calls=1, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _ran(model)
    lags: list[int] = []
    lean = {"cache_implementation": "dynamic"}  # a DynamicCache, as with none asked for; not quiet

    class Reads(transformers.StoppingCriteria):  # type: ignore[misc]
        """At every step (after its forward), how many forwards ran that perfmon does not count yet."""

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            ran = len(truth)
            lags.append(ran - int(_calls(mon, "prefill") + _calls(mon, "decode")))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    new = 40
    for i in range(1, 4):
        _generate(model, batch=2, new=new, stopping_criteria=transformers.StoppingCriteriaList([Reads()]), **lean)
        assert _calls(mon, "prefill") + _calls(mon, "decode") == len(truth) == i * new
    assert _calls(mon, "decode") == 3 * (new - 1)
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 2 * 3 * new  # 2 rows, every forward
    assert min(lags) >= 0 and max(lags) <= LEAN_STEPS
    assert max(lags[new:]) > 0  # the calls after the first (not timed) took the lean steps

    class Broken(Exception):
        pass

    def fail(module: Any, args: Any, kwargs: Any) -> None:
        if len(truth) == 3 * new + 25:  # the 25th decode step of the fourth call: a lean one
            raise Broken("step 25")

    handle = model.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(Broken, match="step 25"):
        _generate(model, batch=2, new=new, **lean)
    handle.remove()
    assert value(mon, "perfmon_forward_errors_total", model="gpt2", exception="Broken") == 1
    assert _calls(mon, "prefill") + _calls(mon, "decode") == len(truth) == 3 * new + 25


def _timed(mon: perfmon.Monitor, stage: str) -> float:
    return sum(value(mon, "perfmon_forward_duration_seconds_count", model="gpt2", device="cpu", stage=stage,
                     phase=phase) or 0.0 for phase in ("cold", "steady"))


@pytest.mark.parametrize("quiet", [False, True])
def test_decode_steps_of_untimed_calls_keep_the_sampling_rate(make_monitor, quiet: bool) -> None:
    """A lean stretch ends at the decode stage's next sampling index: that step is checked and timed, so calls not
    timed still give 1 in 1/sample_rate of their steps (a stretch of LEAN_STEPS past it would give ~1 in 17). A quiet
    call times none of its decode steps: the stage's timed steps are then those of the calls that time every step (one
    in 1/sample_rate), which is the same share; its prefill is sampled as any other forward."""
    mon = make_monitor(sample_rate=0.2, warmup_calls=1, generation_sample_rate=1e-6, sample_floor_seconds=3600.0)
    model = mon.wrap(_gpt2(), name="gpt2")
    new, calls = 40, 40
    lean = {} if quiet else {"cache_implementation": "dynamic"}  # a DynamicCache either way; named: not quiet
    for _ in range(calls):
        _generate(model, batch=1, new=new, **lean)
    assert mon.flush()
    steps = calls * new
    every_step = calls // 5 * new  # calls 0, 5, 10... time every forward (one in 1/sample_rate calls)
    assert _calls(mon, "prefill") + _calls(mon, "decode") == steps
    sampled = _timed(mon, "prefill") + _timed(mon, "decode") - every_step
    if not quiet:
        assert sampled >= 0.6 * (steps - every_step) * 0.2, sampled  # ~1 in 5 of the other calls' forwards
        return
    # The other calls: their prefills at ~1 in 5 (and the decode stage's cold steps), their decode steps never.
    assert sampled <= 0.6 * (calls - calls // 5) + 16, sampled
    share = _timed(mon, "decode") / _calls(mon, "decode")
    assert 0.15 <= share <= 0.3, share


def test_decode_signatures_carry_over_between_calls_only_when_the_steps_match(make_monitor) -> None:
    """A call's first decode step takes the call before's signature when it has as many input elements and keywords
    and the same kind of cache; another batch size is a signature of its own, before and after."""
    mon = make_monitor(sample_rate=0.001, warmup_calls=1)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = _ran(model)
    for batch in (1, 1, 2, 2, 1, 3, 1):
        _generate(model, batch=batch, new=8)
    assert _calls(mon, "decode") == 7 * 7 and len(truth) == 7 * 8
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 8 * (1 + 1 + 2 + 2 + 1 + 3 + 1)
    assert mon.flush()
    assert mon.stats()["models"]["gpt2"]["stages"]["decode"]["input_signatures"] == 3  # 1, 2 and 3 rows x 1


def test_a_generate_given_a_cache_with_a_prefix_asks_the_stage_of_its_first_forward(make_monitor) -> None:
    """generate() given no cache makes an empty one: its first forward is the prefill, without asking the cache.
    Given the caller's cache of an earlier call, the first forward runs against a prefix: the stage function reads
    the cache (decode, as for any step against a cache that holds tokens)."""
    mon = make_monitor(sample_rate=0.001, warmup_calls=1)
    model = mon.wrap(_gpt2(), name="gpt2")
    ids = torch.randint(0, 100, (1, PROMPT))
    key = cache_key(model)
    with torch.inference_mode():
        first = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert _calls(mon, "prefill") == 1 and _calls(mon, "decode") == 3
        cache = getattr(first, "past_key_values", None) or getattr(first, "cache", None)
        assert cache is not None and cache.get_seq_length() > 0
        model.generate(first.sequences, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{key: cache})
    assert _calls(mon, "prefill") == 1  # the continuation's first forward: against the prefix, not a prefill
    assert _calls(mon, "decode") == 3 + 4


@pytest.mark.parametrize("rows", [1, 2])
def test_a_call_that_times_nothing_is_in_flight_from_its_start_and_its_output_is_not_kept(make_monitor,
                                                                                         rows: int) -> None:
    """A generate() call that times nothing (no tap, no streamer of the caller's, no assistant) opens and settles its
    requests through the tracker's pending queue, run by the next read or drain: a read while it runs sees its
    requests in flight since the call began, a read after it returns counts them exactly (a call of one row opened in
    flight, and one opened after it returned, counted whole, alike), and what it returned is not kept for that (an
    output of ``return_dict_in_generate`` holds the KV cache: freed with the caller's reference)."""
    import gc
    import weakref

    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1e-6, sample_floor_seconds=3600.0).start()
    model = mon.wrap(_gpt2(), name="gpt2")
    _generate(model, batch=1)  # the first call: timed
    seen: list[tuple[int, float, float]] = []

    class Reads(transformers.StoppingCriteria):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if len(seen) < 2:
                gen = mon.stats()["generation"]["gpt2"]
                seen.append((gen["in_flight"], gen["oldest_in_flight_seconds"], time.perf_counter() - began))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    began = time.perf_counter()
    _generate(model, batch=rows, stopping_criteria=transformers.StoppingCriteriaList([Reads()]))
    for in_flight, oldest, since in seen:
        assert in_flight == rows and oldest is not None and 0 < oldest <= since
    assert seen[1][1] > seen[0][1]  # the same requests, older at the second step
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["in_flight"] == 0 and gen["requests"]["ok"] == 1 + rows and gen["generated_tokens"] == (1 + rows) * NEW
    _generate(model, batch=1)  # opened after it returned (no read in between): counted whole
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["in_flight"] == 0 and gen["requests"]["ok"] == 2 + rows and gen["generated_tokens"] == (2 + rows) * NEW
    mon.generations.drain()
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="gpt2") == 1  # the first call's only
    assert value(mon, "perfmon_generation_duration_seconds_count", model="gpt2") == 2 + rows
    assert value(mon, "perfmon_generation_output_tokens_sum", model="gpt2") == (2 + rows) * NEW
    assert value(mon, "perfmon_generation_prompt_tokens_sum", model="gpt2") == (2 + rows) * PROMPT
    assert value(mon, "perfmon_prompt_tokens_total", model="gpt2") == (2 + rows) * PROMPT

    ids = torch.randint(0, 100, (1, PROMPT))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert cache is not None
    gone = weakref.ref(cache)
    del out, cache
    gc.collect()
    assert gone() is None  # before any read: perfmon kept the sequences, not the output
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == (3 + rows) * NEW
