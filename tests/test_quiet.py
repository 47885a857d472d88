"""Quiet decoding: untimed generate() calls whose decode steps run with no perfmon code, counted from the cache.

Ground truth is taken apart from perfmon: a forward pre-hook on the model appends one item for every forward that
really ran (and says which object ran it: a quiet call runs on a view of the model), forward hooks on its submodules
raise where a test needs a step to fail, and the sequences generate() returns are the caller's own view.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

import pytest
import torch

import perfmon

from .conftest import cache_key, value, wait_capture

transformers = pytest.importorskip("transformers")

PROMPT = 5


def _gpt2(eos: int = 100) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=128,
                                  bos_token_id=100, eos_token_id=eos, pad_token_id=100)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _running(model: Any) -> Any:
    """From inside a forward of one of ``model``'s submodules: the object the model's own forward runs on (the model,
    or a quiet call's view of it), read off the innermost frame up the stack whose ``self`` is a GPT-2."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        me = frame.f_locals.get("self")
        if isinstance(me, transformers.GPT2LMHeadModel):
            return me
        frame = frame.f_back
    raise AssertionError("no frame of the model's forward above this one")


class Truth:
    """Every forward that ran, by the object it ran on (the model, or a quiet call's view of it). Counted on the model's
    first submodule (a hook on the model itself keeps its calls off views: test_a_hook_on_the_model_is_given_the_model),
    which runs once a forward, and read off the stack."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.ran: list[bool] = []  # True: on a view
        model.transformer.register_forward_pre_hook(lambda module, args: self.ran.append(_running(model) is not model))

    @property
    def forwards(self) -> int:
        return len(self.ran)

    @property
    def on_views(self) -> int:
        return sum(self.ran)


def _generate(model: Any, batch: int = 2, new: int = 12, **kw: Any) -> torch.Tensor:
    ids = torch.randint(0, 100, (batch, PROMPT))
    kw.setdefault("min_new_tokens", new)
    kw.setdefault("do_sample", False)
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **kw)


def _calls(mon: perfmon.Monitor, stage: str) -> float:
    return value(mon, "perfmon_forward_calls_total", model="gpt2", stage=stage) or 0.0


def _forwards(mon: perfmon.Monitor) -> float:
    return _calls(mon, "prefill") + _calls(mon, "decode")


def _monitor(make_monitor: Any, **kw: Any) -> perfmon.Monitor:
    """1% sampling (only the first call times every step), no call's tokens timed after the first, one warm-up call
    a stage (a prefill stage's warm-up is one call a ``generate()``: its warm-up calls are timed, never quiet): every
    call after the second is one that can run quiet."""
    kw.setdefault("warmup_calls", 1)
    kw.setdefault("sample_rate", 0.01)
    kw.setdefault("generation_sample_rate", 1e-6)
    kw.setdefault("sample_floor_seconds", 3600.0)
    return make_monitor(**kw)


@pytest.mark.parametrize("mode", ["greedy", "sample", "returned sequences", "beam"])
def test_quiet_calls_count_every_forward_with_its_items_and_signature(make_monitor, mode: str) -> None:
    """Calls after the first two (the first times every step; the second finds the decode signature) run on a view,
    their decode steps bare: calls, items and the decode signature's calls are the same as the hooks saw. Beam search
    calls its model with ``self()`` a step: it never runs quiet, and its steps are counted one by one, exactly too."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    kw: dict[str, Any] = {
        "greedy": {},
        "sample": {"do_sample": True, "top_k": 5},
        "returned sequences": {"do_sample": True, "num_return_sequences": 3},
        "beam": {"num_beams": 3},
    }[mode]
    rows = 2 * (3 if mode in ("returned sequences", "beam") else 1)
    calls, new = 12, 10
    for _ in range(calls):
        out = _generate(model, new=new, **kw)
        assert out.shape[0] == 2 * (3 if mode == "returned sequences" else 1)
    assert _forwards(mon) == truth.forwards == calls * new
    assert _calls(mon, "prefill") == calls
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == rows * calls * new
    if mode == "beam":
        assert truth.on_views == 0  # beam search calls self() a step: never quiet, every step counted on its path
    else:
        assert truth.on_views == 10 * new  # every call but the first two ran quiet
    decode = mon.stats()["models"]["gpt2"]["stages"]["decode"]
    assert decode["calls"] == calls * (new - 1) and decode["input_signatures"] == 1
    assert "__call__" not in model.__dict__ and type(model).__name__ == "GPT2LMHeadModel"


def test_options_set_in_the_models_generation_config_decide_as_the_calls_own(make_monitor) -> None:
    """Beam search set in the model's generation config (not the call's keywords) is read as generate() reads it:
    its calls never run quiet and every step is counted, and the call's own keyword wins over the config's. Back to one
    beam in the config, calls run quiet again."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new = 5
    model.generation_config.num_beams = 3
    for _ in range(5):
        assert _generate(model, new=new).shape[0] == 2
    assert truth.on_views == 0 and _forwards(mon) == truth.forwards
    for _ in range(4):  # the call's own num_beams=1 wins over the config's 3
        _generate(model, new=new, num_beams=1)
    assert truth.on_views > 0 and _forwards(mon) == truth.forwards
    views = truth.on_views
    model.generation_config.num_beams = 1
    for _ in range(4):
        _generate(model, new=new)
    assert truth.on_views > views and _forwards(mon) == truth.forwards
    assert _calls(mon, "prefill") == 13


def test_options_a_config_holds_on_its_class_or_comes_with_the_call_decide_too(make_monitor) -> None:
    """Beam search set where the common read does not look (a config class's own attribute, not the config's) or in a
    config passed as the call's ``generation_config=``: its calls never run quiet and every step is counted, as for
    beam search set anywhere else; calls with one beam run quiet."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)

    class Beams(transformers.GenerationConfig):
        num_beams = 3  # the class's, once the instance's own is gone

    cfg = Beams(**model.generation_config.to_dict())
    del cfg.__dict__["num_beams"]
    assert cfg.num_beams == 3
    model.generation_config = cfg
    for _ in range(4):
        assert _generate(model, new=5).shape[0] == 2
    assert truth.on_views == 0 and _forwards(mon) == truth.forwards
    model.generation_config = transformers.GenerationConfig(**cfg.to_dict())
    model.generation_config.num_beams = 1
    for _ in range(4):
        _generate(model, new=5)
    views = truth.on_views
    assert views > 0 and _forwards(mon) == truth.forwards
    passed = transformers.GenerationConfig(**model.generation_config.to_dict())
    passed.num_beams = 3
    for _ in range(4):
        _generate(model, new=5, generation_config=passed)
    assert truth.on_views == views and _forwards(mon) == truth.forwards


def test_a_quiet_calls_prefill_is_counted_under_its_own_prompts_signature(make_monitor) -> None:
    """A quiet call's prefill is counted at its end under the signature a lean call of the same rows, keywords and
    prompt length taught (QuietDecode.learn): prompts of other rows or lengths, one after another, are each counted
    under their own signature, with their own rows as items."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    shapes = [(1, 5), (1, 5), (1, 5), (2, 5), (1, 9), (2, 5), (1, 5), (1, 9), (1, 9), (2, 5)] * 2
    new = 4
    for rows, length in shapes:
        ids = torch.randint(0, 100, (rows, length))
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
    assert truth.on_views > 0  # some calls ran quiet (every shape's calls after its decode signature was found)
    assert _forwards(mon) == truth.forwards
    assert _calls(mon, "prefill") == len(shapes)
    # Items are rows a forward, the prefill's and each decode step's: a prefill counted under another rows' signature
    # would be off by its rows.
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == sum(rows * new for rows, _ in shapes)
    assert mon.stats()["models"]["gpt2"]["stages"]["prefill"]["input_signatures"] == len(set(shapes))


def test_quiet_calls_count_their_decode_steps_from_the_cache_when_they_return(make_monitor) -> None:
    """A read while a quiet call runs does not see its decode steps yet (up to all of them); a read after it returns
    sees every forward. Its tokens and requests are the caller's, as with any untimed call."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    lags: list[int] = []

    class Reads(transformers.StoppingCriteria):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            lags.append(truth.forwards - int(_forwards(mon)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    new = 20
    for i in range(1, 5):
        lags.clear()
        _generate(model, new=new, stopping_criteria=transformers.StoppingCriteriaList([Reads()]))
        assert _forwards(mon) == truth.forwards == i * new
    assert truth.on_views == 2 * new
    assert lags[-1] == new  # the last call's forwards, all of them (its prefill too), while it ran
    assert mon.flush()
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"]["ok"] == 4 * 2 and gen["generated_tokens"] == 4 * 2 * new


def test_a_quiet_call_that_stops_early_counts_the_steps_it_ran(make_monitor) -> None:
    """One sequence stops at its EOS before max_new_tokens: the steps that ran, not the ones asked for."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    torch.manual_seed(1)
    lengths = []
    for new in (30, 30, 30, 7, 30, 30, 30, 30):  # the 4th call is cut by max_new_tokens, the others by an EOS drawn
        ids = torch.randint(0, 100, (1, PROMPT))
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=2, do_sample=True, top_k=20,
                                 eos_token_id=list(range(8)))
        lengths.append(out.shape[-1] - PROMPT)
        assert 2 <= lengths[-1] <= new
        assert _forwards(mon) == truth.forwards
    assert truth.on_views == sum(lengths[2:])
    assert min(lengths[2:]) < 7  # some quiet call stopped at its EOS


def _fail_at(module: torch.nn.Module, truth: Truth, at: int, *, pre: bool) -> Any:
    class Broken(Exception):
        pass

    def check(*_: Any) -> None:
        if truth.forwards == at:
            raise Broken(f"forward {at}")

    handle = module.register_forward_pre_hook(check) if pre else module.register_forward_hook(check)
    return Broken, handle


@pytest.mark.parametrize("where", ["before the first layer", "in the last layer", "after every layer",
                                   "a stopping criterion", "the prefill", "the prefill's first layer",
                                   "the prefill's inputs"])
def test_a_quiet_call_that_raises_counts_each_forward_and_error_once(make_monitor, where: str) -> None:
    """A quiet forward raises (a decode step, or the prefill): the caller gets its exception unchanged, the error is
    counted once (never for an error outside the model's forward) under its stage, and the calls are the forwards that
    ran, the one that raised included, wherever in the forward it raised; an error preparing the prefill's inputs ran
    no forward."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new = 12
    for _ in range(3):
        _generate(model, new=new)
    assert truth.on_views == new
    prefill = where.startswith("the prefill")
    # The 6th forward of the 4th call (its 5th decode step), or its 1st (its prefill): quiet either way.
    at = 3 * new + (1 if prefill else 6)
    blocks = model.transformer.h
    if where == "the prefill's inputs":
        class Broken(Exception):
            pass

        own = model.prepare_inputs_for_generation
        before = at - 1  # the 4th call's first: its prefill's

        @functools.wraps(own)  # generate() checks its keywords against this signature
        def prepare(*args: Any, **kwargs: Any) -> Any:
            if truth.forwards == before:
                raise Broken("inputs")
            return own(*args, **kwargs)

        model.prepare_inputs_for_generation = prepare  # the model's dict: the view's too
        kw: dict[str, Any] = {}
        handle = None
        at -= 1  # no forward ran
    elif where == "a stopping criterion":
        class Broken(Exception):
            pass

        class Stop(transformers.StoppingCriteria):  # type: ignore[misc]
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
                if truth.forwards == at:
                    raise Broken("criterion")
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        kw = {"stopping_criteria": transformers.StoppingCriteriaList([Stop()])}
        handle = None
    else:
        module, pre = {"before the first layer": (model.transformer.wte, True),
                       "in the last layer": (blocks[-1].mlp, True),
                       "after every layer": (model.lm_head, True),
                       "the prefill": (model.lm_head, True),
                       "the prefill's first layer": (model.transformer.wte, True)}[where]
        Broken, handle = _fail_at(module, truth, at, pre=pre)
        kw = {}
    with pytest.raises(Broken):
        _generate(model, new=new, **kw)
    if handle is not None:
        handle.remove()
    if where == "the prefill's inputs":
        del model.prepare_inputs_for_generation
    assert truth.forwards == at
    assert _forwards(mon) == at
    assert _calls(mon, "prefill") == 4 - (where == "the prefill's inputs")
    errors = value(mon, "perfmon_forward_errors_total", model="gpt2", exception="Broken") or 0.0
    assert errors == (0 if where in ("a stopping criterion", "the prefill's inputs") else 1)
    _generate(model, new=new)  # the next call is counted as before
    assert _forwards(mon) == truth.forwards == at + new


def test_quiet_calls_on_threads_at_once_count_exactly(make_monitor) -> None:
    """Thread-per-request: several threads generate on one model at once, each call on its own view."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new, per_thread = 8, 6
    _generate(model, new=new)
    _generate(model, new=new)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(per_thread):
                _generate(model, new=new)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert _forwards(mon) == truth.forwards == (2 + 4 * per_thread) * new
    assert truth.on_views > 0


def test_calls_that_cannot_run_quiet_do_not(make_monitor) -> None:
    """The first call (every step timed), a call given a cache or a cache implementation, a batch not seen before and
    a compiled model's call run on the model itself, counted step by step."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new = 6
    _generate(model, new=new)
    _generate(model, new=new)
    assert truth.on_views == 0
    _generate(model, new=new)
    assert truth.on_views == new
    cache = transformers.DynamicCache(config=model.config)
    _generate(model, new=new, **{cache_key(model): cache})
    _generate(model, new=new, cache_implementation="dynamic")
    _generate(model, batch=3, new=new)  # 3 rows: its decode signature is not known yet
    assert truth.on_views == new
    _generate(model, batch=3, new=new)  # now it is
    assert truth.on_views == 2 * new
    assert _forwards(mon) == truth.forwards


def test_a_call_in_a_request_span_is_not_quiet_and_a_capture_waits_for_the_next_call(make_monitor) -> None:
    """Inside ``monitor.request()`` a call runs on perfmon's path, not quiet: the span's model part is from its first
    forward's start (which a quiet call's bare prefill could not stamp) to past its last forward's end. A capture
    armed while a quiet call runs gets the next call's forwards (which is not quiet while the capture waits)."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    ends: list[int] = []
    starts: list[int] = []
    # Inside the model's forward (a hook on the model itself would keep its calls off views).
    model.transformer.register_forward_hook(lambda module, args, out: ends.append(time.perf_counter_ns()))
    model.transformer.register_forward_pre_hook(lambda module, args: starts.append(time.perf_counter_ns()))
    armed: list[dict[str, Any]] = []
    arm = [False]

    class Arm(transformers.StoppingCriteria):  # type: ignore[misc]
        """Arms a capture of the model at the 3rd step of the call that asks for it."""

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if arm[0] and not armed and input_ids.shape[-1] == PROMPT + 3:
                armed.append(mon.capture("gpt2", steps=4))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    criteria = transformers.StoppingCriteriaList([Arm()])  # every call the same keywords: one shape
    for _ in range(3):
        _generate(model, new=8, stopping_criteria=criteria)
    assert truth.on_views == 8
    starts.clear()
    with mon.request("chat") as req:
        _generate(model, new=8, stopping_criteria=criteria)
    assert truth.on_views == 8
    assert req.model == "gpt2" and req.model_end_ns is not None and req.model_end_ns >= ends[-1]
    assert req.model_start_ns is not None and req.model_start_ns <= starts[0]
    _generate(model, new=8, stopping_criteria=criteria)
    assert truth.on_views == 16  # out of the span: quiet again

    arm[0] = True
    _generate(model, new=8, stopping_criteria=criteria)
    assert armed and truth.on_views == 24  # that call ran quiet to its end
    _generate(model, new=8, stopping_criteria=criteria)
    assert truth.on_views == 24  # the next one ran through perfmon's path, into the capture
    meta = wait_capture(mon, armed[0]["id"], timeout=60)
    assert meta["outcome"] == "ok", meta
    assert meta["steps_recorded"] == 4
    assert _forwards(mon) == truth.forwards


def test_a_view_sees_the_models_attributes_as_they_are_at_each_call(make_monitor) -> None:
    """Views are kept for later calls, and a view's dict is the model's own: an attribute set, changed or deleted on
    the model between two calls is what the next quiet call's forwards see."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    seen: list[tuple[bool, Any]] = []

    def see(_module: Any, _args: Any) -> None:
        top = _running(model)
        seen.append((top is not model, getattr(top, "marker", None)))

    model.transformer.register_forward_pre_hook(see)
    for _ in range(3):
        _generate(model, new=4)
    for marker in (1, 2, None, 3, "swap"):
        if marker is None:
            del model.marker
        elif marker == "swap":  # one attribute gone and another come: as many as before
            del model.marker
            model.other = 1
        else:
            model.marker = marker
        seen.clear()
        _generate(model, new=4)
        assert seen[0] == (True, None if marker == "swap" else marker)  # a quiet call's prefill, on its view
    assert "__call__" not in model.__dict__


def test_a_dropped_model_is_freed_with_the_views_of_its_quiet_calls(make_monitor) -> None:
    """The views kept for later calls hold what the model's dict held: a model dropped or unwrapped (its returned
    calls settled by a read) leaves nothing of perfmon's holding its weights."""
    import gc
    import weakref

    mon = _monitor(make_monitor)
    for i, drop in enumerate(("del", "unwrap")):
        model = mon.wrap(_gpt2(), name="gpt2")
        for _ in range(4):
            _generate(model, new=4)
        assert mon.stats()["models"]["gpt2"]["calls"] == 16 * (i + 1)  # the name's series goes on
        weight = weakref.ref(model.transformer.wte.weight)
        if drop == "unwrap":
            mon.unwrap(model)
        del model
        gc.collect()
        assert weight() is None, drop


def test_untimed_calls_of_one_row_count_the_callers_tokens_prompt_and_padding(make_monitor) -> None:
    """Untimed calls of one sequence (settled without a GenerateCall: latecall.LateCall._settle_one): prompt tokens are
    the mask's ones and padding its zeros, generated tokens the returned sequence's columns after the prompt (it stops
    right after its EOS), and a call that raises ends its request as ``error`` with no tokens. The truth is the
    caller's own: its masks and the sequences it got back."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    torch.manual_seed(3)
    prompt = padding = generated = 0
    calls = 0
    # (a prompt over 64 tokens is summed by torch, a shorter one read as a list: _settle_one)
    for pad, new in ((0, 9), (2, 9), (0, 25), (3, 25), (1, 25), (0, 25), (4, 6), (0, 25), (66, 6), (0, 6)):
        ids = torch.randint(0, 100, (1, PROMPT + pad))
        mask = torch.ones_like(ids)
        mask[0, :pad] = 0  # left padding
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=1, do_sample=True,
                                 top_k=20, eos_token_id=list(range(6)), pad_token_id=100)
        prompt += int(mask.sum())
        padding += pad
        generated += out.shape[-1] - ids.shape[-1]
        calls += 1
    Broken, handle = _fail_at(model.lm_head, Truth(model), 1, pre=True)  # the next forward raises: the prefill
    with pytest.raises(Broken), torch.inference_mode():
        model.generate(torch.randint(0, 100, (1, PROMPT)), max_new_tokens=4)
    handle.remove()
    prompt += PROMPT
    assert mon.flush()
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"]["ok"] == calls and gen["requests"]["error"] == 1
    assert gen["generated_tokens"] == generated
    assert gen["prompt_tokens"] == prompt and gen["prompt_padding_tokens"] == padding
    assert value(mon, "perfmon_generation_in_flight", model="gpt2") in (0.0, None)


def test_with_churned_prefill_signatures_prompts_of_any_length_run_quiet(make_monitor) -> None:
    """A server's prompts of many lengths churn the prefill stage's signatures (``signature_cache_size``): it stops
    tracking them, and from then on one call of a shape teaches quiet decoding for every prompt length of it. Each quiet
    prefill is counted once with its rows as items; prompts of lengths never seen before run quiet."""
    mon = _monitor(make_monitor, signature_cache_size=4)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new = 4
    lengths = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] + list(range(13, 33))
    quiet_from = None
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 100, (2, length))
        before = truth.on_views
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
        if truth.on_views > before and quiet_from is None:
            quiet_from = i
    assert quiet_from is not None and quiet_from < 12
    assert truth.on_views == new * (len(lengths) - quiet_from)  # every call since: each a prompt length of its own
    assert _forwards(mon) == truth.forwards
    assert _calls(mon, "prefill") == len(lengths)
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 2 * new * len(lengths)


def test_a_prefill_in_chunks_never_runs_quiet(make_monitor) -> None:
    """``prefill_chunk_size`` (the call's, or the model's generation config's) runs a long prompt's prefill as several
    forwards: such calls never run quiet (a quiet call counts one prefill forward), and every forward is counted."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    new = 4
    for chunk_in in ("call", "config"):
        for length in (9, 9, 9, 4, 4, 9, 13):
            ids = torch.randint(0, 100, (1, length))
            kw: dict[str, Any] = {"prefill_chunk_size": 4} if chunk_in == "call" else {}
            if chunk_in == "config":
                model.generation_config.prefill_chunk_size = 4
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, **kw)
        assert truth.on_views == 0, chunk_in
        assert _forwards(mon) == truth.forwards
    model.generation_config.prefill_chunk_size = None
    for _ in range(3):
        _generate(model, new=new)
    assert truth.on_views > 0  # without chunks the same model's calls run quiet again
    assert _forwards(mon) == truth.forwards


def test_calls_of_one_token_run_quiet_and_teach_no_longer_calls(make_monitor) -> None:
    """``max_new_tokens=1`` (scoring, classification by generate()): the call runs its prefill only. After a lean call
    of its shape taught that (when it returned), later ones run quiet and count their one forward,
    its items and its tokens. A call of the same keywords asking for more tokens is not quiet on that alone: it runs
    on perfmon's path until a call of its own found its decode steps' signature, and every forward is counted."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    for _ in range(6):
        _generate(model, new=1, min_new_tokens=0)
    assert truth.on_views == 4  # not quiet: the first (every step timed; the prefill stage's warm-up), the teacher
    assert _forwards(mon) == truth.forwards == 6 and _calls(mon, "decode") == 0
    assert value(mon, "perfmon_forward_items_total", model="gpt2") == 2 * 6
    before = truth.on_views
    _generate(model, new=5, min_new_tokens=5)  # same keywords: max_new_tokens=5, not 1
    assert truth.on_views == before
    _generate(model, new=5, min_new_tokens=5)  # its decode steps' signature found: this one is quiet
    assert truth.on_views == before + 5
    _generate(model, new=1, min_new_tokens=0)
    assert truth.on_views == before + 6
    assert _forwards(mon) == truth.forwards == 6 + 5 + 5 + 1
    assert mon.flush()
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"]["ok"] == 2 * 9 and gen["generated_tokens"] == 2 * (7 * 1 + 2 * 5)


@pytest.mark.parametrize("hook", ["the model's own", "torch's global"])
def test_a_hook_on_the_model_is_given_the_model(make_monitor, hook: str) -> None:
    """A forward hook on the model (its own, or torch's process-wide one) is given the module called: with a hook in
    place every call runs on the model itself, so a hook that keys on the module finds the model each forward, and the
    forwards are counted as they ran; with it removed, calls run quiet again."""
    mon = _monitor(make_monitor)
    model = mon.wrap(_gpt2(), name="gpt2")
    truth = Truth(model)
    last: dict[Any, torch.Tensor] = {}
    seen: list[bool] = []

    def keep(module: Any, args: Any, out: Any) -> None:
        if isinstance(module, transformers.GPT2LMHeadModel):
            seen.append(module is model)
            last[module] = out.logits

    if hook == "torch's global":
        handle = torch.nn.modules.module.register_module_forward_hook(keep)
    else:
        handle = model.register_forward_hook(keep)
    new = 6
    try:
        for _ in range(5):
            last.clear()
            _generate(model, new=new)
            assert model in last
    finally:
        handle.remove()
    assert len(seen) == 5 * new and all(seen)
    assert truth.on_views == 0 and _forwards(mon) == truth.forwards == 5 * new
    _generate(model, new=new)  # no hook: this call teaches its shape, the next runs quiet
    _generate(model, new=new)
    assert truth.on_views == new
    assert _forwards(mon) == truth.forwards == 7 * new
