"""Every way Hugging Face's generate() produces tokens, against a ground truth taken apart from perfmon.

The definitions (issue #24): a request is one returned sequence; its generated tokens run up to and
including its first EOS; prompt tokens are the attention mask's real tokens, once per input row (padding
apart); TTFT is from the generate() call to when HF hands the first token out (beam search: when
generate() returns); ITL after the first chunk is n observations of gap/n for a chunk of n tokens; forwards
are prefill / decode / verify (assisted) / encode (T5's encoder); an iterator streamer's request ends when its
consumer reaches the end (ok) or drops it (cancelled), counted once even when also wrapped in
``monitor.stream``.

Tiny random models built from configs (nothing downloaded), on CPU. The truth never asks perfmon:

- ``Forwards``: a forward pre-hook on the bare module (or a submodule: T5's encoder) counts the forwards
  that really ran and their input lengths;
- ``Steps``: a ``StoppingCriteria`` that stamps ``perf_counter_ns()`` and ``input_ids.shape`` at each step:
  HF calls it next to handing the step's tokens out (``_sample``: ~15 us before the streamer's put();
  assisted: just after it) — checked against a stamping ``BaseStreamer`` (``Puts``) on the bare model;
- the returned sequences: tokens per row up to EOS computed here;
- the caller's own clock around generate().

Counts are asserted exactly; TTFT and ITL as perfmon's /stats p50 (exact percentiles of the observations)
within 25% (or 0.3 ms) of the truth's p50 — both sides time the same events, so a loaded box moves both.
The ``test_truth_*`` tests check the harness itself on bare models (they pass whatever perfmon does).
Streamer tests also check that once the caller let go and generate() returned, a ``gc.collect()`` frees the
streamer (a weak reference): a streamer kept alive leaks per request and can never end as cancelled.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from time import perf_counter_ns
from typing import Any

import pytest
import torch

import perfmon

from .conftest import kv_cache_of, value, wait_until

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer  # noqa: E402

EOS = 100
VOCAB = 101
NAME = "m"
REL = 0.25  # TTFT / ITL p50 tolerance, relative ...
ABS_S = 0.0003  # ... or absolute (seconds), whichever is larger

# Registry names: the spec's, and the names perfmon had before the rewrite (either may be the one exported).
HISTOGRAMS = {
    "ttft": ("perfmon_generation_ttft_seconds", "perfmon_time_to_first_token_seconds"),
    "itl": ("perfmon_generation_itl_seconds", "perfmon_inter_token_latency_seconds"),
}


# -- models ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """One intra-op thread: on a loaded 2-core box a second OpenMP thread spin-waits and stalls the steps."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gpt2(pad: int = EOS, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=128,
                                  bos_token_id=EOS, eos_token_id=EOS, pad_token_id=pad)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _t5() -> Any:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg).eval()


# -- truth ----------------------------------------------------------------------------------------------


class Steps(StoppingCriteria):  # type: ignore[misc]
    """perf_counter_ns() and input_ids' shape at every decoding step (never stops anything).

    With ``forwards`` (the main model's ``Forwards``), only calls after a forward of it since the last one
    recorded: assisted decoding in some transformers versions (5.17) also checks the drafts against the criteria
    before the main model verifies them, a call that is not a step.
    """

    def __init__(self, forwards: Forwards | None = None) -> None:
        self.ns: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.second = threading.Event()  # set at the second step: the first step's tokens went out
        self.forwards = forwards
        self.seen = len(forwards.calls) if forwards is not None else 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        now = perf_counter_ns()
        if self.forwards is not None:
            ran = len(self.forwards.calls)
            if ran == self.seen:  # no forward of the main model since the last step: the drafts' check
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            self.seen = ran
        self.ns.append(now)
        self.shapes.append(tuple(input_ids.shape))
        if len(self.ns) == 2:
            self.second.set()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class Puts(BaseStreamer):  # type: ignore[misc]
    """perf_counter_ns() and the tokens of every put() (the first one is the prompt)."""

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.values: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.ns.append(perf_counter_ns())
        self.values.append(value.detach().clone())

    def end(self) -> None:
        self.ended = True


class Forwards:
    """A forward pre-hook on the bare module: input length and cache length of every forward that ran."""

    def __init__(self, module: torch.nn.Module, ids_key: str = "input_ids") -> None:
        self.calls: list[tuple[int, int]] = []
        self.key = ids_key
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get(self.key, args[0] if args else None)
        cache = kv_cache_of(kwargs)
        cached = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        self.calls.append((int(ids.shape[-1]) if ids is not None else -1, int(cached)))

    def take(self) -> list[tuple[int, int]]:
        out, self.calls = self.calls, []
        return out


class Ban(LogitsProcessor):  # type: ignore[misc]
    """These token ids are never chosen (EOS, and pad where it differs): every row runs to max_new_tokens."""

    def __init__(self, *ids: int) -> None:
        self.ids = sorted(set(ids))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[..., self.ids] = -float("inf")
        return scores


