"""Continuous batching (transformers' ContinuousBatchingManager): requests by id, steps by their mix, no user code.

A randomly initialised tiny GPT-2 (nothing downloaded) runs transformers' own continuous batching on CPU. The
ground truth is taken apart from perfmon: the manager's outputs (ids, prompt and generated tokens, its own
``created_time`` and per-token ``timestamps``), our clock when each result reaches us, and a forward pre-hook on
the module recording the tokens each forward carried (classified against the outputs' sequences).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from .conftest import value, wait_until

transformers = pytest.importorskip("transformers")
cb_api = pytest.importorskip("transformers.generation.continuous_batching")

# Distinct first tokens: a forward's chunk matches one request's sequence only.
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17], [18, 19, 20, 21], [22, 23, 24, 25, 26]]
NEW = 5
#: Timing tolerance (s): perfmon stamps at publication, transformers a few statements earlier; a busy CI core
#: can hold the GIL elsewhere for a switch interval (5 ms) between the two.
SLACK = 0.015


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """transformers' CB logger warns about psutil on CPU machines: not this test's business."""
    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=128,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _cb_config() -> Any:
    """A small cache sized by hand (CPU memory is not probed: ~10 s saved) and a 16-token step budget, so that
    prompts are split across steps and new prefills share steps with running decodes."""
    return transformers.ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=16,
                                                 max_requests_per_batch=8)


def _gen_config(new: int = NEW, **kw: Any) -> Any:
    kw.setdefault("eos_token_id", -1)  # no EOS: every request makes its max_new_tokens
    kw.setdefault("do_sample", False)
    return transformers.GenerationConfig(max_new_tokens=new, pad_token_id=100, **kw)


class Forwards:
    """Ground truth: a forward pre-hook on the module records each forward's chunks (positions and token ids)."""

    def __init__(self, model: Any) -> None:
        self.chunks: list[list[tuple[int, list[int]]]] = []
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"][0].tolist()
        pos = kwargs["position_ids"][0].tolist()
        cu = kwargs["cu_seq_lens_q"].tolist()
        self.chunks.append([(pos[a], ids[a:b]) for a, b in itertools.pairwise(cu) if b > a])

    def tokens(self, outputs: list[Any]) -> list[tuple[int, int]]:
        """(prefill, decode) tokens per forward: a chunk's positions before its request's prompt length are
        prefill. The request is the one whose prompt + generated tokens hold the chunk at its positions."""
        seqs = [(len(o.prompt_ids), list(o.prompt_ids) + list(o.generated_tokens)) for o in outputs]
        out = []
        for chunks in self.chunks:
            prefill = decode = 0
            for start, ids in chunks:
                splits = {min(max(n - start, 0), len(ids)) for n, seq in seqs if seq[start:start + len(ids)] == ids}
                assert len(splits) == 1, f"chunk at {start} {ids} matches no request, or several that disagree"
                p = splits.pop()
                prefill += p
                decode += len(ids) - p
            out.append((prefill, decode))
        return out


def _stage(prefill: int, decode: int) -> str:
    return "mixed" if prefill and decode else "decode" if decode else "prefill"


def _check_forwards(mon: Any, forwards: Forwards, outputs: list[Any]) -> list[tuple[int, int]]:
    """perfmon's forward labels and step tokens equal the hook's, forward by forward summed by stage."""
    truth = forwards.tokens(outputs)
    for stage in ("prefill", "decode", "mixed"):
        n = sum(1 for p, d in truth if _stage(p, d) == stage)
        assert (value(mon, "perfmon_forward_calls_total", model="m", stage=stage) or 0) == n, stage
    assert value(mon, "perfmon_batch_tokens_total", model="m", kind="prefill") == sum(p for p, _ in truth)
    assert value(mon, "perfmon_batch_tokens_total", model="m", kind="decode") == sum(d for _, d in truth)
    return truth


def _generation(mon: Any) -> dict[str, Any]:
    mon.generations.drain()
    return mon.stats()["generation"]["m"]


