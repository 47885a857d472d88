"""Whole-model checks: a ``torch.compile``d model (every call counted and timed, no graph break) and a tiny
random GPT-2's ``generate()`` (prefill/decode forwards, TTFT and ITL counts)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .common import Check, Figure, device_seconds, quiet_monitor, total
from .rig import Rig

__all__ = ["check_compile", "check_generation"]


def check_compile(rig: Rig, *, quick: bool = False) -> Check:
    """``torch.compile`` (inductor) of a wrapped CUDA model: every call counted, device-timed, no graph break.

    Pass: calls == made, timed samples == calls at 100% sampling, and Dynamo counted no graph break.
    """
    if not rig.real:
        return Check("compile", "skip", "needs a real GPU")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=0)
    calls = 20 if quick else 100
    try:
        mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
        model = mon.wrap(mlp, name="compiled")
        compiled: Any = torch.compile(model)
        x = torch.randn(64, 512, device="cuda")
        t0 = time.perf_counter()
        with torch.inference_mode():
            same = torch.allclose(compiled(x), mlp(x), atol=1e-3, rtol=1e-3)
            compile_s = time.perf_counter() - t0
            for _ in range(calls - 1):
                compiled(x)
        rig.synchronize()
        mon.flush(timeout=10)
        got = total(mon, "perfmon_forward_calls_total", model="compiled")
        timed = device_seconds(mon, "compiled")[1]
        steady_sum = total(mon, "perfmon_forward_duration_seconds_sum", model="compiled", phase="steady")
        steady_n = total(mon, "perfmon_forward_duration_seconds_count", model="compiled", phase="steady")
        cold_n = total(mon, "perfmon_forward_duration_seconds_count", model="compiled", phase="cold")
        breaks = sum(counters["graph_break"].values())
    finally:
        mon.stop()
        torch._dynamo.reset()
    want = calls + 1  # wrap() swaps the class in place: the eager reference call ``mlp(x)`` counts too
    figures: dict[str, Figure] = {"calls": (got, ""), "timed": (timed, ""), "graph_breaks": (breaks, ""),
                                  "first_call_with_compile": (compile_s, "s"),
                                  "cold_calls": (cold_n, ""),
                                  "steady_device_mean": (steady_sum / steady_n * 1e6 if steady_n else None, "µs")}
    ok = same and got == want and timed == want and breaks == 0
    return Check("compile", "pass" if ok else "fail",
                 f"{got:g}/{want} calls counted, {timed:g} device-timed, {breaks} graph break(s); output "
                 f"{'matches' if same else 'DIFFERS from'} eager", figures)


def check_generation(rig: Rig, *, quick: bool = False) -> Check:
    """A tiny random GPT-2's ``generate()`` on the GPU: prefill/decode forwards and TTFT/ITL counts.

    Pass: per generate of ``new`` tokens for ``batch`` sequences, 1 prefill and new-1 decode forwards,
    ``batch`` TTFT and ``batch * (new - 1)`` ITL observations.
    """
    if not rig.real:
        return Check("generation", "skip", "needs a real GPU")
    try:
        import transformers
    except ImportError:
        return Check("generation", "skip", "transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=64,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    mon = quiet_monitor(rig, sample_rate=1.0)
    batch, prompt, new, runs = 2, 5, 6, 3
    try:
        gpt2: Any = transformers.GPT2LMHeadModel(cfg)
        model = mon.wrap(gpt2.eval().cuda(), name="gpt2")
        ids = torch.randint(0, 100, (batch, prompt), device="cuda")
        with torch.inference_mode():
            for _ in range(runs):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        torch.cuda.synchronize()
        mon.flush(timeout=10)
        prefill = total(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill")
        decode = total(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode")
        ttft = total(mon, "perfmon_time_to_first_token_seconds_count", model="gpt2")
        itl = total(mon, "perfmon_inter_token_latency_seconds_count", model="gpt2")
        ttft_sum = total(mon, "perfmon_time_to_first_token_seconds_sum", model="gpt2")
        dev_prefill = total(mon, "perfmon_forward_duration_seconds_sum", model="gpt2", stage="prefill")
        itl_sum = total(mon, "perfmon_inter_token_latency_seconds_sum", model="gpt2")
        dev_decode = total(mon, "perfmon_forward_duration_seconds_sum", model="gpt2", stage="decode")
    finally:
        mon.stop()
    figures: dict[str, Figure] = {
        "prefill_calls": (prefill, ""), "decode_calls": (decode, ""), "ttft_count": (ttft, ""),
        "itl_count": (itl, ""), "ttft_mean_host": (ttft_sum / ttft * 1e3 if ttft else None, "ms"),
        "prefill_mean_device": (dev_prefill / prefill * 1e3 if prefill else None, "ms"),
        "itl_mean_host": (itl_sum / itl * 1e3 if itl else None, "ms"),
        "decode_mean_device": (dev_decode / decode * 1e3 if decode else None, "ms"),
    }
    want = (runs, runs * (new - 1), runs * batch, runs * batch * (new - 1))
    ok = (prefill, decode, ttft, itl) == want
    return Check("generation", "pass" if ok else "fail",
                 f"prefill {prefill:g}/{want[0]}, decode {decode:g}/{want[1]}, TTFT {ttft:g}/{want[2]}, "
                 f"ITL {itl:g}/{want[3]}", figures)