class EndRowAt(LogitsProcessor):  # type: ignore[misc]
    """Row ``row`` emits EOS as its ``step``-th new token; no other choice is ever EOS or pad."""

    def __init__(self, prompt: int, row: int, step: int, eos: int, pad: int) -> None:
        self.prompt, self.row, self.step, self.eos, self.pad = prompt, row, step, eos, pad

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt + 1  # the new token being chosen, 1-based
        scores[:, [self.eos, self.pad]] = -float("inf")
        if step == self.step:
            scores[self.row] = -float("inf")
            scores[self.row, self.eos] = 0.0
        return scores


def tokens_per_row(sequences: torch.Tensor, start: int, eos: int, pad: int) -> list[int]:
    """Generated tokens of each returned sequence: after ``start``, up to and including the first EOS;
    without EOS, up to where trailing padding begins (pad != eos)."""
    out = []
    for row in sequences[:, start:].tolist():
        if eos in row:
            out.append(row.index(eos) + 1)
            continue
        n = len(row)
        while pad != eos and n and row[n - 1] == pad:
            n -= 1
        out.append(n)
    return out


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def gaps(ns: list[int]) -> list[float]:
    return [(b - a) / 1e9 for a, b in itertools.pairwise(ns)]


@dataclass
class Truth:
    rows: list[int] = field(default_factory=list)  # generated tokens per request
    prompt: int = 0  # real prompt tokens, once per input row
    padding: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds, one per request
    itl: list[float] = field(default_factory=list)  # seconds, one per observation
    forwards: dict[str, int] = field(default_factory=dict)  # forwards per stage
    verify_tokens: int = 0

    def add(self, other: Truth) -> None:
        self.rows += other.rows
        self.prompt += other.prompt
        self.padding += other.padding
        self.ttft += other.ttft
        self.itl += other.itl
        for k, v in other.forwards.items():
            self.forwards[k] = self.forwards.get(k, 0) + v
        self.verify_tokens += other.verify_tokens


# -- reading perfmon ------------------------------------------------------------------------------------


def gen_stats(mon: perfmon.Monitor) -> dict[str, Any]:
    assert mon.flush()
    drain = getattr(mon.generations, "drain", None)
    if drain is not None:
        drain()
    gen: dict[str, Any] = mon.stats()["generation"][NAME]
    return gen


def outcomes(mon: perfmon.Monitor) -> dict[str, float]:
    return {o: value(mon, "perfmon_generation_requests_total", model=NAME, outcome=o) or 0.0
            for o in ("ok", "error", "cancelled")}


def calls(mon: perfmon.Monitor, stage: str) -> float:
    return value(mon, "perfmon_forward_calls_total", model=NAME, stage=stage) or 0.0


def hist_counts(mon: perfmon.Monitor, kind: str) -> dict[str, float | None]:
    return {n: value(mon, f"{n}_count", model=NAME) for n in HISTOGRAMS[kind]}


def near(got: float | None, truth: float, what: str) -> None:
    assert got is not None, f"{what}: perfmon has no value (truth {truth * 1e3:.3f} ms)"
    assert abs(got - truth) <= max(REL * truth, ABS_S), (
        f"{what}: perfmon p50 {got * 1e3:.3f} ms vs truth p50 {truth * 1e3:.3f} ms")


def check(mon: perfmon.Monitor, truth: Truth, *, ok: int | None = None, cancelled: int = 0,
          timing: bool = True) -> dict[str, Any]:
    """Every number perfmon has for model "m" against the truth: counts exact, TTFT / ITL p50 near."""
    gen = gen_stats(mon)
    requests = len(truth.rows) if ok is None else ok + cancelled
    ok = requests - cancelled if ok is None else ok
    observed = {
        "requests": gen["requests"],
        "generated_tokens": gen["generated_tokens"],
        "prompt_tokens": gen["prompt_tokens"],
        "ttft_count": gen["time_to_first_token"]["count"],
        "itl_count": gen["inter_token_latency"]["count"],
        "ttft_p50_ms": (gen["time_to_first_token"].get("p50_seconds") or 0) * 1e3,
        "itl_p50_ms": (gen["inter_token_latency"].get("p50_seconds") or 0) * 1e3,
        "forward_calls": {s: calls(mon, s) for s in ("prefill", "decode", "verify", "encode")},
        "padding_total": value(mon, "perfmon_prompt_padding_tokens_total", model=NAME),
        "verify_tokens_total": value(mon, "perfmon_generation_verify_tokens_total", model=NAME),
    }
    expected = {
        "requests": {"ok": ok, "error": 0, "cancelled": cancelled},
        "generated_tokens": sum(truth.rows),
        "prompt_tokens": truth.prompt,
        "ttft_count": len(truth.ttft),
        "itl_count": len(truth.itl),
        "forward_calls": {s: float(truth.forwards.get(s, 0)) for s in ("prefill", "decode", "verify", "encode")},
        "padding_total": float(truth.padding),
    }
    if truth.forwards.get("verify"):
        expected["verify_tokens_total"] = float(truth.verify_tokens)
    got = {k: observed[k] for k in expected}
    if got.get("padding_total") is None and truth.padding == 0:
        got["padding_total"] = 0.0  # a counter never incremented may not be exported
    truth_ms = {"ttft_p50_ms": p50(truth.ttft) * 1e3 if truth.ttft else None,
                "itl_p50_ms": p50(truth.itl) * 1e3 if truth.itl else None}
    assert got == expected, f"\nperfmon: {observed}\ntruth:   {expected} {truth_ms}"
    # The registry agrees with /stats (counters exact; histogram counts exact).
    assert outcomes(mon) == {k: float(v) for k, v in expected["requests"].items()}
    assert value(mon, "perfmon_generated_tokens_total", model=NAME) == sum(truth.rows)
    assert (value(mon, "perfmon_prompt_tokens_total", model=NAME) or 0) == truth.prompt
    for kind, n in (("ttft", len(truth.ttft)), ("itl", len(truth.itl))):
        counts = hist_counts(mon, kind)
        present = [v for v in counts.values() if v is not None]
        assert (present or n == 0) and all(v == n for v in present), (kind, n, counts)
    if timing:
        near(gen["time_to_first_token"].get("p50_seconds"), p50(truth.ttft), "TTFT")
        if truth.itl:
            near(gen["inter_token_latency"].get("p50_seconds"), p50(truth.itl), "ITL")
    return gen


