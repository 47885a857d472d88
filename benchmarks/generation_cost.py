"""What tracking one ``generate()`` call costs its thread, apart from the model (``make bench`` runs it).

A tracked ``generate()`` (perfmon/agent/decoding.py) opens the call's requests, stamps each step's tokens as
``generate()`` puts them to perfmon's streamer tap, and settles each request when the call ends (one
timeline record each; rows of a batch are cut at their own EOS, which reads the step tokens). This drives
exactly that bookkeeping with the puts ``generate()`` would make (one host tensor of B token ids a step),
min of 5 x 2,000 calls, so the figure is perfmon's alone, not HF's loop or the model (an end-to-end
wrapped-vs-bare ``generate()`` is benchmarks/agent_cost.py, whose noise here is +-10 µs a token).

Not a test: read the table on a quiet machine.
"""

from __future__ import annotations

import timeit

import torch
from prometheus_client import CollectorRegistry

import perfmon
from perfmon.agent.decoding import GenerateCall


def main() -> None:
    torch.manual_seed(0)
    mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), regression=None, prepare_profiler=False,
                          log_level="error", sample_rate=0.01)
    tracker = mon.generations
    model = torch.nn.Linear(1, 1)  # generate()'s model only lends its (absent) generation config here
    print("| batch | tokens | µs a call | µs a token |")
    print("|---:|---:|---:|---:|")
    for batch in (1, 4):
        for new in (32, 256):
            ids = torch.randint(1, 256, (batch, 8))
            mask = torch.ones_like(ids)
            steps = [torch.randint(1, 256, (batch,)) for _ in range(new)]

            def one(ids: torch.Tensor = ids, mask: torch.Tensor = mask, steps: list[torch.Tensor] = steps) -> None:
                call = GenerateCall(model, (ids,), {"attention_mask": mask, "eos_token_id": 0}, tracker, "g", False,
                                    mon.internal)
                tap = call.tap
                assert tap is not None
                tap.put(ids)  # the prompt
                for s in steps:
                    tap.put(s)
                call.end("ok", None)

            n = 2000
            best = min(timeit.repeat(one, number=n, repeat=5)) / n
            mon.flush()
            print(f"| {batch} | {new} | {best * 1e6:.1f} | {best * 1e6 / (new * batch):.2f} |")
    mon.stop()


if __name__ == "__main__":
    main()