def test_generate_batch_counts_each_request_and_labels_mixed_steps(make_monitor) -> None:
    """generate_batch of 6 prompts on a wrapped model: 6 requests with their prompt and generated tokens, one TTFT
    each at the publication of its (single, non-streaming) output, and every forward labelled prefill, decode or
    mixed with the tokens it carried."""
    mon = make_monitor(sample_rate=1.0)
    model = mon.wrap(_gpt2(), name="m")
    forwards = Forwards(model)
    plain_call = type(model).__call__
    t0 = time.perf_counter()
    results = model.generate_batch(PROMPTS, generation_config=_gen_config(),
                                   continuous_batching_config=_cb_config())
    elapsed = time.perf_counter() - t0
    outputs = list(results.values())
    assert len(outputs) == len(PROMPTS) and all(o.error is None for o in outputs)
    assert type(model).__call__ is not plain_call  # the batching stage rule, installed on first use

    gen = _generation(mon)
    assert gen["requests"] == {"ok": len(PROMPTS), "error": 0, "cancelled": 0} and gen["in_flight"] == 0
    assert gen["prompt_tokens"] == sum(map(len, PROMPTS)) == sum(len(o.prompt_ids) for o in outputs)
    assert gen["generated_tokens"] == sum(len(o.generated_tokens) for o in outputs) == NEW * len(PROMPTS)
    assert value(mon, "perfmon_generation_output_tokens_sum", model="m") == NEW * len(PROMPTS)
    # Non-streaming: each request's tokens reach the caller in one output, the TTFT observation; no ITL.
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="m") == len(PROMPTS)
    assert not value(mon, "perfmon_inter_token_latency_seconds_count", model="m")
    # transformers stamps created_time when the request is made and lifespan[1] when its last token is in.
    truth = [o.lifespan[1] - o.created_time for o in outputs]
    ttft = gen["time_to_first_token"]
    assert ttft["count"] == len(PROMPTS)
    assert ttft["max_seconds"] == pytest.approx(max(truth), abs=SLACK)
    assert ttft["mean_seconds"] == pytest.approx(sum(truth) / len(truth), abs=SLACK)
    assert ttft["max_seconds"] <= elapsed

    steps = _check_forwards(mon, forwards, outputs)
    assert {_stage(p, d) for p, d in steps} == {"prefill", "decode", "mixed"}  # the 16-token budget mixes them
    assert sum(p for p, _ in steps) == sum(map(len, PROMPTS))  # every prompt token prefilled once (no prefix hit)
    assert sum(d for _, d in steps) == (NEW - 1) * len(PROMPTS)  # each later token is one decode input
    assert value(mon, "perfmon_internal_errors_total", stage="batching") is None


def _published(manager: Any, n: int, timeout: float = 10.0) -> None:
    """Wait until the manager has published ``n`` outputs (none consumed yet)."""
    wait_until(lambda: manager.output_router.output_queue.qsize() >= n, timeout=timeout,
               what=f"{n} published outputs")


def _get(manager: Any) -> Any:
    out = manager.get_result(timeout=10)
    assert out is not None, "no output within 10 s"
    return out


def _drain(manager: Any) -> list[Any]:
    out = []
    while (result := manager.get_result(timeout=0.01)) is not None:
        out.append(result)
    return out