# -- scenarios: each runs one generate() on a model (bare or wrapped: the same module) and returns its truth


def left_padded(lens: list[int], width: int, pad: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lens), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, width - n:] = torch.randint(0, 99, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def greedy_rows(model: Any, fw: Forwards, ids: torch.Tensor, mask: torch.Tensor, new: int,
                processors: list[Any], pad: int, **kw: Any) -> tuple[Truth, torch.Tensor, Steps]:
    """greedy / sampling (one sequence per input row, or num_return_sequences): every row gets one token per
    step, up to its EOS."""
    steps = Steps()
    t0 = perf_counter_ns()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new,
                             logits_processor=LogitsProcessorList(processors),
                             stopping_criteria=StoppingCriteriaList([steps]), **kw)
    ran = fw.take()
    rows = tokens_per_row(out, ids.shape[1], EOS, pad)
    truth = Truth(rows=rows, prompt=int(mask.sum()), padding=int(mask.numel() - mask.sum()),
                  forwards={"prefill": 1, "decode": len(ran) - 1})
    assert len(steps.ns) == len(ran) == max(rows)
    for n in rows:
        truth.ttft.append((steps.ns[0] - t0) / 1e9)
        truth.itl += gaps(steps.ns[:n])
    return truth, out, steps


def beam(model: Any, fw: Forwards, ids: torch.Tensor, new: int, beams: int, k: int) -> tuple[Truth, int, int]:
    """Beam search: no token reaches the caller before generate() returns: TTFT = the call's duration; the whole
    sequence is the first chunk (no ITL). Returns the truth, the prefill step's and the return's ns from t0."""
    steps = Steps()
    mask = torch.ones_like(ids)
    t0 = perf_counter_ns()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, num_beams=beams, num_return_sequences=k,
                             do_sample=False, logits_processor=LogitsProcessorList([Ban(EOS)]),
                             stopping_criteria=StoppingCriteriaList([steps]))
    t1 = perf_counter_ns()
    ran = fw.take()
    rows = tokens_per_row(out, ids.shape[1], EOS, EOS)
    truth = Truth(rows=rows, prompt=int(mask.sum()), forwards={"prefill": 1, "decode": len(ran) - 1},
                  ttft=[(t1 - t0) / 1e9] * len(rows))
    return truth, steps.ns[0] - t0, t1 - t0


class Disagree:
    """Hooks on the assistant: its logits favour a wrong token for every position divisible by 5, so the main
    model rejects that draft (chunks of 1 and 4 tokens alternate with 3 drafted tokens a step)."""

    def __init__(self, assistant: torch.nn.Module) -> None:
        self.length = 0
        assistant.register_forward_pre_hook(self._pre, with_kwargs=True)
        assistant.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kv_cache_of(kwargs)
        self.length = kwargs["input_ids"].shape[1] + (cache.get_seq_length() if cache is not None else 0)

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        if self.length % 5 == 0:
            last = out.logits[:, -1, :]
            wrong = (last.argmax(-1) + 1) % EOS
            last[torch.arange(last.shape[0]), wrong] = 1e4
        return out


def make_assistant(bare: Any) -> Any:
    assistant = copy.deepcopy(bare)  # the same weights: drafts agree unless Disagree says otherwise
    cfg = assistant.generation_config
    cfg.num_assistant_tokens = 3
    cfg.num_assistant_tokens_schedule = "constant"
    cfg.assistant_confidence_threshold = 0.0
    Disagree(assistant)
    return assistant


