"""Paired blend fidelity on the real model: every method against full prefill, question by question.

    python -m eval.bench_fidelity --split short-musique [--samples 0:100] \\
        [--methods reuse,kdev@0.15,kdev+off-k@0.15,qpass@0.15] [--oracles] [--diagnostics] \\
        [--out runs/fidelity/<split>] [--max-new-tokens 24] [--threads 2]

Splits: ``musique`` / ``2wikimqa`` (all 10 passages, ~6K tokens) and ``short-musique`` /
``short-2wikimqa`` (4 passages of at most 200 tokens, the gold-bearing one kept, in a seeded order:
<= 1K tokens). Keep one range of samples for choosing settings (``--samples 100:150``) and report
on another (``0:100``).

Per question and method, paired with full prefill on the same token ids: first-token KL and top-1
agreement; the greedy answer, whether it equals full's (normalized), its token F1 vs full's; F1 and
recall vs the golds; a "not in the passages" flag; the teacher-forced NLL (mean per token) of
full's answer and of the first gold answer; the compute charged (rows x layers recomputed over a
full prefill's, every pass and probe included) and TTFT (prefill + first token, chunk KV in
memory). ``--oracles`` adds the bounds of the digest's section 7: rows of largest *true* deviation
(``odev``), rows of largest full-prefill question attention (``oattn``), and the current selection
with the *true* per-chunk offset (``kdev+off-oracle``). ``--diagnostics`` records, per method, the
per-layer relative K/V error of the rows not recomputed and the share of full's question attention
on recomputed rows.

Method names: ``full``, ``reuse``, or ``SELECTOR[+OPTION...]@RATIO`` with SELECTOR ``kdev``
(CacheBlend's K deviation), ``qattn`` (A3), ``mix`` (half each), ``qpass`` (ProphetKV),
``odev``/``oattn`` (oracles) and OPTIONs ``off-k``, ``off-v``, ``off-kv``, ``off-oracle``
(AgentKVShift offsets), ``w-one``/``w-cap``/``w-norm`` (offset weights), ``seamN`` (N rows per
chunk start), ``deep`` (qpass scored on layers 21-25), ``last`` (qpass scored on the last layer),
``mixF`` (share F of the budget by question attention), ``minpN`` (offsets only for chunks with N probes), ``fresh`` (fresh check-layer KV),
``check2`` (check layer 2), ``T0.8``/``S0.9`` (APE's temperature / scale on the question's and the
decoded tokens' attention to the reused rows). ``default`` is the library's default blend.

Records go to ``OUT/records.jsonl`` as they finish; a rerun skips finished (sample, method) pairs.
The summary has paired-bootstrap 95% intervals; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eval.baselines import warm_prefix_cache
from eval.fit import PassageFitter, fit_prompt, gold_strings
from eval.harness import progress
from eval.prompts import PromptBuilder, PromptIds, chat_frame, get_spec, load_samples
from ragkv.blend import BlendSchedule, PrefixCache, prefill
from ragkv.generate import SamplingParams, continuation_nll, generate
from ragkv.kv import ChunkKV
from ragkv.metrics import first_token_agreement, first_token_kl, normalize_answer, token_f1
from ragkv.metrics.text import answer_recall, max_over_golds
from ragkv.model import DEFAULT_MODEL, load_model
from ragkv.model.forward import chunk_kv_tensors, compute_chunk_kv

#: split -> (dataset, passages kept, tokens per passage)
SPLITS = {
    "musique": ("musique", None, None),
    "2wikimqa": ("2wikimqa", None, None),
    "short-musique": ("musique", 4, 200),
    "short-2wikimqa": ("2wikimqa", 4, 200),
}
#: phrases of an answer that says the passages do not hold it (the re-implementation's 43% failure)
NOT_IN_PASSAGES = re.compile(
    r"not (mentioned|provided|specified|stated|given|found|available|known)|no (information|mention)|"
    r"(does not|doesn't|do not) (say|mention|provide|specify|state)|cannot be determined|unknown",
    re.I,
)
DEEP_LAYERS = (21, 26)  # InfoFlow's band (layers 22-25 of Llama-3.1-8B's 32), at the same depth of 30


@dataclass(frozen=True)
class Method:
    """One row of the table: a prefill mode, a blend schedule, and an oracle selection if any."""

    name: str
    mode: str
    schedule: BlendSchedule | None = None
    oracle: str | None = None  # "odev" | "oattn": preselected rows from full prefill's truth
    offset_oracle: bool = False
    #: FusionRAG: chunk KV prefilled after this many corpus neighbours (0: alone after BOS)
    neighbours: int = 0
    #: neighbours never taken from the question's own passages (the conservative variant)
    exclude_own: bool = False


def parse_method(name: str) -> Method:
    """``[nbrN[x]:]`` then ``full``, ``reuse``, ``default`` or ``SELECTOR[+OPTION...]@RATIO``."""
    m = re.fullmatch(r"nbr(\d+)(x?):(.+)", name)
    if m:
        inner = parse_method(m.group(3))
        return replace(inner, name=name, neighbours=int(m.group(1)), exclude_own=bool(m.group(2)))
    if name in ("full", "reuse"):
        return Method(name, name)
    if name == "default":
        return Method(name, "blend", BlendSchedule())
    try:
        spec, ratio_text = name.split("@")
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"bad method {name!r}: use SELECTOR[+OPTION...]@RATIO") from None
    selector, *options = spec.split("+")
    oracle = selector if selector in ("odev", "oattn") else None
    # a name says everything: no option means none (not the library default's offsets)
    kw: dict = {"selector": "kdev" if oracle else selector, "offset": "none", "offset_min_probes": 1}
    check, off_oracle = 1, False
    for opt in options:
        if opt.startswith("off-"):
            if opt == "off-oracle":
                off_oracle = True
            else:
                kw["offset"] = opt[4:]
        elif opt.startswith("w-"):
            kw["offset_weight"] = opt[2:]
        elif opt.startswith("seam"):
            kw["seam"] = int(opt[4:])
        elif opt.startswith("minp"):
            kw["offset_min_probes"] = int(opt[4:])
        elif opt == "deep":
            kw["score_layers"] = DEEP_LAYERS
        elif opt == "last":
            kw["score_layers"] = (29, 30)
        elif opt.startswith("mix") and opt != "mix":
            kw["mix"] = float(opt[3:])
        elif opt == "fresh":
            kw["fresh_check_kv"] = True
        elif re.fullmatch(r"T[0-9.]+", opt):
            kw["ape_temperature"] = float(opt[1:])
        elif re.fullmatch(r"S[0-9.]+", opt):
            kw["ape_scale"] = float(opt[1:])
        elif opt.startswith("check"):
            check = int(opt[5:])
        else:
            raise ValueError(f"unknown option {opt!r} in method {name!r}")
    return Method(name, "blend", BlendSchedule.single(ratio, check, **kw), oracle, off_oracle)


class Neighbours:
    """Corpus-level nearest passages of a passage (MiniLM + FAISS over every passage of the dataset).

    FusionRAG's offline step: a chunk's KV is prefilled after its most similar corpus chunks. The
    neighbours come from the whole corpus, never from the prompt being answered; ``exclude_own``
    also drops the question's own candidate passages (MuSiQue/2Wiki ship 10 per question, which are
    each other's nearest neighbours), the conservative reading of "no leak".
    """

    def __init__(self, samples, directory: Path):
        from eval.retrieval import PassageRetriever

        self.retriever = PassageRetriever(samples, directory)
        self.owners: dict[tuple[str, str], set[int]] = {}
        for smp in samples:
            for pair in zip(smp.titles, smp.texts, strict=True):
                self.owners.setdefault(pair, set()).add(smp.index)

    def of(self, title: str, text: str, n: int, exclude_sample: int | None) -> list[tuple[str, str]]:
        """The ``n`` nearest other passages, least similar first (the nearest sits next to the chunk)."""
        r = self.retriever
        vec = r.embedder.embed([r._embed_text(title, text)])[0]
        out = []
        for hit in r.index.search(vec, n + 40):
            pair = r.passages[hit.seq]
            if pair == (title, text) or (exclude_sample is not None and exclude_sample in self.owners[pair]):
                continue
            out.append(pair)
            if len(out) == n:
                break
        return out[::-1]


def answer_tokens(model, text: str) -> list[int]:
    """Token ids of an answer as the model would continue the assistant turn (no BOS)."""
    return model.encode(text.strip()) if text.strip() else []


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


class Bench:
    """The model, the split's prompts and the per-question reference (full prefill) for every method."""

    def __init__(self, args):
        self.args = args
        self.model = load_model(args.model)
        dataset, self.num_chunks, chunk_tokens = SPLITS[args.split]
        self.spec = get_spec(dataset)
        frame = chat_frame(self.model.tokenizer, True)
        self.builder = PromptBuilder(self.model, frame, self.spec.prefix, self.spec.query)
        self.fitter = PassageFitter(self.model.encode, chunk_tokens)
        self.params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
        # the instruction head is cached (exact) for every mode but full, as in serving
        self.prefix_cache = PrefixCache(max_bytes=1 << 30)
        self.neighbours: Neighbours | None = None
        self.out = Path(args.out or f"runs/fidelity/{args.split}")

    def conditioned_kvs(self, sample, p: PromptIds, n: int, exclude_own: bool) -> list:
        """The prompt's chunk KV, each prefilled after its ``n`` corpus neighbours (FusionRAG)."""
        if self.neighbours is None:
            self.neighbours = Neighbours(load_samples(self.spec), self.out / "neighbour_index")
        kvs = []
        for pi, ids in zip(p.meta["passages"], p.chunks, strict=True):
            title, text = sample.titles[pi], sample.texts[pi]
            ctx = [
                t
                for nt, nx in self.neighbours.of(title, text, n, sample.index if exclude_own else None)
                for t in self.fitter.cut(nt, nx, []).ids
            ]
            tok, k, v, start = chunk_kv_tensors(self.model, ids, ctx)
            kvs.append(ChunkKV(tok, k, v, start, self.model.fingerprint))
        return kvs

    def prompt(self, sample) -> PromptIds:
        order = None
        if self.num_chunks is not None:  # seeded order: the gold passage is not always first
            order = list(range(len(sample.texts)))
            random.Random(1_000_003 + sample.index).shuffle(order)
        return fit_prompt(self.builder, self.fitter, sample, self.num_chunks, order)

    def timed(self, p: PromptIds, items, mode, **kw):
        if mode != "full":
            warm_prefix_cache(self.model, self.prefix_cache, p.prefix, [])
            kw.update(prefix_cache=self.prefix_cache, prefix_cache_insert=False)
        t0 = time.perf_counter()
        res = prefill(self.model, p.prefix, items, p.suffix, mode, **kw)
        int(res.logits.argmax())
        return res, time.perf_counter() - t0

    def run_sample(self, sample, methods: list[Method], done: set[str], append) -> None:
        m = self.model
        p = self.prompt(sample)
        kvs = [compute_chunk_kv(m, c) for c in p.chunks]
        need_attn = any(x.oracle == "oattn" for x in methods) or self.args.diagnostics
        full, full_ttft = self.timed(p, p.chunks, "full", probe_suffix=need_attn)
        full_gen = generate(m, full, self.params)
        full_text = full_gen.text
        full_ids = answer_tokens(m, full_text)
        golds = gold_strings(sample.answers)
        gold_ids = answer_tokens(m, golds[0]) if golds else []
        n_pre = len(p.prefix)
        bounds = [n_pre]
        for c in p.chunks:
            bounds.append(bounds[-1] + len(c))
        reused_rows = torch.arange(n_pre, bounds[-1])
        q_mass = None
        if full.attn_probs is not None:
            q_mass = torch.stack([pr.sum(dim=(0, 1)) for pr in full.attn_probs]).mean(0)
        reuse = None
        nbr_kvs: dict[tuple[int, bool], list] = {}
        base = {
            "split": self.args.split,
            "sample": sample.index,
            "question": sample.question,
            "golds": sample.answers,
            "prompt_tokens": p.num_tokens,
            "chunk_tokens": [len(c) for c in p.chunks],
            "gold_in_prompt": p.meta["gold_in_prompt"],
            "full_output": full_text,
        }
        for meth in methods:
            if meth.name in done:
                continue
            kw: dict = {}
            if meth.mode == "blend":
                kw["schedule"] = meth.schedule
            if meth.oracle or meth.offset_oracle:
                if meth.oracle == "odev" or meth.offset_oracle:
                    reuse = reuse or self.timed(p, kvs, "reuse")[0]
                if meth.oracle:
                    k_sel = int(round(meth.schedule.target_ratio * reused_rows.numel()))
                    if meth.oracle == "odev":  # true deviation, summed over layers
                        d = (full.kv.k[:, reused_rows].float() - reuse.kv.k[:, reused_rows].float()).pow(2)
                        score = d.sum(dim=(0, 2, 3))
                    else:  # full prefill's question attention, averaged over layers
                        score = q_mass[reused_rows]
                    kw["preselected"] = reused_rows[score.topk(k_sel).indices].sort().values.tolist()
                if meth.offset_oracle:
                    kw["offset_oracle"] = _true_offsets(m, full, reuse, p, kvs)
            items = p.chunks if meth.mode == "full" else kvs
            if meth.neighbours and meth.mode != "full":
                key = (meth.neighbours, meth.exclude_own)
                if key not in nbr_kvs:
                    nbr_kvs[key] = self.conditioned_kvs(sample, p, *key)
                items = nbr_kvs[key]
            if meth.mode == "full":
                res, ttft = full, full_ttft
            else:
                res, ttft = self.timed(p, items, meth.mode, **kw)
            text = full_text if res is full else generate(m, res, self.params).text
            nll_full = continuation_nll(m, res, full_ids) if full_ids else []
            nll_gold = continuation_nll(m, res, gold_ids) if gold_ids else []
            rec = dict(
                base,
                method=meth.name,
                output=text,
                same_as_full=normalize_answer(text) == normalize_answer(full_text),
                f1_vs_full=token_f1(text, full_text),
                f1=max_over_golds(token_f1, text, sample.answers),
                recall=max_over_golds(answer_recall, text, sample.answers),
                not_in_passages=bool(NOT_IN_PASSAGES.search(text)),
                kl=first_token_kl(full.logits, res.logits),
                top1=float(first_token_agreement(full.logits, res.logits)),
                nll_full_answer=statistics.fmean(nll_full) if nll_full else None,
                nll_gold=statistics.fmean(nll_gold) if nll_gold else None,
                charged=res.stats["recompute_fraction"],
                ttft_s=ttft,
            )
            if self.args.diagnostics and res is not full:
                rec.update(_diagnostics(res, full, reused_rows, q_mass))
            append(rec)