def test_manager_requests_added_over_time_and_consumed_out_of_order(make_monitor) -> None:
    """init_continuous_batching + add_request over time, streaming, results read late and last request first
    (request_id_iter puts other requests' outputs back, so each request's own come out of order): each id is one
    request, its TTFT and ITL taken when the manager publishes, not when we read, and its tokens exact."""
    mon = make_monitor(sample_rate=1.0)
    model = mon.wrap(_gpt2(), name="m")
    forwards = Forwards(model)
    manager = model.init_continuous_batching(generation_config=_gen_config(),
                                             continuous_batching_config=_cb_config())
    lengths = [16, 16, 16, 8, 8, 8]
    manager.start()
    added: dict[str, float] = {}
    try:
        for prompt, new in zip(PROMPTS[:3], lengths):
            added[manager.add_request(prompt, max_new_tokens=new, streaming=True, record_timestamps=True)] = \
                time.perf_counter()
        _published(manager, 3)  # the first three are decoding when the next three arrive
        for prompt, new in zip(PROMPTS[3:], lengths[3:]):
            added[manager.add_request(prompt, max_new_tokens=new, streaming=True, record_timestamps=True)] = \
                time.perf_counter()
        _published(manager, sum(lengths))  # streaming: one output per token
        first_read: dict[str, float] = {}
        outputs: list[Any] = []
        for rid in reversed(list(added)):
            for out in manager.request_id_iter(rid):
                first_read.setdefault(rid, time.perf_counter())
                outputs.append(out)
        outputs += _drain(manager)  # what request_id_iter left behind when it met the final output first
    finally:
        manager.stop(block=True)
    finals = {o.request_id: o for o in outputs if o.is_finished()}
    assert list(finals) == list(reversed(list(added))) and all(o.error is None for o in finals.values())
    assert [len(finals[rid].generated_tokens) for rid in added] == lengths
    assert len(outputs) == sum(lengths)

    gen = _generation(mon)
    assert gen["requests"] == {"ok": len(PROMPTS), "error": 0, "cancelled": 0}
    assert gen["prompt_tokens"] == sum(map(len, PROMPTS)) and gen["generated_tokens"] == sum(lengths)
    # Published in order (one output per token), whatever order we read them in.
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="m") == len(PROMPTS)
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="m") == sum(lengths) - len(PROMPTS)
    # transformers' own per-token stamps (record_timestamps) are the publication times within a statement or two.
    ttft_truth = [o.timestamps[0] - o.created_time for o in finals.values()]
    itl_sum_truth = sum(o.timestamps[-1] - o.timestamps[0] for o in finals.values())
    ttft = gen["time_to_first_token"]
    assert ttft["max_seconds"] == pytest.approx(max(ttft_truth), abs=SLACK)
    assert ttft["mean_seconds"] == pytest.approx(sum(ttft_truth) / len(ttft_truth), abs=SLACK)
    assert value(mon, "perfmon_inter_token_latency_seconds_sum", model="m") == pytest.approx(
        itl_sum_truth, abs=SLACK * len(PROMPTS))
    # We read every result after the last was published: our waits are longer than any TTFT perfmon saw.
    waited = [first_read[rid] - added[rid] for rid in added]
    assert ttft["max_seconds"] < min(waited)

    steps = _check_forwards(mon, forwards, list(finals.values()))
    assert "mixed" in {_stage(p, d) for p, d in steps}  # arrivals mid-decode share steps with it
    assert value(mon, "perfmon_internal_errors_total", stage="batching") is None


def test_cancelled_request_counts_the_tokens_it_published(make_monitor) -> None:
    """cancel_request: the request ends cancelled when the scheduler drops it, with the tokens it published up to
    then (read back from the queue afterwards); the other request ends ok; requests a stopped manager never ran
    end cancelled at stop()."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    manager = model.init_continuous_batching(generation_config=_gen_config(100),
                                             continuous_batching_config=_cb_config())
    manager.start()
    try:
        long = manager.add_request(PROMPTS[0], streaming=True)
        short = manager.add_request(PROMPTS[1], streaming=True, max_new_tokens=6)
        outputs = []
        while not any(o.request_id == long for o in outputs):  # the long one has published: cancel it
            outputs.append(_get(manager))
        manager.cancel_request(long)
        while not any(o.request_id == short and o.is_finished() for o in outputs):
            outputs.append(_get(manager))
    finally:
        manager.stop(block=True)
    outputs += _drain(manager)  # the long request's outputs published before the cancellation took effect
    assert {o.request_id for o in outputs} == {long, short}
    assert not any(o.is_finished() for o in outputs if o.request_id == long)
    long_tokens = max(len(o.generated_tokens) for o in outputs if o.request_id == long)
    assert 1 <= long_tokens < 100

    gen = _generation(mon)
    assert gen["requests"] == {"ok": 1, "error": 0, "cancelled": 1} and gen["in_flight"] == 0
    assert gen["generated_tokens"] == 6 + long_tokens
    assert gen["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])

    idle = model.init_continuous_batching(generation_config=_gen_config(4), continuous_batching_config=_cb_config())
    idle.add_request(PROMPTS[2])  # queued, never run: the loop was never started
    idle.stop()
    assert _generation(mon)["requests"] == {"ok": 1, "error": 0, "cancelled": 2}


def test_a_failed_request_ends_error(make_monitor) -> None:
    """A request the manager fails (an unknown logits-processor argument) ends as error with no tokens; the
    request beside it is unaffected."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    manager = model.init_continuous_batching(generation_config=_gen_config(), continuous_batching_config=_cb_config())
    manager.start()
    try:
        good = manager.add_request(PROMPTS[0])
        bad = manager.add_request(PROMPTS[1], not_a_processor_argument=3)
        outputs = {o.request_id: o for o in (_get(manager), _get(manager))}
    finally:
        manager.stop(block=True)
    assert outputs[bad].error is not None and outputs[good].error is None
    gen = _generation(mon)
    assert gen["requests"] == {"ok": 1, "error": 1, "cancelled": 0}
    assert gen["generated_tokens"] == len(outputs[good].generated_tokens) == NEW