def assisted(model: Any, fw: Forwards, assistant: Any, ids: torch.Tensor, new: int,
             streamer: Puts | None = None) -> tuple[Truth, list[int], Steps]:
    """Assisted generation (batch 1): each main forward yields a chunk (accepted drafts + the bonus token)."""
    steps = Steps(fw)
    t0 = perf_counter_ns()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             assistant_model=assistant, logits_processor=LogitsProcessorList([Ban(EOS)]),
                             stopping_criteria=StoppingCriteriaList([steps]), streamer=streamer)
    ran = fw.take()
    lengths = [ids.shape[1]] + [s[1] for s in steps.shapes]
    chunks = [b - a for a, b in itertools.pairwise(lengths)]
    rows = tokens_per_row(out, ids.shape[1], EOS, EOS)
    truth = Truth(rows=rows, prompt=ids.shape[1], forwards={"prefill": 1, "verify": len(ran) - 1},
                  ttft=[(steps.ns[0] - t0) / 1e9], verify_tokens=sum(chunks[1:]))
    for n, gap in zip(chunks[1:], gaps(steps.ns)):
        truth.itl += [gap / n] * n
    assert len(ran) == len(steps.ns) == len(chunks) and sum(chunks) == rows[0] == new
    return truth, chunks, steps


def t5_run(model: Any, enc: Forwards, dec: Forwards, ids: torch.Tensor, mask: torch.Tensor,
           new: int) -> Truth:
    steps = Steps()
    t0 = perf_counter_ns()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([Ban(0, 1)]),
                             stopping_criteria=StoppingCriteriaList([steps]))
    encoded, decoded = enc.take(), dec.take()
    rows = tokens_per_row(out, 1, 1, 0)  # the returned sequence: the decoder start token, then the new tokens
    truth = Truth(rows=rows, prompt=int(mask.sum()), padding=int(mask.numel() - mask.sum()),
                  forwards={"encode": len(encoded), "prefill": 1, "decode": len(decoded) - 1})
    assert len(encoded) == 1 and len(decoded) == len(steps.ns) == new and decoded[0][1] == 0
    for n in rows:
        truth.ttft.append((steps.ns[0] - t0) / 1e9)
        truth.itl += gaps(steps.ns[:n])
    return truth


