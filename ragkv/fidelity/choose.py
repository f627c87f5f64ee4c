"""The fidelity setting: which operating point a blend runs at, chosen from the model's fidelity report.

Targets (``fidelity=`` on every surface):

* ``"floor"`` (the default): the cheapest point (charged compute) that keeps full prefill's answer at least as often as
  full prefill in bfloat16 does (the noise floor: answer changes users already accept from a dtype
  change), with gold recall within ``RECALL_SLACK`` of full's.
* ``"exact"``: no approximation: full prefill with the instruction prefix's exact KV reused.
* ``"fast"`` / ``"fast:X"``: the most faithful point whose measured TTFT speed-up is at least X (2.5).
* a number in (0, 1]: the cheapest point whose same-answer rate is at least that number.

A blend point is chosen over exact prefill only when it charges less compute and its measured TTFT
is shorter than exact's (at high ratios a blend recomputes as much as exact prefill does).

A blend point meets a same-answer threshold only if every point of the ladder above it does too (a
lucky low ratio under a dip is not trusted; docs/DEVIATIONS.md). When no point meets the target,
or the model has no trusted report, the request runs exact, and one log line says why.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ragkv.defaults import DEFAULT_FIDELITY
from ragkv.fidelity.report import FidelityReport, PointStats, ReportKey, load_report

log = logging.getLogger("ragkv.fidelity")

DEFAULT_FAST_SPEEDUP = 2.5
#: gold recall a point may lose against full prefill and still meet "floor" (the issue's 0.03)
RECALL_SLACK = 0.03
NAMED = ("floor", "exact", "fast")


def parse_fidelity(value: str | float | None) -> str:
    """The canonical form of a fidelity setting (``ValueError`` for anything else)."""
    if value is None:
        return DEFAULT_FIDELITY
    if isinstance(value, bool):
        raise ValueError(f"fidelity must be one of {NAMED}, 'fast:X' or a number in (0, 1]; got {value!r}")
    if isinstance(value, int | float):
        if not 0.0 < float(value) <= 1.0:
            raise ValueError(f"a numeric fidelity is a same-answer rate in (0, 1]; got {value!r}")
        return repr(float(value))
    text = str(value).strip().lower()
    if text in NAMED:
        return text
    if text.startswith("fast:"):
        try:
            x = float(text[5:])
        except ValueError:
            x = 0.0
        if x > 1.0:
            return f"fast:{x:g}"
        raise ValueError(f"fidelity 'fast:X' needs a speed-up X > 1; got {value!r}")
    try:
        return parse_fidelity(float(text))
    except ValueError:
        raise ValueError(
            f"fidelity must be one of {NAMED}, 'fast:X' (X > 1) or a number in (0, 1]; got {value!r}"
        ) from None


@dataclass(frozen=True)
class OperatingPoint:
    """What a blend request runs as (``mode``, ``ratio``) and why, with the report's figures for it."""

    target: str  # the fidelity setting ("floor", "exact", "fast:2.5", "0.9") or "explicit"
    mode: str  # the prefill mode to run: blend, reuse or prefix (exact)
    ratio: float | None
    point: str  # the report's point name, "explicit" or "exact"
    source: str  # "report", "no-report" (fell back), "not-met" (fell back), "explicit" (outside the gate)
    same: float | None = None  # its same-answer rate vs full prefill on the calibration set
    same_ci: tuple[float, float] | None = None
    speedup: float | None = None
    charged: float | None = None
    noise_floor_same: float | None = None
    changed_answers: str | None = None  # e.g. "12 of 96": answers this point changes on the set
    adapter: str | None = None  # the KV adapter this point was measured with (None: none)

    @property
    def outside_gate(self) -> bool:
        return self.source == "explicit"

    def as_stats(self) -> dict:
        """The ``fidelity`` entry of a response's stats and of /healthz."""
        return {
            "target": self.target,
            "point": self.point,
            "mode": self.mode,
            "ratio": self.ratio,
            "source": self.source,
            "outside_gate": self.outside_gate,
            "same_as_full": self.same,
            "same_as_full_ci": list(self.same_ci) if self.same_ci else None,
            "speedup": self.speedup,
            "charged_compute": self.charged,
            "noise_floor_same": self.noise_floor_same,
            "changed_answers": self.changed_answers,
            "adapter": self.adapter,
        }

    def describe(self) -> str:
        """One line for logs and the demo."""
        if self.source == "explicit":
            return f"{self.mode} at ratio {self.ratio} (set explicitly: outside the fidelity gate)"
        head = f"fidelity {self.target!r} -> {self.point} ({self.mode}" + (
            f" at ratio {self.ratio:g}" if self.ratio is not None else ""
        )
        head += f", KV adapter {self.adapter})" if self.adapter else ")"
        if self.source == "no-report":
            return f"{head}: no trusted fidelity report for this model (`ragkv calibrate` measures one)"
        if self.same is None or self.speedup is None:
            return f"{head}: {self.source}"
        if self.source == "not-met":
            head += ", as no measured point meets the target"
        return (
            f"{head}: keeps full prefill's answer on {self.same:.0%} of the calibration set (changes "
            f"{self.changed_answers}; noise floor {self.noise_floor_same:.0%}), {self.speedup:.2f}x TTFT, "
            f"charged compute {self.charged:.2f}"
        )