def test_async_handlers_and_a_persistent_manager(make_monitor) -> None:
    """Outputs routed to register_result_handler callbacks are tracked as the queue's are; a persistent manager
    reused by a second generate_batch is instrumented once (no request counted twice)."""
    import asyncio

    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    for _ in range(2):
        model.generate_batch(PROMPTS[:3], generation_config=_gen_config(), continuous_batching_config=_cb_config(),
                             persistent_manager=True)
    model.destroy_cached_continuous_batching_manager()
    gen = _generation(mon)
    assert gen["requests"]["ok"] == 6 and gen["generated_tokens"] == 6 * NEW
    assert value(mon, "perfmon_batch_tokens_total", model="m", kind="prefill") == 2 * sum(map(len, PROMPTS[:3]))

    manager = model.init_continuous_batching(generation_config=_gen_config(), continuous_batching_config=_cb_config())
    manager.start()

    async def serve() -> list[Any]:
        got: asyncio.Queue[Any] = asyncio.Queue()
        for i, prompt in enumerate(PROMPTS[:3]):
            manager.register_result_handler(f"h{i}", got.put_nowait)  # before the request: no output missed
            manager.add_request(prompt, request_id=f"h{i}", streaming=True)
        outs = []
        while sum(o.is_finished() for o in outs) < 3:
            outs.append(await asyncio.wait_for(got.get(), 10))
        return outs

    try:
        outs = asyncio.run(serve())
    finally:
        manager.stop(block=True)
    assert len(outs) == 3 * NEW
    gen = _generation(mon)
    assert gen["requests"]["ok"] == 6 + 3 and gen["generated_tokens"] == 9 * NEW
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="m") == 3 * (NEW - 1)