class Words:
    """A stand-in tokenizer: TextIteratorStreamer only calls decode(); one word per token, so one text item
    per put() (the prompt, then each step), then "" at the end."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(f"t{i} " for i in ids)


def generate_in_thread(model: Any, ids: torch.Tensor, streamer: Any, steps: Steps, new: int,
                       ) -> tuple[threading.Thread, dict[str, Any]]:
    """generate(streamer=...) in a thread, as a server does; only the thread holds the streamer besides the caller."""
    box: dict[str, Any] = {}

    def run(**kwargs: Any) -> None:
        box["t0"] = perf_counter_ns()
        try:
            box["out"] = model.generate(**kwargs)
        except BaseException as exc:  # reported by joined()
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, kwargs=dict(
        inputs=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, streamer=streamer,
        logits_processor=LogitsProcessorList([Ban(EOS)]), stopping_criteria=StoppingCriteriaList([steps])))
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict[str, Any]) -> None:
    thread.join(15)
    assert not thread.is_alive(), "generate() did not finish within 15 s"
    assert "error" not in box, box["error"]


def stream_truth(box: dict[str, Any], steps: Steps, prompt: int, new: int) -> Truth:
    out = box["out"]
    rows = tokens_per_row(out, prompt, EOS, EOS)
    assert rows == [new] and len(steps.ns) == new
    return Truth(rows=rows, prompt=prompt, ttft=[(steps.ns[0] - box["t0"]) / 1e9], itl=gaps(steps.ns),
                 forwards={"prefill": 1, "decode": new - 1})


def released(ref: weakref.ref[Any], failures: list[str]) -> None:
    """The caller let go of the streamer, generate() returned: nothing may keep it alive (a leak per request,
    and a streamer nobody can collect can never end its request as cancelled)."""
    gc.collect()
    obj = ref()
    if obj is not None:
        held_by = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"frame", "list"})
        failures.append(f"the streamer is still alive after gc.collect() (referred to by {held_by})")


# -- the harness on bare models ---------------------------------------------------------------------------


def test_truth_harness_on_bare_models() -> None:
    """Steps stamps each step next to the streamer's put(); tokens per row, forwards and chunks are what
    generate() did — on unwrapped models, so the truth does not depend on perfmon."""
    # Greedy, left padding, row 2 ends at EOS as its 4th token; pad differs from EOS and is never chosen.
    bare = _gpt2(pad=0)
    fw = Forwards(bare)
    ids, mask = left_padded([3, 5, 7, 8], 8, 0)
    puts = Puts()
    truth, out, steps = greedy_rows(bare, fw, ids, mask, 10, [EndRowAt(8, 2, 4, EOS, 0)], 0, do_sample=False,
                                    streamer=puts)
    assert truth.rows == [10, 10, 4, 10] and out[2, 8 + 3].item() == EOS and (out[2, 12:] == 0).all()
    assert (truth.prompt, truth.padding, len(truth.itl)) == (23, 9, 30)
    assert len(puts.ns) == 1 + 10 and puts.ended  # the prompt, then one put per step
    lag = [(p - s) / 1e3 for s, p in zip(steps.ns, puts.ns[1:])]
    assert all(0 <= d < 5000 for d in lag), lag  # put() right after the stopping criteria (us)
    # Assisted: the streamer's chunks are Steps' chunks; the first main forward is prompt + 3 drafts.
    assistant = make_assistant(bare)
    one = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(3))
    puts = Puts()
    truth, chunks, steps = assisted(bare, fw, assistant, one, 24, streamer=puts)
    assert [v.shape[-1] for v in puts.values[1:]] == chunks and 1 in chunks[1:] and 4 in chunks[1:], chunks
    assert all(0 <= (s - p) < 5_000_000 for s, p in zip(steps.ns, puts.ns[1:]))
    assert truth.forwards == {"prefill": 1, "verify": len(chunks) - 1} and len(truth.itl) == 24 - chunks[0]
    # T5: one encoder forward, then one decoder forward per token.
    t5 = _t5()
    enc, dec = Forwards(t5.get_encoder()), Forwards(t5, "decoder_input_ids")
    ids5, mask5 = left_padded([5, 7], 7, 0)
    truth = t5_run(t5, enc, dec, ids5, mask5, 8)
    assert truth.rows == [8, 8] and truth.forwards == {"encode": 1, "prefill": 1, "decode": 7}


# -- the tests ------------------------------------------------------------------------------------------

#: generate() calls per test: TTFT's p50 is over calls, so one call preempted on a loaded box moves it little.
CALLS = 3


def repeat(run: Any, calls: int = CALLS) -> Truth:
    truth = Truth()
    for _ in range(calls):
        truth.add(run())
    return truth


@pytest.mark.parametrize("pad", [EOS, 0], ids=["pad_is_eos", "pad_differs"])
def test_left_padded_batch_with_a_row_ending_at_eos(make_monitor, pad: int) -> None:
    """4 left-padded prompts (3, 5, 7, 8 real tokens of 8), greedy, 10 new tokens; row 2 emits EOS as its 4th:
    per call 4 requests, 10+10+4+10 tokens, 23 prompt tokens and 9 padding, ITL only for the tokens each row
    received (30), TTFT when the first step's tokens go out."""
    bare = _gpt2(pad=pad)
    fw = Forwards(bare)
    ids, mask = left_padded([3, 5, 7, 8], 8, pad)

    def run(m: Any) -> Truth:
        return greedy_rows(m, fw, ids, mask, 10, [EndRowAt(8, 2, 4, EOS, pad)], pad, do_sample=False)[0]

    run(bare)  # warm-up
    # Every call's tokens timed; the forwards of calls after the first: untimed.
    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1.0).start()
    model = mon.wrap(bare, name=NAME)
    truth = repeat(lambda: run(model))
    assert truth.rows == [10, 10, 4, 10] * CALLS and (truth.prompt, truth.padding) == (23 * CALLS, 9 * CALLS)
    assert len(truth.itl) == 30 * CALLS
    check(mon, truth)


@pytest.mark.parametrize("mode", ["sample", "beam"])
def test_num_return_sequences_are_requests(make_monitor, mode: str) -> None:
    """2 prompts x num_return_sequences=3, 12 new tokens, EOS impossible: per call 6 requests, 72 tokens, the
    prompts counted once per input row (12 tokens). Sampling: TTFT at the first step, 6 x 11 ITL; beam search
    (3 beams): everything arrives when generate() returns: TTFT = its duration, no ITL."""
    bare = _gpt2()
    fw = Forwards(bare)
    ids = torch.randint(0, 99, (2, 6), generator=torch.Generator().manual_seed(2))

    def run(m: Any) -> Truth:
        if mode == "sample":
            return greedy_rows(m, fw, ids, torch.ones_like(ids), 12, [Ban(EOS)], EOS, do_sample=True,
                               num_return_sequences=3)[0]
        return beam(m, fw, ids, 12, 3, 3)[0]

    run(bare)  # warm-up
    # Sampling: every call's tokens timed; beam search times its calls' tokens anyway (their time is the return).
    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1.0 if mode == "sample" else None).start()
    model = mon.wrap(bare, name=NAME)
    truth = repeat(lambda: run(model))
    assert truth.rows == [12] * 6 * CALLS and truth.prompt == 12 * CALLS
    assert truth.forwards == {"prefill": CALLS, "decode": 11 * CALLS}
    assert len(truth.itl) == (66 * CALLS if mode == "sample" else 0)
    check(mon, truth)


