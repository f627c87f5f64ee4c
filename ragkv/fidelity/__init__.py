"""Fidelity as a setting: a per-model report of how often each blend operating point keeps full
prefill's answer, and the gate that picks the point a request runs at (``fidelity=``)."""

from ragkv.fidelity.choose import (
    DEFAULT_FAST_SPEEDUP,
    DEFAULT_FIDELITY,
    GATE,
    OperatingPoint,
    choose,
    explicit_point,
    operating_point,
    parse_fidelity,
)
from ragkv.fidelity.report import FidelityReport, PointStats, ReportError, ReportKey, load_report

__all__ = [
    "DEFAULT_FAST_SPEEDUP",
    "DEFAULT_FIDELITY",
    "GATE",
    "FidelityReport",
    "OperatingPoint",
    "PointStats",
    "ReportError",
    "ReportKey",
    "choose",
    "explicit_point",
    "load_report",
    "operating_point",
    "parse_fidelity",
]
