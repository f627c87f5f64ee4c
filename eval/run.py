"""Evaluate every prefill mode on MuSiQue / 2WikiMQA: answer quality, fidelity vs full, and TTFT.

    python -m eval.run --dataset musique --model PATH_OR_ID [--modes full,prefix,reuse,blend,default]
        [--ratios 0.15] [--limit N] [--device cpu|cuda] [--dtype float32|bfloat16] [--out DIR]
        [--num-chunks N] [--chunk-tokens N] [--retrieval] [--summary-json]

Per sample: the prompt is built as CacheBlend's evaluation does (eval.prompts), every passage's
KV is computed once and kept (passages repeat across samples), then each mode runs on the same
token ids: TTFT is ``prefill + first token`` with chunk KV already in memory (the paper's
setting); the answer is generated greedily; quality is SQuAD F1 / EM (max over golds); fidelity
vs ``full`` is the first token's KL and agreement, the output's F1 against full's output and the
attention deviation of the query rows. Records are appended to ``OUT/records.jsonl`` as they
finish; a rerun with the same settings skips finished (sample, mode, ratio) units, so a crash or
Ctrl-C loses nothing. ``OUT/results.json``, ``results.md`` and two PNG plots are (re)written at
the end. Numbers other than timings are deterministic (greedy decoding, seeded shuffle).

Mode ``default`` is what a user gets: ``ragkv.LLM.prefill`` called with no mode and no ratio, so the
fidelity gate picks the operating point (exact prefill on the default model), through the LLM's own
chunk resolver and prefix cache; its records say which point ran (``fidelity``, ``mode_run``).
``blend`` instead runs at the explicit ``--ratios``, outside the gate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.baselines import BASELINES, Baselines, warm_prefix_cache
from eval.fit import FitError, PassageFitter, fit_prompt
from eval.harness import progress
from eval.prompts import (
    DATASETS,
    TINY_MODEL,
    ChatFrame,
    DatasetFormatError,
    PromptBuilder,
    PromptIds,
    UnknownDatasetError,
    chat_frame,
    dataset_path,
    get_spec,
    load_samples,
)
from eval.report import PREFILL_MODES, aggregate, label_of, summary, write_outputs
from eval.scoring import score_answer, score_recall
from ragkv.blend import DEFAULT_RATIO, PrefixCache, UnknownModeError, prefill
from ragkv.generate import SamplingParams, generate
from ragkv.llm import LLM
from ragkv.metrics import attention_deviation, first_token_agreement, first_token_kl, token_f1
from ragkv.model import DEFAULT_MODEL, PromptTooLongError
from ragkv.model.forward import compute_chunk_kv

log = logging.getLogger("eval.run")

#: the default setting (no mode, no ratio: the fidelity gate's point), beside the explicit modes
DEFAULT_MODE = "default"
ALL_MODES = (*PREFILL_MODES, DEFAULT_MODE, *BASELINES)


class EvalConfigError(ValueError):
    """Bad evaluation arguments (unknown mode, bad ratio, mismatching output folder, ...)."""


@dataclass
class EvalConfig:
    """Everything that defines a run; the fields marked in ``_IDENTITY`` decide whether records can be reused."""

    dataset: str
    model: str = ""
    data: str | None = None
    modes: tuple[str, ...] = (*PREFILL_MODES, DEFAULT_MODE)
    ratios: tuple[float, ...] = (DEFAULT_RATIO,)
    default_ratio: float = DEFAULT_RATIO
    limit: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    out: str = ""
    num_chunks: int | None = None
    chunk_tokens: int | None = None
    max_new_tokens: int = 32
    map_tokens: int | None = None
    chat_template: bool = True
    retrieval: bool = False
    top_k: int | None = None
    attn_dev: bool = False
    shuffle_seed: int | None = None
    threads: int | None = None
    kv_cache_gb: float = 8.0
    plots: bool = True
    progress: bool = True
    overwrite: bool = False
    chat_frame: list[str] = field(default_factory=list)  # filled in: the template's head and tail

    _IDENTITY = (
        "dataset",
        "num_chunks",
        "chunk_tokens",
        "max_new_tokens",
        "map_tokens",
        "chat_template",
        "chat_frame",
        "retrieval",
        "top_k",
        "attn_dev",
        "shuffle_seed",
        "dtype",
        "device",
    )

    def validate(self) -> None:
        get_spec(self.dataset)
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise UnknownModeError(f"unknown mode(s) {bad}; use any of {', '.join(ALL_MODES)}")
        if not self.modes:
            raise EvalConfigError("no modes given")
        if "blend" in self.modes and not self.ratios:
            raise EvalConfigError("blend needs at least one --ratios value")
        if any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise EvalConfigError(f"recompute ratios must be in [0, 1], got {list(self.ratios)}")
        for name in ("limit", "num_chunks", "chunk_tokens", "top_k", "threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise EvalConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_new_tokens < 1:
            raise EvalConfigError("--max-new-tokens must be >= 1")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EvalConfigError(f"unknown device {self.device!r}; use cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise EvalConfigError("--device cuda asked but torch sees no CUDA device")

    @property
    def units(self) -> list[tuple[str, float | None, str]]:
        """(mode, ratio, label) in run order: full first (the fidelity reference)."""
        out = []
        for m in ALL_MODES:
            if m not in self.modes:
                continue
            if m == "blend":
                out += [(m, r, label_of(m, r)) for r in sorted(set(self.ratios))]
            else:
                out.append((m, None, m))
        return out


def _parse_list(text: str, kind, what: str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise EvalConfigError(f"bad {what} list {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m eval.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", required=True, help=f"one of {sorted(DATASETS)}")
    ap.add_argument(
        "--model",
        default=None,
        help=f"model name, GGUF file, folder or hub id (default: {DEFAULT_MODEL}; "
        "'tiny' for the repository's stories260k test model)",
    )
    ap.add_argument("--data", default=None, help="data file or folder (default: the repository's data/)")
    ap.add_argument(
        "--modes",
        default=",".join((*PREFILL_MODES, DEFAULT_MODE)),
        help=f"comma list of {', '.join(ALL_MODES)}; '{DEFAULT_MODE}' is the library's default setting "
        "(no mode, no ratio: the fidelity gate's point), 'blend' runs at the explicit --ratios",
    )
    ap.add_argument("--ratios", default=str(DEFAULT_RATIO), help="blend recompute ratios, comma list")
    ap.add_argument(
        "--default-ratio", type=float, default=DEFAULT_RATIO, help="ratio behind plain blend_* keys"
    )
    ap.add_argument("--limit", type=int, default=None, help="first N samples only")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", default=None, help="output folder (default runs/eval/<dataset>)")
    ap.add_argument("--num-chunks", type=int, default=None, help="keep N passages (gold-containing first)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="cut each passage to N tokens")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--map-tokens", type=int, default=None, help="tokens per map call (default: max-new-tokens)"
    )
    ap.add_argument(
        "--no-chat-template", action="store_true", help="plain prompts even if the model has a template"
    )
    ap.add_argument(
        "--retrieval", action="store_true", help="retrieve top-k passages from all of the dataset's"
    )
    ap.add_argument(
        "--top-k", type=int, default=None, help="passages retrieved (default: --num-chunks or 10)"
    )
    ap.add_argument(
        "--attn-dev",
        action="store_true",
        help="also measure the query rows' attention deviation (one more untimed prefill per mode)",
    )
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED", help="seeded random passage order")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for this process")
    ap.add_argument("--kv-cache-gb", type=float, default=8.0, help="memory for precomputed passage KV (LRU)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--overwrite", action="store_true", help="discard records of a different configuration")
    ap.add_argument("--summary-json", action="store_true", help="end with one JSON line of the aggregates")
    return ap


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    model = {None: DEFAULT_MODEL, "tiny": str(TINY_MODEL)}.get(args.model, args.model)
    cfg = EvalConfig(
        dataset=args.dataset,
        model=model,
        data=args.data,
        modes=_parse_list(args.modes, str, "mode"),
        ratios=_parse_list(args.ratios, float, "ratio"),
        default_ratio=args.default_ratio,
        limit=args.limit,
        device=args.device,
        dtype=args.dtype,
        out=args.out or str(Path("runs") / "eval" / args.dataset),
        num_chunks=args.num_chunks,
        chunk_tokens=args.chunk_tokens,
        max_new_tokens=args.max_new_tokens,
        map_tokens=args.map_tokens,
        chat_template=not args.no_chat_template,
        retrieval=args.retrieval,
        top_k=args.top_k,
        attn_dev=args.attn_dev,
        shuffle_seed=args.shuffle,
        threads=args.threads,
        kv_cache_gb=args.kv_cache_gb,
        plots=not args.no_plots,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    cfg.validate()
    return cfg


# ---- records on disk ----------------------------------------------------------------------------
class RecordLog:
    """``records.jsonl``: one JSON object per finished (sample, label), appended and flushed at once."""

    def __init__(self, out: Path, config_id: str, identity: dict, overwrite: bool):
        self.out = out
        self.path = out / "records.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        meta = out / "run_config.json"
        if meta.exists():
            old = json.loads(meta.read_text())
            if old.get("config_id") != config_id:
                if not overwrite:
                    diff = {
                        k: (old.get("identity", {}).get(k), v)
                        for k, v in identity.items()
                        if old.get("identity", {}).get(k) != v
                    }
                    raise EvalConfigError(
                        f"{out} holds records of another configuration (differences old -> new: {diff}); "
                        "use another --out, or --overwrite to discard them"
                    )
                self.path.unlink(missing_ok=True)
        meta.write_text(json.dumps({"config_id": config_id, "identity": identity}, indent=1))
        self.records: dict[tuple[int, str], dict] = {}
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            for i, line in enumerate(lines):
                try:
                    r = json.loads(line)
                except ValueError:
                    log.warning("%s line %d is truncated (interrupted write); ignoring it", self.path, i + 1)
                    continue
                if r.get("config_id") == config_id:
                    self.records[(r["sample"], r["label"])] = r
            self._rewrite_clean(lines)
        self._f = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()

    def _rewrite_clean(self, lines: list[str]) -> None:
        """Drop a truncated last line so appends start on a fresh line."""
        good = [ln for ln in lines if ln.strip()]
        try:
            json.loads(good[-1]) if good else None
        except ValueError:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records.values()))
            tmp.replace(self.path)

    def done(self, sample: int, label: str) -> bool:
        return (sample, label) in self.records

    def append(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        self.records[(record["sample"], record["label"])] = record

    def close(self) -> None:
        self._f.close()


# ---- the evaluation ---------------------------------------------------------------------------------
class Evaluator:
    """Holds the model, the precomputed passage KV and the caches; runs one sample at a time."""

    def __init__(self, cfg: EvalConfig, llm: LLM):
        self.cfg = cfg
        self.llm = llm
        self.model = llm.model
        # prefix mode's cache: one instruction + first-passage head per sample (LRU over samples)
        self.prefix_cache = PrefixCache(max_bytes=4 << 30)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
        self.baselines = None
        if any(m in BASELINES for m in cfg.modes):
            self.baselines = Baselines(
                self.model,
                ChatFrame(*cfg.chat_frame) if cfg.chat_frame else ChatFrame(),
                cfg.max_new_tokens,
                cfg.map_tokens or cfg.max_new_tokens,
            )
        self.kv_computed = 0
        self.kv_reused = 0
        self._seen_kv: set[str] = set()

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def chunk_kvs(self, prompt: PromptIds) -> list:
        """Every passage's stored KV (computed the first time a passage is seen, untimed)."""
        kvs = []
        for ids in prompt.chunks:
            kv = self.llm.chunk_kv(ids)
            if kv.key in self._seen_kv:
                self.kv_reused += 1
            else:
                self._seen_kv.add(kv.key)
                self.kv_computed += 1
            kvs.append(kv)
        return kvs

    def warm_prefix(self, prompt: PromptIds) -> None:
        """Exact prefix caching's state: the instruction and instruction + first passage are cached."""
        warm_prefix_cache(self.model, self.prefix_cache, prompt.prefix, prompt.chunks[:1])

    def _prefill(self, prompt: PromptIds, mode: str, ratio: float | None, kvs: list, **extra):
        """One prefill of ``prompt`` in ``mode`` (stored KV for reuse/blend, the prefix cache unless full)."""
        items = kvs if mode in ("reuse", "blend") else prompt.chunks
        pc = None if mode == "full" else self.prefix_cache
        return prefill(
            self.model,
            prompt.prefix,
            items,
            prompt.suffix,
            mode,
            ratio if ratio is not None else 0.0,
            prefix_cache=pc,
            prefix_cache_insert=False,
            **extra,
        )

    def timed_prefill(self, prompt: PromptIds, mode: str, ratio: float | None, kvs: list):
        self._sync()
        t0 = time.perf_counter()
        res = self._prefill(prompt, mode, ratio, kvs)
        first = int(res.logits.argmax())
        self._sync()
        return res, first, time.perf_counter() - t0

    def probe(self, prompt: PromptIds, mode: str, ratio: float | None, kvs: list):
        """Attention rows of the query suffix (untimed second prefill, so TTFT carries no probe cost)."""
        return self._prefill(prompt, mode, ratio, kvs, probe_suffix=True).attn_probs

    def warmup(self, prompt: PromptIds) -> None:
        """One short untimed prefill per prefill mode (the instruction and the first 32 tokens of
        the first passage), so lazy initialisations stay out of the first TTFT at a tiny cost."""
        if not prompt.chunks:
            return
        head = PromptIds(prompt.prefix, [prompt.chunks[0][:32]], prompt.suffix, {})
        kvs = [compute_chunk_kv(self.model, head.chunks[0])]
        for mode, ratio, _ in self.cfg.units:
            if mode in PREFILL_MODES:
                self._prefill(head, mode, ratio, kvs)
            elif mode == DEFAULT_MODE:
                self.default_prefill(head)

    def default_prefill(self, prompt: PromptIds):
        """The default setting: the LLM called with no mode and no ratio (the fidelity gate's point),
        over its own chunk resolver and prefix cache, as ``ragkv.LLM.generate`` runs for a user."""
        return self.llm.prefill(prompt.prefix, prompt.chunks, prompt.suffix)

    def timed_default(self, prompt: PromptIds):
        self._sync()
        t0 = time.perf_counter()
        res = self.default_prefill(prompt)
        first = int(res.logits.argmax())
        self._sync()
        return res, first, time.perf_counter() - t0

    def run_sample(
        self, sample, prompt: PromptIds, todo: list, done_full: dict | None, log_: RecordLog, config_id: str
    ) -> int:
        """Run the unfinished units of one sample; returns how many records were written."""
        cfg = self.cfg
        need_kv = any(m in ("reuse", "blend") for m, _, _ in todo)
        kvs = self.chunk_kvs(prompt) if need_kv else []
        self.warm_prefix(prompt)
        # the full-prefill reference (timed when its own record is due, else recomputed untimed)
        full_res, _, full_ttft = self.timed_prefill(prompt, "full", None, kvs)
        full_probs = self.probe(prompt, "full", None, kvs) if cfg.attn_dev else None
        if done_full is not None:
            full_text = done_full["output"]
        else:
            full_text = generate(self.model, full_res, self.params).text
        written = 0
        base = {
            "config_id": config_id,
            "dataset": cfg.dataset,
            "sample": sample.index,
            "question": sample.question,
            "golds": sample.answers,
            "gold_in_prompt": prompt.meta["gold_in_prompt"],
            "passages": prompt.meta["passages"],
        }
        for mode, ratio, label in todo:
            rec = dict(base, mode=mode, ratio=ratio, label=label)
            if mode == "full":
                res, ttft, text = full_res, full_ttft, full_text
            elif mode in PREFILL_MODES:
                res, _, ttft = self.timed_prefill(prompt, mode, ratio, kvs)
                text = generate(self.model, res, self.params).text
            elif mode == DEFAULT_MODE:
                res, _, ttft = self.timed_default(prompt)
                text = generate(self.model, res, self.params).text
                fid = res.stats.get("fidelity") or {}
                rec.update(mode_run=res.stats.get("mode"), fidelity=fid)
            else:
                b = self.baselines.map_reduce if mode == "mapreduce" else self.baselines.map_rerank
                br = b(sample.question, prompt.chunks)
                res, ttft, text = None, br.ttft_s, br.output
                rec.update(num_calls=br.num_calls, prompt_tokens=br.prompt_tokens, baseline=br.details)
            f1, em = score_answer(text, sample.answers)
            rec.update(output=text, f1=f1, em=em, recall=score_recall(text, sample.answers), ttft_s=ttft)
            rec["output_f1_vs_full"] = token_f1(text, full_text)
            rec["same_as_full"] = float(text == full_text)  # the same greedy answer as full prefill
            if res is not None:
                rec.update(
                    kl=first_token_kl(full_res.logits, res.logits),
                    first_token_agreement=float(first_token_agreement(full_res.logits, res.logits)),
                    first_token=int(res.logits.argmax()),
                    prompt_tokens=res.stats.get("num_tokens"),
                    recompute_fraction=res.stats.get("recompute_fraction"),
                    recomputed_per_layer=res.stats.get("recomputed_per_layer"),
                    fallback=res.stats.get("fallback"),
                )
                if full_probs is not None:
                    if mode == "full":
                        dev = [0.0] * len(full_probs)
                    elif mode == DEFAULT_MODE:  # the point the gate chose, probed as that mode runs it
                        probs = self.llm.prefill(
                            prompt.prefix, prompt.chunks, prompt.suffix, probe_suffix=True
                        ).attn_probs
                        dev = attention_deviation(full_probs, probs)
                    else:
                        dev = attention_deviation(full_probs, self.probe(prompt, mode, ratio, kvs))
                    rec.update(attn_dev=statistics.fmean(dev), attn_dev_per_layer=dev)
            rec["finished_at"] = time.time()
            log_.append(rec)
            written += 1
        return written