def test_beam_search_ttft_is_when_generate_returns(make_monitor) -> None:
    """Beam search hands nothing out before generate() returns: TTFT = the call's duration (not the prefill)."""
    bare = _gpt2()
    fw = Forwards(bare)
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(4))
    beam(bare, fw, ids, 16, 3, 1)  # warm-up
    mon = make_monitor(sample_rate=0.01).start()  # generate() calls after the first: untimed
    model = mon.wrap(bare, name=NAME)
    truth, prefill, returned = Truth(), [], []
    for _ in range(CALLS):
        t, first_ns, end_ns = beam(model, fw, ids, 16, 3, 1)
        truth.add(t)
        prefill.append(first_ns / 1e9)
        returned.append(end_ns / 1e9)
    assert truth.rows == [16] * CALLS and truth.forwards == {"prefill": CALLS, "decode": 15 * CALLS}
    assert not truth.itl
    assert p50(prefill) < p50(returned) / 3, (prefill, returned)  # the two definitions are far apart
    check(mon, truth)


def test_assisted_generation_chunks_verify_stage_and_itl(make_monitor) -> None:
    """Assisted generation, 24 new tokens, an assistant with the same weights that drafts 3 tokens a step and
    gets every 5th position wrong: main forwards are 1 prefill (prompt + drafts) + 8 verify; chunks of 4 and 1
    tokens; ITL = 24 - first chunk observations of gap/chunk; verify tokens counted. With a streamer and
    without, alternately."""
    bare = _gpt2()
    assistant = make_assistant(bare)
    fw = Forwards(bare)
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(3))
    assisted(bare, fw, assistant, ids, 24)  # warm-up
    mon = make_monitor(sample_rate=0.01).start()  # generate() calls after the first: untimed
    model = mon.wrap(bare, name=NAME)
    truth = Truth()
    seen = []
    for streamer in (Puts(), None, Puts(), None):
        t, chunks, _ = assisted(model, fw, assistant, ids, 24, streamer=streamer)
        truth.add(t)
        seen.append(chunks)
    assert all(c == [4, 1, 4, 1, 4, 1, 4, 1, 4] for c in seen), seen
    assert truth.forwards == {"prefill": 4, "verify": 32} and len(truth.itl) == 80 and truth.verify_tokens == 80
    check(mon, truth)


def test_an_assistant_wrapped_alone_makes_no_requests_of_its_drafts(make_monitor) -> None:
    """Assisted generation with the main model bare and only the assistant wrapped: the drafts transformers asks of the
    assistant's ``generate()`` reach no caller, so they are no requests (the caller's own is not tracked: its model is
    not wrapped); the assistant's forwards are counted, each once, and the tokens are the all-bare run's. Then with
    the main model wrapped too: the drafts still make no requests, each call one."""
    bare = _gpt2()
    assistant = make_assistant(bare)
    drafts = Forwards(assistant)
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(3))
    fw = Forwards(bare)
    assisted(bare, fw, assistant, ids, 24)
    expected = drafts.take()
    mon = make_monitor(sample_rate=1.0).start()
    mon.wrap(assistant, name="draft")
    for _ in range(3):
        assisted(bare, fw, assistant, ids, 24)
        assert drafts.take() == expected
    assert mon.flush()
    assert "draft" not in mon.stats().get("generation", {})
    assert value(mon, "perfmon_generation_requests_total", model="draft", outcome="ok") in (None, 0.0)
    counted = sum(value(mon, "perfmon_forward_calls_total", model="draft", stage=stage) or 0.0
                  for stage in ("prefill", "decode", "verify", ""))
    assert counted == 3 * len(expected)
    # Both wrapped: the drafts, nested in the main model's assisted call, are still no requests; the call is one.
    main = mon.wrap(bare, name="main")
    for _ in range(2):
        assisted(main, fw, assistant, ids, 24)
        assert drafts.take() == expected
    assert mon.flush()
    assert value(mon, "perfmon_generation_requests_total", model="draft", outcome="ok") in (None, 0.0)
    assert value(mon, "perfmon_generation_requests_total", model="main", outcome="ok") == 2


def test_encoder_decoder_counts_the_encoder_forward_as_encode(make_monitor) -> None:
    """T5, 2 prompts (5 and 7 real tokens of 7), 8 new tokens: per call 1 encode + 1 prefill + 7 decode forwards,
    2 requests of 8 tokens (the returned sequence's decoder start token is not generated), 12 prompt tokens,
    2 padding."""
    bare = _t5()
    enc, dec = Forwards(bare.get_encoder()), Forwards(bare, "decoder_input_ids")
    ids, mask = left_padded([5, 7], 7, 0)
    t5_run(bare, enc, dec, ids, mask, 8)  # warm-up
    # Every call's tokens timed; the forwards of calls after the first: untimed.
    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1.0).start()
    model = mon.wrap(bare, name=NAME)
    truth = repeat(lambda: t5_run(model, enc, dec, ids, mask, 8))
    assert truth.rows == [8, 8] * CALLS and (truth.prompt, truth.padding) == (12 * CALLS, 2 * CALLS)
    assert truth.forwards == {"encode": CALLS, "prefill": CALLS, "decode": 7 * CALLS}
    check(mon, truth)


