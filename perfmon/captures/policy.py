"""When perfmon captures on its own: a regression arms a capture, a healthy model gets a baseline one.

Runs on the resolver thread: ``sink`` takes each resolved sample, ``tick`` closes windows, retries a
regression capture that found the profiler busy and keeps each model's baseline capture fresh.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from time import perf_counter_ns
from typing import Any

from ..agent.models import Models
from ..agent.records import STEADY, Sample, series_key, split_key
from ..config import REGRESSION_VARIABLE
from ..exceptions import ConfigError
from ..faults import InternalErrors
from .controller import CaptureController
from .detector import Detector, Regression, RegressionPolicy, WindowStats, class_label
from .moved import summarise
from .records import CaptureOptions

__all__ = ["BASELINE_CHECK_SECONDS", "DEFERRED_SECONDS", "FROM_ENV", "CapturePolicy", "resolve_policy"]

#: How often (seconds) a model's baseline capture is looked up in the trace store (a directory read).
BASELINE_CHECK_SECONDS = 30.0
_NEVER = 2**63 - 1  # perf_counter_ns far ahead: no look falls due
#: How long (seconds) a regression capture that found the capture slot busy waits for it to free.
DEFERRED_SECONDS = 120.0
_DEFER_NS = int(DEFERRED_SECONDS * 1e9)


#: ``Monitor(regression=...)``'s default: a default ``RegressionPolicy``, unless ``PERFMON_REGRESSION`` is off.
FROM_ENV: Any = object()


_REGRESSION_OFF = ("0", "off", "false", "no", "none")
_REGRESSION_ON = ("", "1", "on", "true", "yes")


def resolve_policy(regression: Any, environ: Mapping[str, str] = os.environ) -> RegressionPolicy | None:
    """``Monitor(regression=...)``: a ``RegressionPolicy``, None (off), or ``FROM_ENV``; else ``ConfigError``."""
    if regression is FROM_ENV:
        text = environ.get(REGRESSION_VARIABLE, "").strip().lower()
        if text not in _REGRESSION_OFF + _REGRESSION_ON:  # as every other PERFMON_* setting: a typo is not ignored
            raise ConfigError(f"PERFMON_REGRESSION={text!r}: expected one of {', '.join(_REGRESSION_OFF)} (off) or "
                              f"{', '.join(_REGRESSION_ON[1:])} (on, the default policy), or unset")
        regression = None if text in _REGRESSION_OFF else RegressionPolicy()
    if regression is not None and not isinstance(regression, RegressionPolicy):
        raise ConfigError(f"regression={regression!r}: expected a perfmon.RegressionPolicy or None")
    return regression


class CapturePolicy:
    """Regression → capture, and baseline captures, for one monitor (resolver thread; fail soft).

    ``policy`` None: regressions are neither detected nor captured (``detector`` is None).
    """

    def __init__(self, policy: RegressionPolicy | None, *, models: Models, captures: CaptureController,
                 internal: InternalErrors, log: Any,
                 explainers: list[Callable[[str, str, int, int], tuple[str, Any]]] | None = None) -> None:
        self.policy = policy
        self.detector = Detector(policy) if policy is not None else None
        self._models = models
        self._captures = captures
        self._internal = internal
        self._log = log
        #: How often (seconds) a model's baseline capture is looked up in the trace store.
        self.baseline_check_seconds = BASELINE_CHECK_SECONDS
        #: model -> perf_counter_ns of the last look for its baseline capture (the store is read at most
        #: every baseline_check_seconds per model).
        self._baseline_checked: dict[str, int] = {}
        #: The detector's ``windows_closed`` at the last look for baselines, and when a model's next look falls due
        #: (perf_counter_ns): between the two, a look would find what the last one found.
        self._looked_at = -1
        self._next_look_ns = 0
        self._look_every_ns = -1  # baseline_check_seconds at the last look: a change (at run time) looks again
        #: Extra entries for a regression's reason, each ``(model, stage, since_ns, until_ns) -> (key, value)``
        #: over the regressed windows (stats/gc.py's ``gc``, the /stats windows' ``host_device``, the request
        #: spans' ``queue``); ``moved`` sums them up (captures/moved.py).
        self.explainers: list[Callable[[str, str, int, int], tuple[str, Any]]] = list(explainers or ())
        #: series key -> (state, options, reason, expiry ns): a regression capture that found the slot busy.
        self.deferred: dict[str, tuple[Any, CaptureOptions, dict[str, Any], int]] = {}

    def reset_after_fork(self) -> None:
        self.deferred, self._baseline_checked = {}, {}  # the parent's regressions are the parent's
        self._looked_at, self._next_look_ns, self._look_every_ns = -1, 0, -1
        if self.detector is not None:
            self.detector.reset_after_fork()

    def sink(self, samples: list[Sample]) -> None:
        """Steady-state samples (a pass's) feed the regression detector."""
        detector = self.detector
        if detector is None:
            return
        for sample in samples:
            if sample.phase == STEADY:
                # Each stage of a generative model has its own baseline: prefill and decode never mix.
                # Like with like: each sample is judged against its own size class (its work, Sample.size).
                fired = detector.add(series_key(sample.model, sample.stage), sample.duration_seconds, sample.end_ns,
                                     sample.size)
                if fired:
                    self.fire(fired)

    def tick(self, now_ns: int) -> int | None:
        """Close due windows, arm a deferred regression capture, keep baselines fresh; returns when the next
        window closes or look falls due (perf_counter_ns; ``now_ns`` while a regression's capture waits; None)."""
        detector = self.detector
        if detector is None:
            return None
        self.fire(detector.tick(now_ns))
        self._retry_deferred(now_ns)
        self._baseline_captures(now_ns)
        if self.deferred:
            return now_ns
        due = detector.due_ns()
        policy, look = self.policy, self._next_look_ns
        if policy is not None and policy.baseline_capture and look != _NEVER and (due is None or look < due):
            due = max(look, now_ns)
        return due

    def fire(self, regressions: list[Regression]) -> None:
        """Log each regression and arm its capture (or keep it for when the profiler frees)."""
        policy = self.policy
        for r in regressions:
            model, stage = split_key(r.model)
            details = {**r.as_dict(), "model": model, **({"stage": stage} if stage else {})}
            for explain in self.explainers:
                try:
                    key, value = explain(model, stage, *r.span_ns)
                    if value is not None:
                        details[key] = value
                except Exception as exc:  # the regression and its capture go on without it
                    self._internal.report("regression_reason", exc)
            try:
                assert self.detector is not None
                details["moved"] = summarise(details, before_classes=self.detector.healthy_classes(r.model))
            except Exception as exc:
                self._internal.report("regression_reason", exc)
            self._log.warning("latency_regression", **details)
            st = self._models.get(model)
            if st is None or policy is None or not st.capturable:
                continue
            options = CaptureOptions(steps=policy.capture_steps, max_seconds=policy.capture_max_seconds,
                                     record_shapes=policy.capture_record_shapes,
                                     with_stack=policy.capture_with_stack,
                                     profile_memory=policy.capture_profile_memory)
            # Busy before the arm or after it: a manual capture (the HTTP thread) can take a slot that was idle a
            # moment before (seen on a loaded host: the regression's log line lies between the look and the arm), and
            # the capture that held it can end meanwhile (its export, a cancel); either way the regression capture
            # was dropped for good.
            busy = self._captures.state != "idle"
            if self._captures.auto(st, options, details) is None and (
                    busy or self._captures.state != "idle" or 0 < self._cooldown_ns() < _DEFER_NS):
                # Another capture (a baseline, a manual one) holds the profiler, or the cooldown another model's
                # capture started ends soon: the detector fires once per regression, so keep this one and arm it
                # when the slot frees and the cooldown lets it, while the regression lasts.
                self.deferred[r.model] = (st, options, details, perf_counter_ns() + _DEFER_NS)

    def _cooldown_ns(self) -> int:
        """Nanoseconds until the automatic cooldown lets a regression capture arm (0: it would now)."""
        return int(self._captures.limits.cooldown_left(self._captures.clock()) * 1e9)

    def _retry_deferred(self, now_ns: int) -> None:
        """Arm a regression capture that found the slot busy, once it is free."""
        if not self.deferred or self._captures.state != "idle" or self.detector is None:
            return
        active = {key for key, _, _, is_active, _ in self.detector.views() if is_active}
        for key, (st, options, details, expires_ns) in list(self.deferred.items()):
            del self.deferred[key]
            if key in active and now_ns < expires_ns:
                wait_ns = self._cooldown_ns()
                if wait_ns and now_ns + wait_ns < expires_ns:
                    # The capture that held the slot started the cooldown (two models regressing at once, the slot
                    # freed before the cooldown ends): keep this one until the cooldown lets it arm.
                    self.deferred[key] = (st, options, details, expires_ns)
                    return
                if self._captures.auto(st, options, details) is None and self._captures.state != "idle":
                    # Another capture (a manual one, on the HTTP thread) took the slot since the check above: the
                    # detector will not fire again for this regression, so keep it for when that one ends.
                    self.deferred[key] = (st, options, details, expires_ns)
                return  # one capture at a time

    def _baseline_captures(self, now_ns: int) -> None:
        """Arm a ``baseline`` capture of a model whose baseline is learned, no regression active, when it
        has none younger than ``baseline_capture_max_age_seconds``."""
        policy, det = self.policy, self.detector
        if policy is None or det is None or not policy.baseline_capture or self._captures.state != "idle":
            return
        # What this finds changes only when a window closes (a baseline learned, a regression begun or ended) or a
        # model's next look in the store falls due. Between the two it would rebuild every series' views and
        # baselines for nothing, on every idle wake of the resolver (a second apart): ~25 µs of a cold wake's ~160.
        interval_ns = int(self.baseline_check_seconds * 1e9)
        if det.windows_closed == self._looked_at and now_ns < self._next_look_ns and interval_ns == self._look_every_ns:
            return
        self._looked_at, self._look_every_ns = det.windows_closed, interval_ns
        learned: dict[str, bool] = {}  # model -> every learned series healthy
        baselines: dict[str, dict[str, Any]] = {}
        mixes: dict[str, list[str | None]] = {}  # model -> each series' dominant size class
        for key, window, base, active, _ in det.views():
            model, stage = split_key(key)
            if base is not None or active:
                learned[model] = learned.get(model, True) and not active
                baselines.setdefault(model, {})[stage or "all"] = base
                mixes.setdefault(model, []).append(_dominant(window))
        self._next_look_ns = _NEVER
        for model, healthy in learned.items():
            last = self._baseline_checked.get(model)
            if not healthy:
                continue  # looked at again when a window closes
            if last is not None and now_ns - last < interval_ns:
                self._next_look_ns = min(self._next_look_ns, last + interval_ns)
                continue
            self._baseline_checked[model] = now_ns
            self._next_look_ns = min(self._next_look_ns, now_ns + interval_ns)
            st = self._models.get(model)
            if st is None or not st.capturable:
                continue
            # A baseline per size class that traffic has: the one most of a single-series model's last window
            # ran (a regression at batch 256 is compared with a baseline at batch 256, not 4). A generative
            # model's capture mixes its stages' sizes: one baseline, whatever the size.
            classes = mixes.get(model, [])
            size = classes[0] if len(classes) == 1 else None
            try:
                meta = self._captures.latest_baseline(model, size)
                age = _age_seconds(meta.get("ended_at")) if meta is not None else None
                if age is not None and age < policy.baseline_capture_max_age_seconds:
                    continue
                options = CaptureOptions(steps=policy.capture_steps, max_seconds=policy.capture_max_seconds,
                                         record_shapes=policy.capture_record_shapes)
                reason = {"baseline_seconds": baselines.get(model), "size_class": size,
                          "previous": None if meta is None else meta.get("id")}
                self._captures.baseline(st, options, reason)
            except Exception as exc:
                self._internal.report("baseline_capture", exc)
            self._next_look_ns = now_ns  # the models after this one: at the next look the controller is idle
            return  # one at a time: the controller holds one capture


def _dominant(window: WindowStats | None) -> str | None:
    """The label of the size class that held most (over half) of a window's samples, else None."""
    if window is None or not window.count:
        return None
    label = class_label(window.dominant)
    held = window.classes.get(label, {}).get("samples", 0)
    return label if held * 2 > window.count and label != class_label(0) else None


def _age_seconds(iso: Any) -> float | None:
    """Seconds since an ISO 8601 UTC time stamp (a capture's ``ended_at``), or None when unreadable."""
    try:
        then = datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - then).total_seconds()