def _true_offsets(model, full, reuse, p: PromptIds, kvs):
    """``offset_oracle(layer)``: the true pre-RoPE residual (full minus stored) of every stored row."""
    n_pre = len(p.prefix)
    rows = torch.arange(n_pre, n_pre + sum(len(c) for c in p.chunks))

    def oracle(layer: int):
        k_true = model.rope(full.kv.k[layer, rows], -rows)  # un-rotated: pre-RoPE K of full prefill
        k_st = torch.cat([kv.k[layer] for kv in kvs]).to(k_true.dtype)
        v_st = torch.cat([kv.v[layer] for kv in kvs]).to(k_true.dtype)
        res_k, res_v = k_true - k_st, full.kv.v[layer, rows] - v_st
        head = res_k.new_zeros(n_pre, *res_k.shape[1:])  # the cached instruction head is exact
        return torch.cat([head, res_k]), torch.cat([head, res_v])

    return oracle


def _diagnostics(res, full, reused_rows: torch.Tensor, q_mass: torch.Tensor | None) -> dict:
    """Per-layer relative K/V error of the reused rows not recomputed; question-attention coverage."""
    last = res.stats.get("recomputed_rows_last_layer")
    recomputed = torch.zeros(full.kv.num_tokens, dtype=torch.bool)
    if last is not None:
        recomputed[last.cpu()] = True
    stale = reused_rows[~recomputed[reused_rows]]
    out = {
        "k_err_per_layer": [
            _rel_err(res.kv.k[i, stale], full.kv.k[i, stale]) for i in range(full.kv.k.shape[0])
        ],
        "v_err_per_layer": [
            _rel_err(res.kv.v[i, stale], full.kv.v[i, stale]) for i in range(full.kv.v.shape[0])
        ],
    }
    if q_mass is not None:
        mass = q_mass[reused_rows]
        out["q_attention_coverage"] = float(mass[recomputed[reused_rows]].sum() / mass.sum().clamp(min=1e-12))
    return out