def test_greedy_without_streamer_baseline(make_monitor) -> None:
    """Greedy, 3 prompts, 10 new tokens, no streamer: per call 3 requests of 10 tokens, TTFT when the prefill
    step's tokens go out, 3 x 9 ITL."""
    bare = _gpt2()
    fw = Forwards(bare)
    ids = torch.randint(0, 99, (3, 5), generator=torch.Generator().manual_seed(5))

    def run(m: Any) -> Truth:
        return greedy_rows(m, fw, ids, torch.ones_like(ids), 10, [Ban(EOS)], EOS, do_sample=False)[0]

    run(bare)  # warm-up
    # Every call's tokens timed; the forwards of calls after the first: untimed.
    mon = make_monitor(sample_rate=0.01, generation_sample_rate=1.0).start()
    model = mon.wrap(bare, name=NAME)
    truth = repeat(lambda: run(model))
    assert truth.rows == [10] * 3 * CALLS and len(truth.itl) == 27 * CALLS
    assert truth.forwards == {"prefill": CALLS, "decode": 9 * CALLS}
    check(mon, truth)


#: Only the first call of a model has its tokens timed: a generation sample rate whose stride is drawn from
#: 1 .. 2e6 - 1 calls (no test reaches it), and a floor of an hour.
FIRST_CALL_TIMED = {"sample_rate": 0.01, "generation_sample_rate": 1e-6, "sample_floor_seconds": 3600.0}


def timed_first(runs: list[Truth]) -> Truth:
    """The truth perfmon should give when only the first call's tokens are timed: every call's counts, the first
    call's TTFT and ITL."""
    truth = Truth()
    for i, t in enumerate(runs):
        truth.add(t if i == 0 else replace(t, ttft=[], itl=[]))
    return truth


def embeds_run(model: Any, fw: Forwards, ids: torch.Tensor, new: int, eos_at: int) -> Truth:
    """One decoder-only prompt given as embeddings only: generate() returns the new tokens alone (no prompt)."""
    steps = Steps()
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(ids)
        t0 = perf_counter_ns()
        out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([EndRowAt(0, 0, eos_at, EOS, EOS)]),
                             stopping_criteria=StoppingCriteriaList([steps]))
    ran = fw.take()
    assert out.shape == (1, eos_at) and int(out[0, -1]) == EOS  # the new tokens alone, up to the EOS
    truth = Truth(rows=[eos_at], prompt=ids.shape[1], forwards={"prefill": 1, "decode": len(ran) - 1},
                  ttft=[(steps.ns[0] - t0) / 1e9], itl=gaps(steps.ns))
    assert len(ran) == len(steps.ns) == eos_at
    return truth


@pytest.mark.parametrize("scenario", ["rows", "one", "t5", "embeds"])
def test_calls_not_sampled_count_every_token_exactly_and_time_none(make_monitor, scenario: str) -> None:
    """Calls whose tokens are not sampled get no perfmon streamer: what generate() returns says their tokens.
    Against the truth, with only the first call timed: every request, token, prompt token and padding token
    exact; TTFT and ITL only for the first call's. "rows": a left-padded batch whose row 2 emits EOS as its 4th
    token (each row cut at its own EOS); "one": one sequence ending at EOS at its 5th (its length); "t5": the
    returned sequences start with the decoder's start token; "embeds": a prompt of embeddings only, returned as
    the new tokens alone."""
    bare = _t5() if scenario == "t5" else _gpt2(pad=0)
    fw = enc = Forwards(bare) if scenario != "t5" else Forwards(bare, "decoder_input_ids")
    if scenario == "t5":
        enc = Forwards(bare.get_encoder())
    ids, mask = left_padded([3, 5, 7, 8], 8, 0)
    one = torch.randint(2, 99, (1, 6), generator=torch.Generator().manual_seed(6))

    def run(m: Any) -> Truth:
        if scenario == "rows":
            return greedy_rows(m, fw, ids, mask, 10, [EndRowAt(8, 2, 4, EOS, 0)], 0, do_sample=False)[0]
        if scenario == "one":
            return greedy_rows(m, fw, one, torch.ones_like(one), 10, [EndRowAt(6, 0, 5, EOS, 0)], 0)[0]
        if scenario == "t5":
            return t5_run(m, enc, fw, ids[2:], mask[2:], 8)
        return embeds_run(m, fw, one, 10, 5)

    run(bare)  # warm-up
    mon = make_monitor(**FIRST_CALL_TIMED).start()
    model = mon.wrap(bare, name=NAME)
    runs = [run(model) for _ in range(CALLS)]
    truth = timed_first(runs)
    rows = {"rows": [10, 10, 4, 10], "one": [5], "t5": [8, 8], "embeds": [5]}[scenario]
    assert truth.rows == rows * CALLS and len(truth.ttft) == len(rows)
    check(mon, truth)


STREAM_NEW = 12
STREAM_PROMPT = 5


def _streaming_setup(make_monitor: Any) -> tuple[perfmon.Monitor, Any, Forwards, torch.Tensor]:
    bare = _gpt2()
    fw = Forwards(bare)
    ids = torch.randint(0, 99, (1, STREAM_PROMPT), generator=torch.Generator().manual_seed(6))
    greedy_rows(bare, fw, ids, torch.ones_like(ids), STREAM_NEW, [Ban(EOS)], EOS, do_sample=False)  # warm-up
    mon = make_monitor(sample_rate=0.01).start()  # generate() calls after the first: untimed
    return mon, mon.wrap(bare, name=NAME), fw, ids