def _op(target: str, p: PointStats, report: FidelityReport, source: str = "report") -> OperatingPoint:
    changed = round((1.0 - p.same) * p.n)
    adapter = report.adapter if p.mode in ("reuse", "blend") and report.adapter else None
    return OperatingPoint(
        target,
        p.mode,
        p.ratio,
        p.name,
        source,
        p.same,
        p.same_ci,
        p.speedup,
        p.charged,
        report.floor.same,
        f"{changed} of {p.n}",
        adapter,
    )


def exact_point(target: str, source: str, report: FidelityReport | None = None) -> OperatingPoint:
    """Exact prefill (the prefix's exact KV reused): the fallback of every target."""
    if report is not None:
        try:
            return _op(target, report.point("exact"), report, source)
        except KeyError:
            pass
    return OperatingPoint(target, "prefix", None, "exact", source)


def _trusted(ladder: list[PointStats], ok) -> list[PointStats]:
    """Points of the ladder that meet ``ok`` with every point above them meeting it too."""
    out = []
    for p in reversed(ladder):
        if not ok(p):
            break
        out.append(p)
    return out


def choose(report: FidelityReport | None, target: str) -> OperatingPoint:
    """The operating point for ``target`` (canonical, see :func:`parse_fidelity`) from ``report``."""
    if target == "exact":
        return exact_point(target, "report" if report else "no-report", report)
    if report is None:
        return exact_point(target, "no-report")
    ladder = sorted((p for p in report.points if p.mode in ("reuse", "blend")), key=lambda p: p.ratio or 0.0)
    if target.startswith("fast"):
        need = float(target[5:]) if ":" in target else DEFAULT_FAST_SPEEDUP
        fast = [p for p in ladder if p.speedup >= need]
        if not fast:
            return exact_point(target, "not-met", report)
        best = max(fast, key=lambda p: (p.same, p.f1_vs_full, p.speedup))
        return _op(target, best, report)
    if target == "floor":
        ok = lambda p: p.same >= report.floor.same and p.recall >= report.full_recall - RECALL_SLACK  # noqa: E731
    else:
        ok = lambda p: p.same >= float(target)  # noqa: E731
    meeting = _trusted(ladder, ok)
    if not meeting:
        return exact_point(target, "not-met", report)
    # the least charged compute (deterministic, unlike a timing), if it is below exact prefill's and faster
    best = min(meeting, key=lambda p: p.charged)
    exact = exact_point(target, "report", report)
    if exact.charged is not None and (best.charged >= exact.charged or best.speedup <= exact.speedup):
        return exact
    return _op(target, best, report)