def test_forked_children_are_requests_of_their_own(make_monitor) -> None:
    """num_return_sequences=2: the scheduler forks a child per prompt (``req_N__child#0``); each is one request
    with its own tokens, started with its parent."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    results = model.generate_batch(PROMPTS[:2], generation_config=_gen_config(do_sample=True, num_return_sequences=2),
                                   continuous_batching_config=_cb_config())
    assert len(results) == 4 and sum("__child#" in rid for rid in results) == 2
    gen = _generation(mon)
    assert gen["requests"] == {"ok": 4, "error": 0, "cancelled": 0}
    assert gen["generated_tokens"] == sum(len(o.generated_tokens) for o in results.values())
    assert gen["prompt_tokens"] == sum(len(o.prompt_ids) for o in results.values())  # a child's is its parent's


def test_plain_generate_is_untouched_before_and_after_batching(make_monitor) -> None:
    """A model that never batches keeps the plain staged __call__; after batching, generate() forwards are still
    prefill/decode (the batching rule applies only to a manager's prepared steps)."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    plain_call = type(model).__call__
    ids = torch.tensor([PROMPTS[0]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert type(model).__call__ is plain_call
    model.generate_batch(PROMPTS[:2], generation_config=_gen_config(), continuous_batching_config=_cb_config())
    before = {s: value(mon, "perfmon_forward_calls_total", model="m", stage=s) or 0 for s in ("prefill", "decode")}
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    after = {s: value(mon, "perfmon_forward_calls_total", model="m", stage=s) or 0 for s in ("prefill", "decode")}
    assert after["prefill"] - before["prefill"] == 1 and after["decode"] - before["decode"] == 3
    assert _generation(mon)["requests"]["ok"] == 1 + 1 + 2  # generate(), generate(), the two batched


def test_generate_with_a_paged_cache_is_counted_once(make_monitor) -> None:
    """generate(cache_implementation="paged") hands over to generate_batch: its sequences are counted once, as
    continuous-batching requests, not also as generate() requests."""
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    ids = torch.tensor([PROMPTS[0][:4], PROMPTS[5][:4]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=100,
                         cache_implementation="paged", continuous_batching_config=_cb_config())
    assert tuple(out.shape) == (1, 2, 8)
    gen = _generation(mon)
    assert gen["requests"] == {"ok": 2, "error": 0, "cancelled": 0}
    assert gen["prompt_tokens"] == 8 and gen["generated_tokens"] == 8
    assert gen["time_to_first_token"]["count"] == 2


def test_manual_route_with_stream_stays_exact_out_of_order(make_monitor) -> None:
    """The manual route on an unwrapped model: monitor.stream over request_id_iter per request, with the user's
    own counter of new tokens (docs/metrics.md). Read interleaved, last request first, a request's own outputs
    come out of order (request_id_iter puts the others back) and some are left behind: the counter takes only
    what is new, so tokens are exact, one TTFT per request and one ITL per token after the first chunk."""

    class NewTokens:
        """The user's counter: an output holds every token so far; count only tokens not seen before."""

        def __init__(self) -> None:
            self.seen = 0

        def __call__(self, out: Any) -> int:
            n = max(0, len(out.generated_tokens) - self.seen)
            self.seen += n
            return n

    def recorded(it: Iterator[Any], into: list[Any]) -> Iterator[Any]:
        for out in it:
            into.append(out)
            yield out

    mon = make_monitor()
    manager = _gpt2().init_continuous_batching(generation_config=_gen_config(6),
                                               continuous_batching_config=_cb_config())
    manager.start()
    try:
        ids = [manager.add_request(p, streaming=True) for p in PROMPTS[:4]]
        _published(manager, 4 * 6)  # all published before we read: nothing waits on the reader (fast)
        seen: list[list[Any]] = [[] for _ in ids]
        streams = [mon.stream(recorded(manager.request_id_iter(rid), seen[i]), name="cb", prompt_tokens=len(p),
                              tokens=NewTokens()) for i, (rid, p) in enumerate(zip(ids, PROMPTS))]
        done: set[int] = set()
        while len(done) < len(streams):  # one output of each unfinished stream in turn, last request first
            for i in reversed(range(len(streams))):
                if i not in done and next(streams[i], None) is None:  # its final output was read: ended ok
                    done.add(i)
    finally:
        manager.stop(block=True)
    lengths = [[len(o.generated_tokens) for o in outs] for outs in seen]
    assert any(ls != sorted(ls) for ls in lengths)  # the point of the test: a request's outputs out of order
    assert all(max(ls) == 6 for ls in lengths)
    mon.generations.drain()
    gen = mon.stats()["generation"]["cb"]
    assert gen["requests"] == {"ok": 4, "error": 0, "cancelled": 0}
    assert gen["generated_tokens"] == 4 * 6 and gen["prompt_tokens"] == sum(map(len, PROMPTS[:4]))
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="cb") == 4
    first_chunks = sum(ls[0] for ls in lengths)  # the first output read holds the first chunk: its TTFT
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="cb") == 4 * 6 - first_chunks
    assert value(mon, "perfmon_internal_errors_total", stage="generation_tokens") is None


def test_a_fault_inside_perfmon_never_reaches_the_manager(make_monitor, monkeypatch: pytest.MonkeyPatch) -> None:
    """If perfmon's step bookkeeping fails, the fault is counted and generation completes unchanged."""
    from perfmon.agent import batching

    def broken(io: Any) -> tuple[int, int]:
        raise RuntimeError("a perfmon bug")

    monkeypatch.setattr(batching, "step_tokens", broken)
    mon = make_monitor()
    model = mon.wrap(_gpt2(), name="m")
    results = model.generate_batch(PROMPTS[:3], generation_config=_gen_config(),
                                   continuous_batching_config=_cb_config())
    assert [len(o.generated_tokens) for o in results.values()] == [NEW] * 3
    assert value(mon, "perfmon_internal_errors_total", stage="batching") >= 1
    assert _generation(mon)["requests"]["ok"] == 3  # the requests themselves are still tracked