def test_iterator_streamer_read_to_the_end_is_ok(make_monitor) -> None:
    """TextIteratorStreamer, generate() in a thread: the request ends when the consumer reaches the end (ok),
    not when generate() returns; TTFT / ITL when HF hands the tokens to the streamer; the streamer is freed."""
    mon, model, fw, ids = _streaming_setup(make_monitor)
    truth = Truth()
    failures: list[str] = []
    for i in range(CALLS):
        streamer = TextIteratorStreamer(Words(), timeout=10)
        steps = Steps()
        thread, box = generate_in_thread(model, ids, streamer, steps, STREAM_NEW)
        items = [next(streamer), next(streamer)]
        joined(thread, box)  # generate() returned; the consumer has not reached the end
        gen = gen_stats(mon)
        assert sum(gen["requests"].values()) == i, gen["requests"]
        items += list(streamer)
        assert len(items) == 1 + STREAM_NEW + 1 and items[-1] == ""  # the prompt, one item per token, the end
        assert len(fw.take()) == STREAM_NEW
        truth.add(stream_truth(box, steps, STREAM_PROMPT, STREAM_NEW))
        ref = weakref.ref(streamer)
        del streamer
        released(ref, failures)
    check(mon, truth)
    assert not failures, failures


def test_iterator_streamer_dropped_by_its_consumer_is_cancelled(make_monitor) -> None:
    """The consumer reads 2 items and drops the streamer: cancelled once generate() let go of it too."""
    mon, model, _, ids = _streaming_setup(make_monitor)
    truth = Truth()
    for i in range(CALLS):
        streamer = TextIteratorStreamer(Words(), timeout=10)
        steps = Steps()
        thread, box = generate_in_thread(model, ids, streamer, steps, STREAM_NEW)
        items = [next(streamer), next(streamer)]
        del streamer
        gc.collect()
        joined(thread, box)
        gc.collect()
        assert len(items) == 2
        truth.add(stream_truth(box, steps, STREAM_PROMPT, STREAM_NEW))
        wait_until(lambda i=i: outcomes(mon)["cancelled"] >= i + 1, timeout=5,
                   what="the dropped streamer counted cancelled")
    check(mon, truth, ok=0, cancelled=CALLS)


@pytest.mark.parametrize("outcome", ["ok", "closed"])
@pytest.mark.parametrize("order", ["stream_before_generate", "stream_after_generate"])
def test_iterator_streamer_also_wrapped_in_monitor_stream_counts_once(make_monitor, order: str,
                                                                      outcome: str) -> None:
    """The same streamer tracked automatically and by monitor.stream(streamer, name="m") is one request,
    whichever starts first: read to the end -> ok; 2 items then close() the wrapper while generate() runs
    -> cancelled (and nothing more when generate() ends). Afterwards nothing keeps the streamer alive."""
    mon, model, _, ids = _streaming_setup(make_monitor)
    truth = Truth()
    failures: list[str] = []
    for i in range(CALLS):
        streamer = TextIteratorStreamer(Words(), timeout=10)
        steps = Steps()
        opened = None
        if order == "stream_before_generate":
            opened = time.perf_counter_ns()
            wrapped = mon.stream(streamer, name=NAME)
            # Scripted: generate() is called 20 ms later (a request queued for a worker). The request started
            # when the caller opened the stream, so its TTFT includes that wait: the client's view.
            time.sleep(0.02)
            thread, box = generate_in_thread(model, ids, streamer, steps, STREAM_NEW)
        else:
            thread, box = generate_in_thread(model, ids, streamer, steps, STREAM_NEW)
            # generate() runs and has handed its first token out (waiting for the second step: the first put()
            # is over, so monitor.stream never races it — on a loaded box that race is milliseconds wide)
            assert steps.second.wait(10), "generate() made no second step within 10 s"
            wrapped = mon.stream(streamer, name=NAME)
        ref = weakref.ref(streamer)
        if outcome == "ok":
            items = list(wrapped)
            assert len(items) == 1 + STREAM_NEW + 1
            joined(thread, box)
        else:
            items = [next(wrapped), next(wrapped)]
            wrapped.close()  # generate() is still running: the closed request stays cancelled
            wait_until(lambda i=i: outcomes(mon)["cancelled"] >= i + 1, timeout=5,
                       what="the closed stream counted cancelled")
            joined(thread, box)
        if opened is not None:
            box["t0"] = opened
        truth.add(stream_truth(box, steps, STREAM_PROMPT, STREAM_NEW))
        del streamer, wrapped
        released(ref, failures)
    try:
        if outcome == "ok":
            check(mon, truth)
        else:
            check(mon, truth, ok=0, cancelled=CALLS)
    except AssertionError as exc:
        failures.insert(0, str(exc))
    assert not failures, "\n".join(failures)