def _identity(cfg: EvalConfig, data_sha: str, fingerprint: str) -> dict:
    ident = {k: getattr(cfg, k) for k in EvalConfig._IDENTITY}
    ident.update(data_sha256=data_sha, model_fingerprint=fingerprint)
    return ident


def _sample_order(cfg: EvalConfig, sample) -> list[int] | None:
    if cfg.shuffle_seed is None:
        return None
    order = list(range(len(sample.texts)))
    random.Random(cfg.shuffle_seed * 1_000_003 + sample.index).shuffle(order)
    return order


def run_eval(cfg: EvalConfig) -> dict:
    """Run (or resume) the evaluation described by ``cfg``; returns the results dict (also written to disk)."""
    cfg.validate()
    spec = get_spec(cfg.dataset)
    samples = load_samples(spec, cfg.data)
    if cfg.limit is not None:
        samples = samples[: cfg.limit]
    data_sha = hashlib.sha256(dataset_path(spec, cfg.data).read_bytes()).hexdigest()
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, spec, samples, data_sha)
    finally:
        torch.set_num_threads(threads_before)


def _run(cfg: EvalConfig, spec, samples: list, data_sha: str) -> dict:

    llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, cache_bytes=int(cfg.kv_cache_gb * (1 << 30)))
    model = llm.model
    frame = chat_frame(model.tokenizer, cfg.chat_template)
    cfg.chat_frame = [frame.head, frame.tail] if (frame.head or frame.tail) else []
    builder = PromptBuilder(model, frame, spec.prefix, spec.query)
    fitter = PassageFitter(model.encode, cfg.chunk_tokens)

    retrieval = None
    retrieved = {}
    if cfg.retrieval:
        from eval.retrieval import PassageRetriever

        k = cfg.top_k or cfg.num_chunks or 10
        all_samples = load_samples(spec, cfg.data)
        retriever = PassageRetriever(all_samples, Path(cfg.out) / "retrieval_index")
        retrieved = {s.index: retriever.retrieve(s, k) for s in samples}
        retrieval = {
            "top_k": k,
            "num_passages": len(retriever),
            "gold_hit_rate": statistics.fmean(r.gold_hit for r in retrieved.values()),
            "original_gold_hit_rate": statistics.fmean(r.original_gold_hit for r in retrieved.values()),
            "original_recall": statistics.fmean(r.original_recall for r in retrieved.values()),
            "original_precision": statistics.fmean(r.original_precision for r in retrieved.values()),
        }
        retriever.close()

    prompts: dict[int, PromptIds] = {}
    for s in samples:
        r = retrieved.get(s.index)
        prompts[s.index] = fit_prompt(
            builder, fitter, s, cfg.num_chunks, _sample_order(cfg, s), passages=r.passages if r else None
        )
    longest = max(prompts.values(), key=lambda p: p.num_tokens)
    n_new = max(cfg.max_new_tokens, cfg.map_tokens or 0)
    if longest.num_tokens + n_new > model.config.max_position:
        raise PromptTooLongError(
            f"the longest prompt has {longest.num_tokens} tokens (+{n_new} new) but the model has "
            f"{model.config.max_position} positions: lower --num-chunks and/or --chunk-tokens "
            f"(instruction {len(longest.prefix)} + query {len(longest.suffix)} tokens are fixed)"
        )

    ident = _identity(cfg, data_sha, model.fingerprint)
    config_id = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(cfg.out)
    rlog = RecordLog(out, config_id, ident, cfg.overwrite)
    ev = Evaluator(cfg, llm)
    units = cfg.units
    pending = [s for s in samples if any(not rlog.done(s.index, lab) for _, _, lab in units)]
    written, partial = 0, False
    t_start = time.perf_counter()
    try:
        from tqdm.auto import tqdm

        tty = sys.stderr.isatty()
        bar = tqdm(
            total=len(samples),
            initial=len(samples) - len(pending),
            desc=cfg.dataset,
            disable=not (cfg.progress and tty),
            file=sys.stderr,
        )
        if pending:
            ev.warmup(prompts[pending[0].index])
        t_loop = time.perf_counter()
        for i, s in enumerate(pending, 1):
            todo = [u for u in units if not rlog.done(s.index, u[2])]
            done_full = rlog.records.get((s.index, "full"))
            written += ev.run_sample(s, prompts[s.index], todo, done_full, rlog, config_id)
            bar.update(1)
            if cfg.progress and not tty:  # a log file gets one line per sample with the time left
                per = (time.perf_counter() - t_loop) / i
                progress(f"{cfg.dataset} samples", len(samples) - len(pending) + i, len(samples), per)
        bar.close()
    except KeyboardInterrupt:
        partial = True
        print(
            f"\ninterrupted: {len(rlog.records)} records kept in {rlog.path}; rerun the same command "
            "to resume",
            file=sys.stderr,
        )
    finally:
        rlog.close()

    labels = {lab for _, _, lab in units}
    wanted = {s.index for s in samples}
    recs = [r for (i, lab), r in sorted(rlog.records.items()) if i in wanted and lab in labels]
    aggs = aggregate(recs)
    metas = [prompts[s.index].meta for s in samples]
    fit = {
        "cut_frac": statistics.fmean(m["num_cut"] / max(1, len(m["passages"])) for m in metas),
        "words_kept_frac": statistics.fmean(m["words_kept_frac"] for m in metas),
        "gold_in_prompt_rate": statistics.fmean(m["gold_in_prompt"] for m in metas),
        "gold_in_available_rate": statistics.fmean(m["gold_in_available"] for m in metas),
        "prompt_tokens_median": statistics.median(m["num_prompt_tokens"] for m in metas),
        "passages_per_prompt": statistics.fmean(len(m["passages"]) for m in metas),
    }
    conf = asdict(cfg)
    result = {
        "config": conf,
        "config_id": config_id,
        "date": time.strftime("%Y-%m-%d"),
        "n_samples": len({r["sample"] for r in recs}),
        "interrupted": partial,
        "partial": partial or any(not rlog.done(s.index, lab) for s in samples for lab in labels),
        "gate_ok": llm.gate.ok if llm.gate else None,
        "fit": fit,
        "retrieval": retrieval,
        "kv": {"passages_computed": ev.kv_computed, "passages_reused": ev.kv_reused},
        "records_written_this_run": written,
        "seconds_this_run": time.perf_counter() - t_start,
        "aggregates": aggs,
        "records": recs,
    }
    extra = {
        "dataset": cfg.dataset,
        "model": cfg.model,
        "n_samples": result["n_samples"],
        "partial": result["partial"],
        "gold_in_prompt_rate": fit["gold_in_prompt_rate"],
    }
    if retrieval:
        extra.update({f"retrieval_{k}": v for k, v in retrieval.items()})
    result["summary"] = summary(aggs, cfg.default_ratio, extra)
    result["files"] = [str(p) for p in write_outputs(out, result, cfg.plots)] + [str(rlog.path)]
    return result


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        result = run_eval(cfg)
    except (
        EvalConfigError,
        UnknownModeError,
        UnknownDatasetError,
        FitError,
        DatasetFormatError,
        PromptTooLongError,
        FileNotFoundError,
    ) as e:
        ap.error(str(e))
    print(Path(cfg.out) / "results.md")
    print((Path(cfg.out) / "results.md").read_text(), end="")
    if args.summary_json:
        print(json.dumps(result["summary"]))
    return 130 if result["interrupted"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