class FidelityGate:
    """Per-process cache of each model's trusted report and chosen points; logs each fallback once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: dict[ReportKey, FidelityReport | None] = {}
        self._logged: set[tuple[str, str, str, str]] = set()

    def report(self, key: ReportKey) -> FidelityReport | None:
        """The trusted report of ``key`` (model, KV adapter, blend options), read once per process."""
        with self._lock:
            if key not in self._reports:
                self._reports[key] = load_report(key)
            return self._reports[key]

    def forget(self, fingerprint: str | None = None) -> None:
        """Drop cached reports (all, or one model's): the next request reads the files again (and a fallback is said again)."""
        with self._lock:
            for key in [k for k in self._reports if fingerprint in (None, k.fingerprint)]:
                del self._reports[key]
            self._logged = {k for k in self._logged if fingerprint not in (None, k[0])}

    def _first_time(self, key: tuple[str, str, str, str]) -> bool:
        """Whether a fallback (``key``) is not said yet, marking it said: once, even when a model's first
        requests arrive together. Bounded (clients may send many numeric targets): past 4096 keys a new
        one is said every time rather than remembered."""
        with self._lock:
            if key in self._logged:
                return False
            if len(self._logged) < 4096:
                self._logged.add(key)
            return True

    def point(
        self,
        model_name: str,
        fingerprint: str,
        fidelity: str | float | None,
        adapter: str = "",
    ) -> OperatingPoint:
        """The point ``fidelity`` runs at on the model, from its (or its pair with the KV adapter of
        identity ``adapter``'s) report of the default blend options; a fallback is said once."""
        target = parse_fidelity(fidelity)
        op = choose(self.report(ReportKey(fingerprint, adapter)), target)
        if op.source in ("no-report", "not-met") and self._first_time(
            (fingerprint, adapter, target, op.source)
        ):
            why = (
                "it has no trusted fidelity report (run `ragkv calibrate --model ...`)"
                if op.source == "no-report"
                else "no measured operating point meets that target"
            )
            log.warning(
                "fidelity %r on model %s: blending falls back to exact prefill because %s",
                target,
                model_name,
                why,
            )
        return op

    def adapter_wins(
        self, model_name: str, plain: OperatingPoint, paired: OperatingPoint, adapter: str
    ) -> bool:
        """Whether the (model, adapter) pair's point beats the model's own for the same target: it
        meets the target from its own report, reuses chunk KV, and costs less charged compute (``fast``:
        keeps more answers). When it does not, that is said once per (model, adapter, target)."""
        wins = (
            paired.source == "report"
            and paired.mode in ("reuse", "blend")
            and paired.charged is not None
            and (
                plain.source != "report"
                or (
                    paired.same is not None and plain.same is not None and paired.same > plain.same
                    if plain.target.startswith("fast")
                    else plain.mode == "prefix" or plain.charged is None or paired.charged < plain.charged
                )
            )
        )
        if not wins and self._first_time(("adapter-off", adapter, plain.target, paired.source)):
            why = (
                "it has no trusted report for this model (`ragkv calibrate --adapter FILE` measures one)"
                if paired.source == "no-report"
                else "its report has no point that meets the target more cheaply than the model alone"
            )
            # a measured pair that loses is the expected state (info); no report for it is a setup gap (warning)
            level = logging.WARNING if paired.source == "no-report" else logging.INFO
            log.log(
                level,
                "KV adapter %s is off for fidelity %r on model %s: %s",
                adapter,
                plain.target,
                model_name,
                why,
            )
        return wins


#: the process's gate (reports are per model fingerprint, so one serves every model)
GATE = FidelityGate()


def operating_point(model, fidelity: str | float | None = None, adapter: str = "") -> OperatingPoint:
    """The point a blend with no explicit ratio (and no blend schedule: the default one's report)
    runs at on ``model`` (a loaded ``ragkv`` model), with the KV adapter of identity ``adapter``
    ("": none): each pair is judged by its own report."""
    return GATE.point(model.name, model.fingerprint, fidelity, adapter)


def explicit_point(mode: str, ratio: float | None) -> OperatingPoint:
    """A mode/ratio the caller set: run as asked, reported as outside the gate."""
    return OperatingPoint("explicit", mode, ratio, "explicit", "explicit")
