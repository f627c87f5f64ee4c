"""A model's fidelity report: how often each operating point keeps full prefill's answer, and at what cost.

One JSON document per model fingerprint. It is trusted only when it verifies: the right report
version, model fingerprint, chunk convention, blend schedule and calibration set, and a sha256 over
its own content (a hand-edited or truncated file fails it). Reports for the default model ship in
the package (``ragkv/fidelity/reports/``); reports ``ragkv calibrate`` measures go to
``$RAGKV_CACHE_DIR/fidelity/<fingerprint>.json`` and take precedence.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.blend.core import BlendSchedule
from ragkv.defaults import CALIBRATION_SET
from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION
from ragkv.model.gguf import fingerprint_file, write_json_atomic

log = logging.getLogger("ragkv.fidelity")

#: bumped when the report's fields or the way it is measured change: older reports are re-measured
REPORT_VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent / "reports"


class ReportError(ValueError):
    """A report that cannot be trusted: corrupt, edited, or from another model, convention or set."""


@dataclass(frozen=True)
class ReportKey:
    """What a fidelity report is measured for, and so what a trusted one must match: the model's
    ``fingerprint``, the KV ``adapter``'s identity ("": none) and the blend options its ladder ran
    (``schedule``: :meth:`~ragkv.blend.core.BlendSchedule.options_key`; the default schedule's, the
    one the fidelity gate plans with, unless set)."""

    fingerprint: str
    adapter: str = ""
    schedule: str = BlendSchedule().options_key()


@dataclass
class PointStats:
    """One operating point measured against float32 full prefill on the calibration set.

    ``*_ci`` are 95% bootstrap intervals over questions; ``same_minus_floor_ci`` is the paired
    interval of (this point's same-answer indicator - bf16 full prefill's), question by question.
    """

    name: str  # "full-bf16", "exact", "reuse", "blend@0.5"
    mode: str  # the prefill mode: full, prefix, reuse, blend
    ratio: float | None  # the blend share recomputed (None: not a blend)
    n: int
    same: float
    same_ci: tuple[float, float]
    f1_vs_full: float
    f1_vs_full_ci: tuple[float, float]
    kl: float
    kl_ci: tuple[float, float]
    recall: float
    recall_ci: tuple[float, float]
    charged: float  # mean rows x layers computed over a full prefill's (every pass)
    speedup: float  # median over questions of full's TTFT / this point's (paired, same run)
    speedup_ci: tuple[float, float]
    same_minus_floor_ci: tuple[float, float] = (0.0, 0.0)
    splits: dict[str, dict[str, float]] = field(default_factory=dict)  # split -> {same, recall, speedup}

    @classmethod
    def from_dict(cls, d: dict) -> PointStats:
        d = dict(d)
        for k, v in d.items():
            if k.endswith("_ci"):
                d[k] = (float(v[0]), float(v[1]))
        return cls(**d)


@dataclass
class FidelityReport:
    """Every point of a model's curve, the noise floor, the monotonicity check and compute to the floor."""

    model: str
    fingerprint: str
    schedule: str  # the blend schedule the ladder used (its repr): another default is another report
    calibration_set: str  # sha256 of the calibration set file
    n_questions: int
    max_new_tokens: int
    full_recall: float
    full_ttft_s: float  # median TTFT of float32 full prefill
    floor: PointStats  # full prefill in bfloat16: the answer changes a dtype change alone causes
    points: list[PointStats]  # exact, reuse and the blend ladder, in increasing ratio
    monotone_ok: bool
    monotone_violations: list[str]
    compute_to_floor: float | None  # the least charged compute of a blend point that meets the floor
    measured_at: str
    machine: str
    version: int = REPORT_VERSION
    convention: int = CHUNK_CONVENTION_VERSION
    #: the KV adapter the reused chunks were read through ("": none): a (model, adapter) pair's own report
    adapter: str = ""
    digest: str = ""

    # ---- serialization -----------------------------------------------------------------------
    def content(self) -> dict:
        """Everything but the digest, as plain JSON types."""
        d = asdict(self)
        d.pop("digest")
        return json.loads(json.dumps(d))  # tuples -> lists, as read back

    def seal(self) -> FidelityReport:
        self.digest = _digest(self.content())
        return self

    def to_json(self) -> str:
        return json.dumps({**self.content(), "digest": self.digest}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> FidelityReport:
        """Parse and verify the digest (``ReportError`` if the text is not a sealed report)."""
        try:
            d = json.loads(text)
            digest = d.pop("digest")
            if digest != _digest(d):
                raise ReportError("report digest mismatch: the file was edited or is corrupt")
            d["floor"] = PointStats.from_dict(d["floor"])
            d["points"] = [PointStats.from_dict(p) for p in d["points"]]
            return cls(**d, digest=digest)
        except ReportError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ReportError(f"unreadable fidelity report: {e}") from e

    def point(self, name: str) -> PointStats:
        for p in self.points:
            if p.name == name:
                return p
        raise KeyError(name)

    def blend_points(self) -> list[PointStats]:
        return sorted((p for p in self.points if p.mode == "blend"), key=lambda p: p.ratio or 0.0)


def _digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def calibration_set_digest(path: Path = CALIBRATION_SET) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def report_id(fingerprint: str, adapter: str = "") -> str:
    """The name of a report's file: the model's fingerprint, or a digest of (model, adapter)."""
    return hashlib.sha256(f"{fingerprint}+{adapter}".encode()).hexdigest() if adapter else fingerprint


def cache_path(fingerprint: str, directory: Path | None = None, adapter: str = "") -> Path:
    """Where ``ragkv calibrate`` keeps a model's report (``$RAGKV_CACHE_DIR/fidelity/<fp>.json``)."""
    return fingerprint_file("fidelity", report_id(fingerprint, adapter), directory)


def shipped_path(fingerprint: str, adapter: str = "") -> Path:
    return fingerprint_file("fidelity", report_id(fingerprint, adapter), SHIPPED_DIR)


def save_report(report: FidelityReport, path: Path) -> None:
    write_json_atomic(path, json.loads(report.seal().to_json()), indent=1)


def check_report(report: FidelityReport, key: ReportKey, set_digest: str) -> None:
    """``ReportError`` unless ``report`` was measured for ``key`` (model, adapter, schedule), this
    chunk convention and report version, and the calibration set of digest ``set_digest``."""
    wrong = [
        what
        for what, have, want in (
            ("report version", report.version, REPORT_VERSION),
            ("model fingerprint", report.fingerprint, key.fingerprint),
            ("chunk convention", report.convention, CHUNK_CONVENTION_VERSION),
            ("blend schedule", report.schedule, key.schedule),
            ("calibration set", report.calibration_set, set_digest),
            ("KV adapter", report.adapter, key.adapter),
        )
        if have != want
    ]
    if wrong:
        raise ReportError(f"fidelity report of another {', '.join(wrong)}")


def load_report(key: ReportKey, directory: Path | None = None) -> FidelityReport | None:
    """The trusted report of ``key``: the measured one in the cache, else the shipped one, else None.

    A file that fails verification is logged and skipped (never trusted): the gate then falls back
    to exact prefill until ``ragkv calibrate`` measures the model again.
    """
    set_digest = calibration_set_digest()
    for path in (
        cache_path(key.fingerprint, directory, key.adapter),
        shipped_path(key.fingerprint, key.adapter),
    ):
        if not path.is_file():
            continue
        try:
            report = FidelityReport.from_json(path.read_text())
            check_report(report, key, set_digest)
            return report
        except (ReportError, OSError, UnicodeDecodeError) as e:
            log.warning("ignoring fidelity report %s: %s", path, e)
    return None