# ---- summary -----------------------------------------------------------------------------------------
METRICS = (
    ("same_as_full", "same"),
    ("f1_vs_full", "F1 vs full"),
    ("kl", "KL"),
    ("top1", "top-1"),
    ("nll_full_answer", "NLL(full ans)"),
    ("nll_gold", "NLL(gold)"),
    ("recall", "recall"),
    ("f1", "F1 gold"),
    ("not_in_passages", "not-in"),
    ("charged", "charged"),
    ("ttft_s", "TTFT s"),
)


def bootstrap_ci(values: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean (paired differences when ``values`` are differences)."""
    if not values:
        return (float("nan"), float("nan"))
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(values), (n_boot, len(values)), generator=g)
    means = x[idx].mean(dim=1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def summarize(records: list[dict], methods: list[str], baseline: str | None) -> dict:
    """Per method: the mean and 95% interval of each metric over the questions every method finished."""
    by: dict[str, dict[int, dict]] = {}
    for r in records:
        by.setdefault(r["method"], {})[r["sample"]] = r
    common = set.intersection(*(set(by.get(m, {})) for m in methods)) if methods else set()
    samples = sorted(common)
    out: dict = {"n_samples": len(samples), "methods": {}}
    if not samples:
        return out

    def nll_gap(m: str) -> float | None:
        """Sum over questions of ``m``'s NLL of full's answer minus full's own (None if any is missing)."""
        vals = [(by[m][s]["nll_full_answer"], by["full"][s]["nll_full_answer"]) for s in samples]
        return None if any(a is None or b is None for a, b in vals) else sum(a - b for a, b in vals)

    reuse_gap = nll_gap("reuse") if "reuse" in by and "full" in by else None
    for m in methods:
        row = {}
        for key, _ in METRICS:
            vals = [float(by[m][s][key]) for s in samples if by[m][s].get(key) is not None]
            if not vals:
                continue
            lo, hi = bootstrap_ci(vals)
            row[key] = {"mean": statistics.fmean(vals), "lo": lo, "hi": hi}
        if baseline and baseline in by and m != baseline:
            for key in ("f1_vs_full", "kl", "nll_full_answer"):
                d = [
                    float(by[m][s][key]) - float(by[baseline][s][key])
                    for s in samples
                    if by[m][s].get(key) is not None and by[baseline][s].get(key) is not None
                ]
                if d:
                    lo, hi = bootstrap_ci(d)
                    row[f"{key}_minus_{baseline}"] = {"mean": statistics.fmean(d), "lo": lo, "hi": hi}
        gap = nll_gap(m) if reuse_gap and m not in ("full", "reuse") else None
        if gap is not None:  # the share of reuse's summed NLL gap to full that ``m`` closes
            row["nll_gap_closed"] = 1 - gap / reuse_gap
        if "kl" in row and "reuse" in by:
            kl_reuse = statistics.fmean(by["reuse"][s]["kl"] for s in samples)
            row["kl_over_reuse"] = row["kl"]["mean"] / kl_reuse if kl_reuse else None
        if any("k_err_per_layer" in by[m][s] for s in samples):
            ks = [by[m][s]["k_err_per_layer"] for s in samples if "k_err_per_layer" in by[m][s]]
            vs = [by[m][s]["v_err_per_layer"] for s in samples if "v_err_per_layer" in by[m][s]]
            cov = [by[m][s]["q_attention_coverage"] for s in samples if "q_attention_coverage" in by[m][s]]
            row["k_err_per_layer"] = [statistics.fmean(x) for x in zip(*ks, strict=True)]
            row["v_err_per_layer"] = [statistics.fmean(x) for x in zip(*vs, strict=True)]
            row["q_attention_coverage"] = statistics.fmean(cov) if cov else None
        out["methods"][m] = row
    return out


def print_table(summary: dict, methods: list[str]) -> None:
    """Means per method; the bracketed 95% intervals on output F1 vs full and NLL of full's answer."""
    print(f"{summary['n_samples']} questions, paired; mean [95% bootstrap interval]")
    ci_keys = ("f1_vs_full", "nll_full_answer")
    head = [(f"{lab} [CI]" if key in ci_keys else lab) for key, lab in METRICS]
    widths = [19 if key in ci_keys else 8 for key, _ in METRICS]
    print(
        f"{'method':24s} "
        + " ".join(f"{h:>{w}s}" for h, w in zip(head, widths, strict=True))
        + "  KL/reuse NLLgap"
    )
    for m in methods:
        row = summary["methods"].get(m, {})
        cells = []
        for (key, _), w in zip(METRICS, widths, strict=True):
            c = row.get(key)
            if c is None:
                cells.append(f"{'-':>{w}s}")
            elif key in ci_keys:
                cells.append(f"{c['mean']:.3f} [{c['lo']:.2f},{c['hi']:.2f}]".rjust(w))
            else:
                cells.append(f"{c['mean']:{w}.3f}")
        extra = [row.get("kl_over_reuse"), row.get("nll_gap_closed")]
        tail = " ".join("    -" if x is None else f"{x:9.3f}" for x in extra)
        print(f"{m:24s} " + " ".join(cells) + " " + tail)


def markdown_table(summary: dict, methods: list[str]) -> str:
    """The summary as a Markdown table (docs/BENCHMARKS.md): means, with 95% intervals where they matter."""
    cols = [
        ("same_as_full", "same as full"),
        ("f1_vs_full", "output F1 vs full"),
        ("kl", "first-token KL"),
        ("top1", "top-1"),
        ("nll_full_answer", "NLL(full's answer)"),
        ("recall", "recall (gold)"),
        ("not_in_passages", "not-in"),
        ("charged", "charged compute"),
    ]
    lines = [
        "| method | " + " | ".join(lab for _, lab in cols) + " | KL / reuse | NLL gap closed |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for m in methods:
        row = summary["methods"].get(m, {})
        cells = []
        for key, _ in cols:
            c = row.get(key)
            if c is None:
                cells.append("-")
            elif key in ("same_as_full", "f1_vs_full", "kl", "nll_full_answer"):
                cells.append(f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]")
            else:
                cells.append(f"{c['mean']:.3f}")
        klr, gap = row.get("kl_over_reuse"), row.get("nll_gap_closed")
        cells.append("-" if klr is None else f"{klr:.2f}")
        cells.append("-" if gap is None else f"{gap:.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m eval.bench_fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--split", required=True, choices=sorted(SPLITS))
    ap.add_argument("--samples", default="0:100", help="START:STOP of the split's samples")
    ap.add_argument("--methods", default="reuse,kdev@0.15,default")
    ap.add_argument("--oracles", action="store_true", help="add odev@R, oattn@R and kdev+off-oracle@R")
    ap.add_argument("--oracle-ratio", type=float, default=0.15)
    ap.add_argument("--diagnostics", action="store_true")
    ap.add_argument("--baseline", default="kdev@0.15", help="paired differences against this method")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--summary-only", action="store_true", help="summarize existing records, run nothing")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ["full"] + [m for m in args.methods.split(",") if m and m != "full"]
    if args.oracles:
        r = args.oracle_ratio
        names += [f"odev@{r:g}", f"oattn@{r:g}", f"kdev+off-oracle@{r:g}"]
    names = list(dict.fromkeys(names))
    methods = [parse_method(n) for n in names]
    out = Path(args.out or f"runs/fidelity/{args.split}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    ident = {"split": args.split, "model": args.model, "max_new_tokens": args.max_new_tokens}
    meta = out / "run_config.json"
    if meta.exists() and json.loads(meta.read_text()) != ident:
        raise SystemExit(
            f"{out} holds records of another configuration ({meta.read_text()}); use another --out"
        )
    meta.write_text(json.dumps(ident))
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut by an interrupted write
    start, stop = (int(x) for x in args.samples.split(":"))
    if not args.summary_only:
        bench = Bench(args)
        samples = load_samples(bench.spec)[start:stop]
        done: dict[int, set[str]] = {}
        for r in records:
            done.setdefault(r["sample"], set()).add(r["method"])
        todo = [s for s in samples if not set(names) <= done.get(s.index, set())]
        t0 = time.perf_counter()
        with open(path, "a") as f:

            def append(rec: dict) -> None:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                records.append(rec)

            for i, s in enumerate(todo, 1):
                bench.run_sample(s, methods, done.get(s.index, set()), append)
                progress(f"{args.split} questions", i, len(todo), (time.perf_counter() - t0) / i)
    wanted = set(range(start, stop))
    recs = [r for r in records if r["sample"] in wanted and r["method"] in names]
    summary = summarize(recs, names, args.baseline if args.baseline in names else None)
    print_table(summary, names)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown_table(summary, names))
    line = {"split": args.split, "samples": args.samples, "n": summary["n_samples"]}
    for m, row in summary["methods"].items():
        for key in ("same_as_full", "f1_vs_full", "kl", "recall", "charged"):
            if key in row:
                line[f"{m}:{key}"] = round(row[key]["mean"], 4)
        if row.get("kl_over_reuse") is not None:
            line[f"{m}:kl_over_reuse"] = round(row["kl_over_reuse"], 4)
        if row.get("nll_gap_closed") is not None:
            line[f"{m}:nll_gap_closed"] = round(row["nll_gap_closed"], 4)
    print(json.dumps(line))
    return summary


if __name__ == "__main__":
    main()
