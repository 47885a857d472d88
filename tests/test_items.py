"""Items per call: the batch dimension by default, the user's units with a callable, exact under threads."""

from __future__ import annotations

import threading

import pytest
import torch

import perfmon

from .conftest import value


def _run_threads(fn, threads: int = 6) -> None:
    barrier = threading.Barrier(threads)

    def work(i: int) -> None:
        barrier.wait(timeout=10)
        fn(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)


def test_default_items_are_the_batch_dimension_exact_under_threads(make_monitor) -> None:
    """Six threads calling with batch sizes 1..8: items_total is exactly the sum of batch sizes."""
    mon = make_monitor(sample_rate=0.05).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    per_thread = 1500

    def work(i: int) -> None:
        for k in range(per_thread):
            model(torch.zeros(1 + (k + i) % 8, 4))

    _run_threads(work)
    expected = sum(1 + (k + i) % 8 for i in range(6) for k in range(per_thread))
    assert value(mon, "perfmon_forward_items_total", model="lin") == expected
    assert value(mon, "perfmon_forward_padded_items_total", model="lin") is None
    mon.flush()
    hist = value(mon, "perfmon_forward_batch_size_count", model="lin")
    timed = value(mon, "perfmon_forward_sampled_total", model="lin")
    assert hist == timed  # one batch-size observation per timed call
    assert value(mon, "perfmon_forward_batch_size_bucket", model="lin", le="8.0") == hist


def test_items_callable_counts_effective_and_padded_exactly(make_monitor) -> None:
    """A callable returning (tokens, padded tokens) from an attention mask is summed exactly; /stats has the ratio."""
    mon = make_monitor(sample_rate=0.1)

    def tokens(args, kwargs):
        mask = kwargs["attention_mask"]
        return int(mask.sum()), mask.numel()

    def encode(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return input_ids * attention_mask

    fn = mon.instrument(encode, name="enc", items=tokens)
    per_thread = 800

    def work(i: int) -> None:
        for k in range(per_thread):
            length = 1 + (k * 7 + i) % 16
            mask = torch.zeros(2, 16, dtype=torch.long)
            mask[:, :length] = 1
            fn(torch.ones(2, 16, dtype=torch.long), attention_mask=mask)

    _run_threads(work)
    effective = sum(2 * (1 + (k * 7 + i) % 16) for i in range(6) for k in range(per_thread))
    padded = 6 * per_thread * 32
    assert value(mon, "perfmon_forward_items_total", model="enc") == effective
    assert value(mon, "perfmon_forward_padded_items_total", model="enc") == padded
    stats = mon.stats()["models"]["enc"]
    assert stats["items"] == effective and stats["padded_items"] == padded
    assert stats["padding_ratio"] == pytest.approx(1 - effective / padded)


def test_an_items_callable_counts_every_one_tensor_call_of_a_warm_shape(make_monitor) -> None:
    """A module called with one tensor of one shape (the hot path's common call) still has its ``items`` callable run
    on every call once the shape is warm: the rows that are not padding, which the batch dimension would not give."""
    mon = make_monitor(sample_rate=0.01, warmup_calls=0)

    def real_rows(args, kwargs):
        return int((args[0].abs().sum(dim=1) > 0).sum())

    model = mon.wrap(torch.nn.Linear(4, 4), name="lin", items=real_rows)
    expected = 0
    for k in range(300):
        x = torch.zeros(8, 4)
        x[: k % 9] = 1.0  # 0..8 real rows of 8
        model(x)
        expected += k % 9
    assert value(mon, "perfmon_forward_calls_total", model="lin") == 300
    assert value(mon, "perfmon_forward_items_total", model="lin") == expected


@pytest.mark.parametrize("bad", [
    lambda a, k: -1, lambda a, k: "many", lambda a, k: (5, 3), lambda a, k: 1 / 0, lambda a, k: 2.5,
    lambda a, k: True,
])
def test_faulty_items_callable_never_breaks_a_call(make_monitor, bad) -> None:
    """A callable that raises or returns nonsense is an internal error; the call's result is untouched."""
    mon = make_monitor(sample_rate=1.0)
    fn = mon.instrument(lambda x: x + 1, name="f", items=bad)
    assert [fn(i) for i in range(3)] == [1, 2, 3]
    assert value(mon, "perfmon_internal_errors_total", stage="items") == 3
    assert value(mon, "perfmon_forward_calls_total", model="f") == 3
    assert value(mon, "perfmon_forward_items_total", model="f") == 0


def test_items_stay_exact_across_signature_eviction_and_churn(make_monitor) -> None:
    """With a tiny signature table, evicted and churning signatures still count every item."""
    mon = make_monitor(sample_rate=0.01, signature_cache_size=4, warmup_calls=0)
    model = mon.wrap(torch.nn.Linear(3, 3), name="lin")
    total = 0
    for n in range(1, 40):  # 39 distinct batch sizes: evictions, then churn
        for _ in range(3):
            model(torch.zeros(n, 3))
            total += n
    assert mon.stats()["models"]["lin"]["signature_tracking"] is False
    assert value(mon, "perfmon_forward_items_total", model="lin") == total


def test_items_off_and_bad_items_argument(make_monitor) -> None:
    """items=False counts nothing; a non-callable items argument is a ConfigError."""
    mon = make_monitor()
    fn = mon.wrap(torch.nn.Linear(2, 2), name="m", items=False)
    fn(torch.zeros(5, 2))
    assert value(mon, "perfmon_forward_items_total", model="m") is None
    with pytest.raises(perfmon.ConfigError, match="items"):
        mon.wrap(torch.nn.Linear(2, 2), name="x", items=5)
