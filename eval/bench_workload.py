"""Issue 52's benchmark: the workloads RAG really has, ragkv's default against full prefill and llama.cpp.

Questions and passages of MuSiQue and 2WikiMQA (``data/``), the passages ingested into a data folder
built as the service builds it (``ragkv_server.service.build_rag``: its model, embedder, chunk size,
``top_k`` and prompt), one collection per dataset, retrieval by ragkv itself. Workloads:

* ``natural``: each question once (cold).
* ``zipf-0.8``, ``zipf-1``, ``zipf-1.2``: ``--zipf-requests`` questions drawn by Zipf rank (seeded; rank
  order a seeded shuffle of the questions), exponent s; the k-th repeat of a question is paraphrased
  by :func:`paraphrase` (rule k), so its words change and its retrieval may too.
* ``bursts``: per topic (a question), ``--burst-len`` consecutive queries (the question, then its
  paraphrases) whose passages are a sliding window over the topic's ranked retrieval: query j gets
  ranks ``j .. j+k-1``, so consecutive sets share k-1 passages, each one place earlier
  (:func:`burst_windows`).
* ``zipf-1-service``: the ``zipf-1`` sequence through the service's OpenAI route with
  ``extra_body={"ragkv": {"retrieve": true}}`` (the service retrieves and builds ``/v1/query``'s
  prompt; a system message naming the pass keeps passes apart).
* ``chat``: multi-turn RAG chat through the service's ``/v1/chat/completions`` with the official
  ``openai`` client: a system message, then a user message with the question's retrieved passages
  and the question, then up to 4 follow-ups (:data:`FOLLOW_UPS`), 1 to 5 turns per conversation
  (conversation c has ``1 + (c + 4) % 5`` turns: the first has 5), each answer kept in the history.
  Streaming, ``stream_options={"include_usage": True}``: TTFT is the client's time to the first
  content chunk, ``cached_tokens`` is read from the streamed ``usage.prompt_tokens_details``, the
  prompt's ids from ``return_token_ids`` (vLLM's option, which the service serves).
* ``restart``: the chat's service stopped and started again on the same data folder, then each
  conversation's first request sent again: its cached share (``cached_tokens / prompt_tokens``).
* ``two-process``: a ``redis-server`` on a free loopback port, two services on it
  (``RAGKV_STORE=redis://...``, each its own data folder, the same documents ingested through each);
  each conversation's first request computed on the first service, then sent to the second: its
  cached share there.

Arms, side by side in the same run: **default** (the library's / the service's default setting: no
mode, no ratio), **full** (``mode="full"``), and **llama.cpp** (``llama-cpp-python`` on the same GGUF
file, ``--threads`` threads, one ``Llama`` object per workload pass so its prompt cache, the longest
common prefix with what it holds, applies as in llama-server or Ollama; fed the token ids ragkv
prefilled; TTFT to its first generated token). The arms run interleaved, request by request (turn
by turn in chat), default and full in alternating order (:func:`arm_order`), so each pair is measured
under the same load (full reuses nothing; what it could leave in a cache is the prompt the default arm
has just run). Each library pass starts from a fresh
state: a fresh copy of the data folder as ingest left it, a fresh ``RAG`` (process memory), a reset
``Llama``; a question without passages warms each arm up first (untimed). ``--repeats`` passes; a
request's TTFT is its median over the passes. In chat each repeat is its own set of sessions: the
system message carries the session number, so no pass reuses another's prompts (chunk KV stored at
ingest stays reusable); each arm keeps its own conversation (its own answers). llama.cpp serves the
conversations one after another on the default arm's prompt ids (its one-slot cache: the friendliest
order). After a restart, and on a second process, llama.cpp holds nothing (llama-server's default).

Figures per workload and arm: TTFT p50 / p95, the default's ratio to full and to llama.cpp (ratio of
the medians, and the median and p10 of the per-request speed-ups), token hit rate (cached prompt
tokens / prompt tokens: the answer's ``stats["cached_tokens"]`` when ragkv reports it, else
``num_exact_rows + num_reused_rows`` as the service's ``cached_tokens`` counts today, else
``usage.prompt_tokens_details.cached_tokens``; llama.cpp's from the common prefix it reused), same
greedy answer as full (token ids, % of requests), RSS and the data folder's bytes; PNG plots of
TTFT per request (per turn for chat) in ``--out``. Prints a table, ends with exactly one JSON line.

    python -m eval.bench_workload                          # everything, the default model, 2 threads
    python -m eval.bench_workload --quick                  # a smoke test (1 question per dataset ...)
    python -m eval.bench_workload --workloads natural,chat --limit 3 --datasets musique --no-llamacpp
    python -m eval.bench_workload --quick --model tiny --no-llamacpp   # the repository's test model

CPU time: a quick run takes 3-7 minutes on the tiny model; on the default model most of its time is
prefill (every request runs three times) and a service start per service workload, so it slows down
a lot beside other jobs (2 torch / ggml threads on 2 busy cores: 40 minutes measured); ``--workloads``
runs a subset.

llama.cpp is optional: ``pip install llama-cpp-python`` (builds from source, ~8 minutes on 2 cores);
without it (or with a model that is not a GGUF file) its column is skipped and the run says how to
install it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eval.harness import service_processes
from eval.prompts import TINY_MODEL, get_spec, load_samples
from ragkv.metrics import percentile

#: every workload, in run order
WORKLOADS = (
    "natural",
    "zipf-0.8",
    "zipf-1",
    "zipf-1.2",
    "bursts",
    "chat",
    "zipf-1-service",
    "restart",
    "two-process",
)
#: the library workloads (in process, on a RAG built as the service builds it)
LIBRARY = ("natural", "zipf-0.8", "zipf-1", "zipf-1.2", "bursts")
#: the service workloads (HTTP, the OpenAI route)
SERVICE = ("chat", "zipf-1-service", "restart", "two-process")
ARMS = ("default", "full", "llamacpp")
SYSTEM = "You are a helpful assistant. Answer the question from the context, in a few words."
#: the follow-up questions of a chat, after the first (RAG) turn
FOLLOW_UPS = (
    "Can you say that again in one short sentence?",
    "Which passage says so? Give its title.",
    "Are you sure? Answer once more, briefly.",
    "What else do the passages say about it?",
)
LLAMA_INSTALL = (
    "llama.cpp column skipped: llama-cpp-python is not installed. Install it in this venv with "
    "`pip install llama-cpp-python` (or `pip install -e .[llamacpp]`; it builds llama.cpp from source: ~8 "
    "minutes on 2 cores), then rerun."
)


# ---- the workloads' pieces (pure: tested without a model) ------------------------------------------------
def zipf_draw(n_items: int, n_draws: int, s: float, seed: int = 0) -> list[int]:
    """``n_draws`` item indexes drawn with P(rank r) proportional to r^-s (rank 1 most likely); the
    item at each rank is a seeded shuffle of ``range(n_items)``. Deterministic for a seed."""
    if n_items < 1 or n_draws < 0:
        raise ValueError("zipf_draw needs n_items >= 1 and n_draws >= 0")
    rng = random.Random(f"zipf|{seed}|{s}|{n_items}")
    ranked = list(range(n_items))
    rng.shuffle(ranked)
    weights = [1.0 / (r**s) for r in range(1, n_items + 1)]
    return [ranked[i] for i in rng.choices(range(n_items), weights=weights, k=n_draws)]


#: word synonyms (whole words, case kept for the first letter), both directions where it reads well
SYNONYMS = {
    "film": "movie",
    "movie": "film",
    "director": "filmmaker",
    "died": "passed away",
    "born": "brought into the world",
    "country": "nation",
    "city": "town",
    "father": "dad",
    "mother": "mom",
    "performer": "artist",
    "located": "situated",
    "founded": "established",
    "author": "writer",
    "song": "track",
    "place": "location",
    "wife": "spouse",
    "husband": "spouse",
    "company": "firm",
    "largest": "biggest",
    "first": "earliest",
}
#: question openings rewritten (the first that matches)
OPENINGS = (
    ("What is ", "Tell me what is "),
    ("Who is ", "Tell me who is "),
    ("What was ", "Tell me what was "),
    ("Who was ", "Tell me who was "),
    ("Where ", "In what place "),
    ("When ", "At what time "),
    ("Which ", "What "),
    ("Who ", "Which person "),
    ("What ", "Which "),
    ("Are ", "Is it true that "),
    ("Is ", "Is it true that "),
    ("Do ", "Is it so that "),
    ("Did ", "Is it so that "),
)


def _strip_q(q: str) -> str:
    return q.strip().rstrip("?").rstrip()


def rule_opening(q: str) -> str:
    """Opening rewritten: "What is X?" -> "Tell me what is X?" (and the other :data:`OPENINGS`)."""
    for a, b in OPENINGS:
        if q.startswith(a):
            rest = q[len(a) :]
            if b.startswith("Is it") or b.startswith("Is it so"):
                return b + rest[:1].lower() + rest[1:]
            return b + rest
    return q


def rule_synonyms(q: str) -> str:
    """Each word of :data:`SYNONYMS` replaced (whole words)."""

    def swap(m: re.Match) -> str:
        w = m.group(0)
        rep = SYNONYMS.get(w.lower())
        if rep is None:
            return w
        return rep[:1].upper() + rep[1:] if w[:1].isupper() else rep

    return re.sub(r"[A-Za-z]+", swap, q)


def rule_reorder(q: str) -> str:
    """Clauses reordered: "Who is the father of the director of X?" -> "Regarding the director of X,
    who is the father?" (split at the first " of "; at the first comma when there is no " of ")."""
    body = _strip_q(q)
    for sep in (" of ", ", "):
        head, found, tail = body.partition(sep)
        if found and head and tail:
            return f"Regarding {tail}, {head[:1].lower()}{head[1:]}?"
    return q


def rule_polite(q: str) -> str:
    return f"Could you tell me: {q.strip()}"


def rule_brief(q: str) -> str:
    return f"{q.strip()} Please answer briefly."


#: the paraphrase of the k-th repeat (k >= 1) applies ``VARIANTS[(k - 1) % len(VARIANTS)]`` in order
VARIANTS: tuple[tuple[Callable[[str], str], ...], ...] = (
    (rule_opening,),
    (rule_synonyms,),
    (rule_reorder,),
    (rule_polite,),
    (rule_opening, rule_synonyms),
    (rule_reorder, rule_synonyms),
    (rule_brief,),
    (rule_synonyms, rule_polite),
)


def paraphrase(question: str, k: int) -> str:
    """The question as asked the ``k``-th time: ``k == 0`` as written, else the rules of
    ``VARIANTS[(k - 1) % 8]`` (opening rewrite, synonyms, clause reorder, a polite or brief wrapper);
    a variant that leaves the words unchanged gets the polite wrapper. Deterministic."""
    if k <= 0:
        return question
    q = question.strip()
    for rule in VARIANTS[(k - 1) % len(VARIANTS)]:
        q = rule(q)
    if q == question.strip():
        q = rule_polite(q)
    return q


def burst_windows(n_ranked: int, k: int, burst_len: int) -> list[list[int]]:
    """The passages (rank indexes) of a burst's queries: query j gets ranks ``j .. j+k-1`` (a sliding
    window), so consecutive queries share k-1 passages, each one place earlier. Windows run out of
    ranks at ``n_ranked``: later ones are shorter, never empty."""
    if k < 1 or burst_len < 1 or n_ranked < 1:
        raise ValueError("burst_windows needs k, burst_len, n_ranked >= 1")
    out = []
    for j in range(burst_len):
        start = min(j, n_ranked - 1)
        out.append(list(range(start, min(start + k, n_ranked))))
    return out


def arm_order(i: int) -> tuple[str, str]:
    """The order of the paired arms at step ``i``: default first on even steps, full first on odd ones,
    so neither arm always runs right after the other's (what a request leaves running, a store write
    or freed memory, falls on both alike)."""
    return ("default", "full") if i % 2 == 0 else ("full", "default")


def chat_turns(conversation: int, max_turns: int = 5) -> int:
    """Turns of conversation ``c`` (0-based): ``1 + (c + 4) % max_turns`` (5, 1, 2, 3, 4, 5, ...)."""
    return 1 + (conversation + max_turns - 1) % max_turns


def first_user_message(passages: Sequence[str], question: str) -> str:
    """The first turn of a RAG chat: the passages, then the question (LangChain's stuff chain)."""
    return "Context:\n" + "\n\n".join(p.strip() for p in passages) + f"\n\nQuestion: {question}"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- figures -----------------------------------------------------------------------------------------------
def cached_of(stats: dict | None, usage_cached: int | None = None) -> tuple[int | None, str | None]:
    """Exact prompt tokens reused and where the figure comes from: ``stats["cached_tokens"]`` (the
    exact tree's count) when present, else ``num_exact_rows + num_reused_rows`` (today's prefill
    statistics, the service's ``cached_tokens`` rule), else the OpenAI usage's ``cached_tokens``."""
    stats = stats or {}
    if stats.get("cached_tokens") is not None:
        return int(stats["cached_tokens"]), "stats.cached_tokens"
    if "num_exact_rows" in stats or "num_reused_rows" in stats:
        return int(stats.get("num_exact_rows") or 0) + int(stats.get("num_reused_rows") or 0), "stats.rows"
    if usage_cached is not None:
        return int(usage_cached), "usage.cached_tokens"
    return None, None


@dataclass
class Rec:
    """One request of one arm in one pass."""

    workload: str
    arm: str
    index: int  # the request's place in the workload (for chat: the conversation)
    repeat: int
    ttft_s: float | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_source: str | None = None
    answer_ids: list[int] | None = None
    text: str = ""
    turn: int | None = None  # chat: 1-based
    prev_prompt_tokens: int | None = None  # chat: the previous turn's prompt
    server_ttft_s: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.index, self.turn)


def _median_by_key(recs: list[Rec], arm: str, server: bool = False) -> dict[tuple, float]:
    """Each request's TTFT (the client's, or with ``server`` the service's own) median over the passes."""
    by: dict[tuple, list[float]] = {}
    for r in recs:
        v = r.server_ttft_s if server else r.ttft_s
        if r.arm == arm and v is not None:
            by.setdefault(r.key, []).append(v)
    return {k: statistics.median(v) for k, v in by.items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(recs: list[Rec]) -> dict:
    """The figures of one workload's records (every arm): TTFT p50 / p95 (of each request's median
    over the passes), ratios, speed-ups, hit rates, same answers as full."""
    out: dict = {"n_requests": len({r.key for r in recs if r.arm == "default"})}
    med = {arm: _median_by_key(recs, arm) for arm in ARMS}
    for arm in ARMS:
        m = med[arm]
        arm_recs = [r for r in recs if r.arm == arm]
        out[f"{arm}_ttft_p50_s"] = percentile(m.values(), 50, empty=None)
        out[f"{arm}_ttft_p95_s"] = percentile(m.values(), 95, empty=None)
        known = [r for r in arm_recs if r.cached_tokens is not None and r.prompt_tokens]
        out[f"{arm}_hit_rate"] = (
            sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known) if known else None
        )
        out[f"{arm}_n"] = len(arm_recs)
    sources = sorted({r.cached_source for r in recs if r.arm == "default" and r.cached_source})
    out["hit_source"] = ",".join(sources) or None
    d = [r for r in recs if r.arm == "default"]
    out["default_modes_run"] = (
        sorted({str(r.extra["mode_run"]) for r in d if r.extra.get("mode_run")}) or None
    )
    depths = [r.extra.get("tree_depth") for r in d]
    out["default_tree_depth_p50"] = percentile(
        (x for x in depths if isinstance(x, (int, float))), 50, empty=None
    )
    out["default_server_ttft_p50_s"] = percentile(
        _median_by_key([r for r in d if r.server_ttft_s is not None], "default", server=True).values(),
        50,
        empty=None,
    )
    for other in ("full", "llamacpp"):
        out[f"default_over_{other}_p50"] = _ratio(out["default_ttft_p50_s"], out[f"{other}_ttft_p50_s"])
        speedups = [
            med[other][k] / med["default"][k] for k in med["default"] if k in med[other] and med["default"][k]
        ]
        out[f"speedup_vs_{other}_median"] = percentile(speedups, 50, empty=None)
        out[f"speedup_vs_{other}_p10"] = percentile(speedups, 10, empty=None)
    # same greedy answer as full, pass by pass (token ids for ragkv's arms, text for llama.cpp's)
    full = {(r.key, r.repeat): r for r in recs if r.arm == "full"}
    for arm in ("default", "llamacpp"):
        pairs = [(r, full[(r.key, r.repeat)]) for r in recs if r.arm == arm and (r.key, r.repeat) in full]
        if arm == "default":  # token ids where both have them, else the text
            same = [
                a.answer_ids == b.answer_ids if a.answer_ids and b.answer_ids else a.text == b.text
                for a, b in pairs
            ]
        else:
            same = [a.text.strip() == b.text.strip() for a, b in pairs]
        out[f"{arm}_same_answer_as_full"] = sum(same) / len(same) if same else None
    return out


def summarize_chat(recs: list[Rec]) -> dict:
    """:func:`summarize` plus per-turn figures: TTFT p50 per arm, the default's cached share of the
    prompt and of the previous turn's prompt, its speed-up over full on turns 2 and later."""
    out = summarize(recs)
    turns = sorted({r.turn for r in recs if r.turn})
    per_turn = []
    for t in turns:
        rs = [r for r in recs if r.turn == t]
        row: dict = {"turn": t, "n": len({r.index for r in rs if r.arm == "default"})}
        for arm in ARMS:
            row[f"{arm}_ttft_p50_s"] = percentile(
                _median_by_key([r for r in rs if r.arm == arm], arm).values(), 50, empty=None
            )
        d = [r for r in rs if r.arm == "default" and r.cached_tokens is not None and r.prompt_tokens]
        row["cached_share"] = sum(r.cached_tokens for r in d) / sum(r.prompt_tokens for r in d) if d else None
        p = [r for r in d if r.prev_prompt_tokens]
        row["cached_over_prev_prompt"] = (
            min(r.cached_tokens / r.prev_prompt_tokens for r in p) if p else None
        )  # the worst conversation: the goal is >= 0.9 on every one
        row["default_over_full_p50"] = _ratio(row["default_ttft_p50_s"], row["full_ttft_p50_s"])
        row["default_over_llamacpp_p50"] = _ratio(row["default_ttft_p50_s"], row["llamacpp_ttft_p50_s"])
        per_turn.append(row)
    out["per_turn"] = per_turn
    later = [r for r in recs if (r.turn or 0) >= 2]
    if later:
        s = summarize(later)
        out["turn2plus"] = {
            k: s[k]
            for k in (
                "default_ttft_p50_s",
                "full_ttft_p50_s",
                "llamacpp_ttft_p50_s",
                "speedup_vs_full_median",
                "speedup_vs_llamacpp_median",
                "default_hit_rate",
            )
        }
    return out


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(figures: dict[str, dict]) -> str:
    """A readable table: one row per workload."""
    head = (
        f"{'workload':<15} {'n':>3} {'default p50/p95 s':>18} {'full p50/p95 s':>16} {'llama.cpp p50/p95 s':>20} "
        f"{'/full':>6} {'x full med/p10':>15} {'/llama':>7} {'hit':>6} {'same':>5} {'RSS MB':>7} {'disk MB':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, f in figures.items():
        if "skipped" in f:
            lines.append(f"{name:<15} skipped: {f['skipped']}")
            continue

        def pair(arm: str, f: dict = f) -> str:
            return f"{_fmt(f.get(f'{arm}_ttft_p50_s'))}/{_fmt(f.get(f'{arm}_ttft_p95_s'))}"

        same = f.get("default_same_answer_as_full")
        mb = lambda b: _fmt(b / 1e6, 1) if b is not None else "n/a"  # noqa: E731
        lines.append(
            f"{name:<15} {f.get('n_requests', 0):>3} {pair('default'):>18} {pair('full'):>16} {pair('llamacpp'):>20} "
            f"{_fmt(f.get('default_over_full_p50'), 2):>6} "
            f"{_fmt(f.get('speedup_vs_full_median'), 2) + '/' + _fmt(f.get('speedup_vs_full_p10'), 2):>15} "
            f"{_fmt(f.get('default_over_llamacpp_p50'), 2):>7} {_fmt(f.get('default_hit_rate'), 3):>6} "
            f"{_fmt(same * 100, 0) + '%' if same is not None else 'n/a':>5} {mb(f.get('rss_bytes')):>7} "
            f"{mb(f.get('disk_bytes')):>8}"
        )
        for row in f.get("per_turn", []):
            lines.append(
                f"  turn {row['turn']} (n={row['n']}): default {_fmt(row['default_ttft_p50_s'])} s, full "
                f"{_fmt(row['full_ttft_p50_s'])} s, llama.cpp {_fmt(row['llamacpp_ttft_p50_s'])} s; cached share "
                f"{_fmt(row['cached_share'])}, of the previous prompt {_fmt(row['cached_over_prev_prompt'])}"
            )
        for k in ("cached_share", "cached_share_min", "same_answer_as_first_time"):
            if k in f:
                lines.append(f"  {k}: {_fmt(f[k])}")
    return "\n".join(lines)


# ---- measurement helpers -----------------------------------------------------------------------------------
def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory of a process (``/proc``; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def plot(
    figure_path: Path, title: str, series: dict[str, list[tuple[float, float]]], xlabel: str
) -> Path | None:
    """TTFT per request (or turn), one line per arm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for arm, pts in series.items():
        if pts:
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", ms=3, label=arm)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure_path, dpi=110)
    plt.close(fig)
    return figure_path


# ---- llama.cpp -----------------------------------------------------------------------------------------------
class LlamaCpp:
    """llama-cpp-python on a GGUF file: one ``Llama`` object, whose prompt cache (the longest common
    prefix of a prompt with the tokens it holds) is what llama-server and Ollama users get."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, stop_ids: Sequence[int]):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=n_ctx, verbose=False)
        self.stop = set(int(t) for t in stop_ids) | {int(self.llm.token_eos())}

    def reset(self) -> None:
        """Forget what it holds (a fresh pass)."""
        self.llm.reset()

    def run(self, ids: Sequence[int], max_new: int) -> tuple[float, list[int], int]:
        """(TTFT, greedy answer ids, prompt tokens reused from its cache) for the prompt ``ids``."""
        ids = [int(t) for t in ids]
        held = list(self.llm._input_ids[: self.llm.n_tokens]) if self.llm.n_tokens else []
        reused = min(common_prefix(held, ids), len(ids) - 1)  # it always evaluates the last token
        out: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(
            ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if int(tok) in self.stop:
                break
            out.append(int(tok))
            if len(out) >= max_new:
                break
        return ttft if ttft is not None else time.perf_counter() - t0, out, max(0, reused)


def llamacpp_status(model: str, enabled: bool) -> tuple[Path | None, str | None]:
    """The GGUF file llama.cpp runs, or why its column is skipped."""
    if not enabled:
        return None, "--no-llamacpp"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, LLAMA_INSTALL
    from ragkv.model.registry import gguf_path, is_named, pull

    if is_named(model):
        pull(model, quiet=True)
        return gguf_path(model), None
    if str(model).endswith(".gguf") and Path(model).is_file():
        return Path(model), None
    return None, f"llama.cpp needs a GGUF file; model {model!r} is not one"


# ---- the run -------------------------------------------------------------------------------------------------
@dataclass
class Question:
    dataset: str
    index: int
    text: str


class Bench:
    """State of one run: settings, the pristine data folder, the questions, llama.cpp."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="bench-workload-", dir=args.work_dir))
        self.base = self.work / "base"
        self.notes: list[str] = []
        self.questions: list[Question] = []
        self.docs: dict[str, list[dict]] = {}
        self.llama: LlamaCpp | None = None
        self.llama_skip: str | None = None
        self.retrieved: dict[int, list[str]] = {}  # question -> its passages' texts (the chat's context)
        self.ingest: dict = {}

    # -- settings and data --
    def settings(self, data_dir: Path, **over):
        from ragkv_server.config import Settings

        a = self.args
        kw = dict(
            model=a.model,
            data_dir=data_dir,
            torch_threads=a.threads,
            max_new_tokens=a.max_new_tokens,
            top_k=a.top_k,
        )
        if a.chunk_tokens:
            kw["chunk_tokens"] = a.chunk_tokens
        return Settings(**{**kw, **over})

    def env(self, data_dir: Path, **extra: str) -> dict[str, str]:
        """The service's settings as ``RAGKV_*`` variables (what :meth:`settings` gives the library)."""
        a = self.args
        env = {
            "RAGKV_MODEL": a.model,
            "RAGKV_DATA_DIR": str(data_dir),
            "RAGKV_TORCH_THREADS": str(a.threads),
            "RAGKV_MAX_NEW_TOKENS": str(a.max_new_tokens),
            "RAGKV_TOP_K": str(a.top_k),
            "RAGKV_MAX_CONCURRENCY": "1",
            "RAGKV_LOG_LEVEL": "warning",
        }
        if a.chunk_tokens:
            env["RAGKV_CHUNK_TOKENS"] = str(a.chunk_tokens)
        return {**env, **extra}

    def load_data(self) -> None:
        for ds in self.args.datasets:
            samples = load_samples(get_spec(ds))[: self.args.limit]
            n = self.args.passages
            self.docs[ds] = [
                {"id": f"{ds}-{s.index}-{j}", "text": f"{t}\n{x}".strip(), "metadata": {"title": t}}
                for s in samples
                for j, (t, x) in enumerate(zip(s.titles[:n], s.texts[:n], strict=True))
            ]
            self.questions += [Question(ds, s.index, s.question) for s in samples]

    def build_base(self) -> None:
        """The pristine data folder: every passage ingested, as a service's ingest leaves it."""
        from ragkv_server.service import build_rag

        t0 = time.perf_counter()
        rag = build_rag(self.settings(self.base), writer=True)
        try:
            chunks = 0
            for ds, docs in self.docs.items():
                rep = rag.ingest(docs, collection=ds)
                chunks += getattr(rep, "chunks_added", 0) or 0
        finally:
            rag.close()
        self.ingest = {
            "documents": sum(map(len, self.docs.values())),
            "chunks": chunks,
            "seconds": time.perf_counter() - t0,
            "disk_bytes": dir_bytes(self.base),
        }
        print(
            f"ingested {self.ingest['documents']} passages ({chunks} chunks) in {self.ingest['seconds']:.0f} s, "
            f"{self.ingest['disk_bytes'] / 1e6:.1f} MB",
            flush=True,
        )

    def fresh_copy(self, name: str) -> Path:
        d = self.work / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(self.base, d, ignore=shutil.ignore_patterns(".writer.lock"))
        return d

    def setup_llama(self) -> None:
        gguf, why = llamacpp_status(self.args.model, not self.args.no_llamacpp)
        if gguf is None:
            self.llama_skip = why
            print(why, flush=True)
            return
        from ragkv.model.loader import load_model

        # ragkv's stop tokens (EOS and generation_config's) besides llama.cpp's EOS, and its tokenizer
        # for the answers' text (the weights are dropped: the RSS figures are ragkv's and llama.cpp's)
        model = load_model(self.args.model)
        eos, tokenizer = model.config.eos_token_ids, model.tokenizer
        del model
        self.llama = LlamaCpp(gguf, self.args.threads, self.args.n_ctx, eos)
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        import llama_cpp

        self.notes.append(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, {gguf.name}")

    def llama_rec(self, workload: str, index: int, rep: int, ids: Sequence[int], turn=None, prev=None) -> Rec:
        """llama.cpp on the prompt ``ids`` (after whatever it holds) as a record."""
        ttft, out, reused = self.llama.run(ids, self.args.max_new_tokens)
        text = self.decode(out)
        return Rec(
            workload, "llamacpp", index, rep, ttft, len(ids), reused, "llamacpp.prefix", out, text, turn, prev
        )

    # -- library workloads --
    def zipf_sequence(self, s: float) -> list[tuple[str, str]]:
        """(question text, collection) of the Zipf workload of exponent ``s``: the k-th repeat of a
        question paraphrased by rule k."""
        qs = self.questions
        seen: dict[int, int] = {}
        out = []
        for i in zipf_draw(len(qs), self.args.zipf_requests, s, self.args.seed):
            k = seen.get(i, 0)
            seen[i] = k + 1
            out.append((paraphrase(qs[i].text, k), qs[i].dataset))
        return out

    def requests(self, workload: str, rag) -> list[tuple[str, str, list]]:
        """(question text, collection, chunk records) of each request of a library workload, retrieved
        by ``rag`` as the service retrieves (top_k, fitted to the context), bursts from windows."""
        a = self.args
        qs = self.questions
        out = []
        if workload == "natural":
            for q in qs:
                out.append((q.text, q.dataset, None))
        elif workload.startswith("zipf-"):
            out += [(text, coll, None) for text, coll in self.zipf_sequence(float(workload.split("-")[1]))]
        elif workload == "bursts":
            for q in qs[: a.burst_topics]:
                ranked = rag.retrieve(q.text, a.top_k + a.burst_len - 1, collection=q.dataset)
                for j, win in enumerate(burst_windows(len(ranked), a.top_k, a.burst_len)):
                    out.append((paraphrase(q.text, j), q.dataset, [ranked[r] for r in win]))
        resolved = []
        for text, coll, chunks in out:
            rp = rag.prompt(text, chunks=chunks, max_new_tokens=a.max_new_tokens, collection=coll)
            resolved.append((text, coll, rp.chunks))
        return resolved

    def run_library(self, workload: str) -> tuple[list[Rec], dict]:
        from ragkv.generate import SamplingParams
        from ragkv_server.service import build_rag

        a = self.args
        recs: list[Rec] = []
        rss, disk = [], []
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0)
        for rep in range(a.repeats):
            data = self.fresh_copy(f"{workload}-r{rep}")
            rag = build_rag(self.settings(data), writer=True)
            try:
                reqs = self.requests(workload, rag)
                if workload == "natural" and rep == 0:
                    for q, (_, _, chunks) in zip(self.questions, reqs, strict=True):
                        self.retrieved[id(q)] = [c.text for c in chunks]
                for mode in (None, "full"):
                    # warm-up, untimed: a question without passages (lazy starts stay out of the
                    # figures; the default's cached instruction head is what any served request leaves)
                    kw = {"mode": mode} if mode else {}
                    rag.answer("Hello?", chunks=[], collection=reqs[0][1], params=params, **kw)
                if self.llama is not None:
                    self.llama.reset()
                # the arms interleaved request by request (paired under the same load); full reuses
                # nothing, and what it could leave behind is the same prompt default just ran
                for i, (text, coll, chunks) in enumerate(reqs):
                    for arm in arm_order(i):
                        mode = "full" if arm == "full" else None
                        kw = {"mode": mode} if mode else {}
                        ans = rag.answer(text, chunks=chunks, collection=coll, params=params, **kw)
                        cached, src = cached_of(ans.stats)
                        recs.append(
                            Rec(
                                workload,
                                arm,
                                i,
                                rep,
                                ans.timings.get("ttft_s"),
                                len(ans.prompt_ids),
                                cached,
                                src,
                                list(ans.token_ids),
                                ans.text,
                                extra={
                                    "mode_run": ans.stats.get("mode"),
                                    "tree_depth": ans.stats.get("tree_depth"),
                                },
                            )
                        )
                        if arm == "default" and self.llama is not None:
                            recs.append(self.llama_rec(workload, i, rep, list(ans.prompt_ids)))
                rss.append(rss_bytes())
            finally:
                rag.close()
            disk.append(dir_bytes(data))
            shutil.rmtree(data, ignore_errors=True)
            print(f"  {workload}: pass {rep + 1}/{a.repeats} done", flush=True)
        return recs, {
            "rss_bytes": max(filter(None, rss), default=None),
            "disk_bytes": max(disk, default=None),
        }

    # -- service workloads --
    def chat_messages(self, q: Question, session: int) -> list[dict]:
        passages = self.retrieved.get(id(q))
        if passages is None:  # natural did not run: retrieve now (the pristine folder, read only)
            passages = self._retrieve_texts(q)
        return [
            {"role": "system", "content": f"{SYSTEM} (session {session})"},
            {"role": "user", "content": first_user_message(passages, q.text)},
        ]

    def _retrieve_texts(self, q: Question) -> list[str]:
        from ragkv_server.service import build_rag

        if not hasattr(self, "_reader"):
            self._reader = build_rag(self.settings(self.fresh_copy("reader")), writer=True)
        rp = self._reader.prompt(q.text, max_new_tokens=self.args.max_new_tokens, collection=q.dataset)
        self.retrieved[id(q)] = [c.text for c in rp.chunks]
        return self.retrieved[id(q)]

    def close_reader(self) -> None:
        r = getattr(self, "_reader", None)
        if r is not None:
            r.close()
            del self._reader

    def chat_call(
        self, client, model: str, messages: list[dict], full: bool, collection: str, retrieve: bool = False
    ) -> dict:
        """One streamed chat completion: client TTFT (first content chunk), the answer, usage, ids.
        ``retrieve``: ragkv retrieves for the last user message (``ragkv.retrieve``: /v1/query's prompt)."""
        extra: dict = {"return_token_ids": True}
        opts = {**({"mode": "full"} if full else {}), **({"retrieve": True} if retrieve else {})}
        if opts:
            extra["ragkv"] = opts
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=self.args.max_new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            extra_headers={"X-Ragkv-Collection": collection},
        )
        first = None
        text = ""
        ids: list[int] = []
        info: dict = {}
        prompt_ids = None
        usage = None
        for ch in stream:
            now = time.perf_counter() - t0
            for c in ch.choices or []:
                content = c.delta.content if c.delta else None
                if content:
                    if first is None:
                        first = now
                    text += content
                tids = (c.model_extra or {}).get("token_ids")
                ids += list(tids or [])
            ex = ch.model_extra or {}
            if ex.get("ragkv"):
                info = ex["ragkv"]
            if ex.get("prompt_token_ids"):
                prompt_ids = ex["prompt_token_ids"]
            if ch.usage is not None:
                usage = ch.usage
        total = time.perf_counter() - t0
        # the response ends at the answer; the service's worker then commits the answer's KV and writes
        # the prompt's pages: wait for that, so the next timed request (any arm, llama.cpp's in this
        # process, or another service process on the same store) starts on an idle machine
        service_processes.wait_until_idle(str(client.base_url).rstrip("/").removesuffix("/v1"))
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return {
            "ttft_s": first if first is not None else total,
            "text": text,
            "ids": ids,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "usage_cached": getattr(details, "cached_tokens", None) if details else None,
            "stats": info.get("stats") or {},
            "server_ttft_s": (info.get("timings") or {}).get("ttft_s"),
            "prompt_ids": prompt_ids,
        }

    def rec_of(self, workload: str, arm: str, index: int, rep: int, r: dict, turn=None, prev=None) -> Rec:
        cached, src = cached_of(r["stats"], r["usage_cached"])
        if r["usage_cached"] is not None:  # what an OpenAI client reads wins over the stats
            cached, src = int(r["usage_cached"]), "usage.cached_tokens"
        return Rec(
            workload,
            arm,
            index,
            rep,
            r["ttft_s"],
            r["prompt_tokens"],
            cached,
            src,
            r["ids"],
            r["text"],
            turn,
            prev,
            r["server_ttft_s"],
            extra={"mode_run": r["stats"].get("mode"), "tree_depth": r["stats"].get("tree_depth")},
        )

    def serve(self, data_dir: Path, log_name: str, **env: str):
        from eval.harness import launch_server

        proc, base = launch_server(self.env(data_dir, **env), self.work / log_name, timeout_s=900)
        return proc, base

    def client(self, base: str):
        from openai import OpenAI

        return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)

    def run_chat(self, workloads: Sequence[str]) -> dict[str, tuple[list[Rec], dict]]:
        """``chat``, then (on the same data folder) ``restart``; the service is left stopped."""
        import httpx

        from eval.harness import stop_server

        a = self.args
        results: dict[str, tuple[list[Rec], dict]] = {}
        data = self.fresh_copy("chat")
        convs = self.questions[: a.chat_conversations]
        for q in convs:
            self.chat_messages(q, 0)  # retrieve first (the reader holds no lock the service needs)
        self.close_reader()
        proc, base = self.serve(data, "chat-server.log")
        first_turn: dict[int, tuple[list[dict], dict]] = {}
        try:
            client = self.client(base)
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            # warm-up: the service's lazy starts (self-check, locator) stay out of the figures
            for full in (False, True):
                self.chat_call(client, model, [{"role": "user", "content": "Hello"}], full, convs[0].dataset)
            recs: list[Rec] = []
            if "chat" in workloads:
                for rep in range(a.repeats):
                    if self.llama is not None:
                        self.llama.reset()
                    for c, q in enumerate(convs):
                        # each arm its own conversation (its own answers in the history), turn by turn
                        # side by side; llama.cpp on the default arm's prompt ids
                        msgs = {arm: self.chat_messages(q, rep) for arm in ("default", "full")}
                        prev: dict[str, int | None] = {"default": None, "full": None}
                        alive = {"default": True, "full": True}
                        for t in range(1, chat_turns(c) + 1):
                            for arm in arm_order(c + t):
                                if not alive[arm]:
                                    continue
                                if t > 1:
                                    follow = FOLLOW_UPS[(t - 2) % len(FOLLOW_UPS)]
                                    msgs[arm] = [*msgs[arm], {"role": "user", "content": follow}]
                                try:
                                    r = self.chat_call(client, model, msgs[arm], arm == "full", q.dataset)
                                except Exception as e:  # context full: the conversation ends there
                                    self.notes.append(
                                        f"chat {arm} conversation {c} turn {t}: {type(e).__name__}: {e}"
                                    )
                                    alive[arm] = False
                                    continue
                                recs.append(self.rec_of("chat", arm, c, rep, r, t, prev[arm]))
                                if arm == "default" and t == 1 and rep == 0:
                                    first_turn[c] = (msgs[arm], r)
                                if arm == "default" and self.llama is not None and r["prompt_ids"]:
                                    recs.append(self.llama_rec("chat", c, rep, r["prompt_ids"], t, prev[arm]))
                                prev[arm] = r["prompt_tokens"]
                                msgs[arm] = [*msgs[arm], {"role": "assistant", "content": r["text"]}]
                    print(f"  chat: pass {rep + 1}/{a.repeats} done", flush=True)
                results["chat"] = (recs, {"rss_bytes": rss_bytes(proc.pid), "disk_bytes": dir_bytes(data)})
            if "zipf-1-service" in workloads:
                zrecs = self.zipf_service(client, model)
                results["zipf-1-service"] = (
                    zrecs,
                    {"rss_bytes": rss_bytes(proc.pid), "disk_bytes": dir_bytes(data)},
                )
            if "restart" in workloads:
                if not first_turn:  # chat did not run: send each first request once before the restart
                    for c, q in enumerate(convs):
                        msgs = self.chat_messages(q, 0)
                        first_turn[c] = (msgs, self.chat_call(client, model, msgs, False, q.dataset))
        finally:
            stop_server(proc, 120)
        if "restart" in workloads:
            results["restart"] = self.run_restart(data, first_turn, convs)
        shutil.rmtree(data, ignore_errors=True)
        return results

    def zipf_service(self, client, model: str) -> list[Rec]:
        """The Zipf workload (s = 1.0) through the service: the OpenAI route with ``ragkv.retrieve`` (the
        service retrieves and builds /v1/query's prompt); a system message naming the pass keeps the
        passes apart (it replaces the service's system prompt)."""
        recs: list[Rec] = []
        seq = self.zipf_sequence(1.0)
        for rep in range(self.args.repeats):
            if self.llama is not None:
                self.llama.reset()
            for i, (text, coll) in enumerate(seq):
                msgs = [
                    {"role": "system", "content": f"{SYSTEM} (session {rep})"},
                    {"role": "user", "content": text},
                ]
                for arm in arm_order(i):
                    r = self.chat_call(client, model, msgs, arm == "full", coll, retrieve=True)
                    recs.append(self.rec_of("zipf-1-service", arm, i, rep, r))
                    if arm == "default" and self.llama is not None and r["prompt_ids"]:
                        recs.append(self.llama_rec("zipf-1-service", i, rep, r["prompt_ids"]))
            print(f"  zipf-1-service: pass {rep + 1}/{self.args.repeats} done", flush=True)
        return recs

    def run_restart(self, data: Path, first_turn: dict, convs: list[Question]) -> tuple[list[Rec], dict]:
        import httpx

        from eval.harness import stop_server

        proc, base = self.serve(data, "restart-server.log")
        recs: list[Rec] = []
        try:
            client = self.client(base)
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            # warm-up, as in chat: a greeting that shares no passages with the repeated requests
            self.chat_call(client, model, [{"role": "user", "content": "Hello"}], False, convs[0].dataset)
            for c, (msgs, before) in sorted(first_turn.items()):
                coll = convs[c].dataset
                r = self.chat_call(client, model, msgs, False, coll)  # the first request after the restart
                recs.append(self.rec_of("restart", "default", c, 0, r))
                recs[-1].extra["reference_text"] = before["text"]  # its answer before the restart
                f = self.chat_call(client, model, msgs, True, coll)
                recs.append(self.rec_of("restart", "full", c, 0, f))
                if self.llama is not None and r["prompt_ids"]:
                    self.llama.reset()  # llama.cpp after its own restart: nothing held
                    recs.append(self.llama_rec("restart", c, 0, r["prompt_ids"]))
            extra = {"rss_bytes": rss_bytes(proc.pid), "disk_bytes": dir_bytes(data)}
        finally:
            stop_server(proc, 120)
        return recs, extra

    def run_two_process(self) -> tuple[list[Rec], dict] | dict:
        import httpx

        from eval.harness import free_port, stop_server

        a = self.args
        binary = shutil.which("redis-server")
        if binary is None:
            return {
                "skipped": "redis-server not found (scripts/setup.sh installs it; apt-get install redis-server)"
            }
        port = free_port()
        rdir = self.work / "redis"
        rdir.mkdir(exist_ok=True)
        redis = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(rdir),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs = []
        recs: list[Rec] = []
        convs = self.questions[: a.chat_conversations]
        for q in convs:
            self.chat_messages(q, 0)
        self.close_reader()
        try:
            _wait_redis(port)
            url = f"redis://127.0.0.1:{port}/0"
            bases = []
            for name in ("A", "B"):
                d = self.work / f"two-{name}"
                p, b = self.serve(d, f"two-{name}.log", RAGKV_STORE=url)
                procs.append(p)
                bases.append(b)
                for ds, docs in self.docs.items():
                    httpx.post(
                        b + "/v1/documents",
                        json={"documents": docs},
                        headers={"X-Ragkv-Collection": ds},
                        timeout=3600,
                    ).raise_for_status()
            ca, cb = self.client(bases[0]), self.client(bases[1])
            model = httpx.get(bases[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
            for cl in (ca, cb):  # warm-up of each service
                self.chat_call(cl, model, [{"role": "user", "content": "Hello"}], False, convs[0].dataset)
            for c, q in enumerate(convs):
                msgs = self.chat_messages(q, 0)
                on_a = self.chat_call(ca, model, msgs, False, q.dataset)  # computed on the first process
                r = self.chat_call(cb, model, msgs, False, q.dataset)  # then sent to the second
                recs.append(self.rec_of("two-process", "default", c, 0, r))
                recs[-1].extra["reference_text"] = on_a["text"]  # the first process's answer
                f = self.chat_call(cb, model, msgs, True, q.dataset)
                recs.append(self.rec_of("two-process", "full", c, 0, f))
                if self.llama is not None and r["prompt_ids"]:
                    self.llama.reset()  # a second llama.cpp process holds nothing
                    recs.append(self.llama_rec("two-process", c, 0, r["prompt_ids"]))
            extra = {
                "rss_bytes": sum(filter(None, (rss_bytes(p.pid) for p in procs))),
                "disk_bytes": sum(dir_bytes(self.work / f"two-{n}") for n in ("A", "B")),
                "redis_bytes": _redis_used(port),
            }
        finally:
            for p in procs:
                stop_server(p, 120)
            redis.terminate()
            redis.wait(timeout=30)
        return recs, extra

    def cleanup(self) -> None:
        self.close_reader()
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)


def _wait_redis(port: int, timeout_s: float = 15) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer")


def _redis_used(port: int) -> int | None:
    try:
        import redis

        return int(redis.Redis(host="127.0.0.1", port=port).info("memory")["used_memory"])
    except Exception:
        return None


def restart_figures(recs: list[Rec]) -> dict:
    """The cached share of each repeated request (after a restart, or on the second process), and
    whether its answer is the one it got the first time (before the restart, on the first process)."""
    d = [r for r in recs if r.arm == "default" and r.prompt_tokens]
    shares = [r.cached_tokens / r.prompt_tokens for r in d if r.cached_tokens is not None]
    same = [r.text == r.extra["reference_text"] for r in d if "reference_text" in r.extra]
    return {
        "cached_share": statistics.median(shares) if shares else None,
        "cached_share_min": min(shares) if shares else None,
        "same_answer_as_first_time": sum(same) / len(same) if same else None,
    }


def plot_workload(out: Path, name: str, recs: list[Rec]) -> Path | None:
    if name == "chat":
        series = {
            arm: [(t, v) for (i, t), v in _median_by_key([r for r in recs if r.arm == arm], arm).items()]
            for arm in ARMS
        }
        by_turn = {}
        for arm, pts in series.items():
            turns: dict[int, list[float]] = {}
            for t, v in pts:
                turns.setdefault(t, []).append(v)
            by_turn[arm] = [(t, statistics.median(v)) for t, v in turns.items()]
        return plot(
            out / "ttft_chat_per_turn.png", "chat: TTFT per turn (median over conversations)", by_turn, "turn"
        )
    series = {arm: [(i, v) for (i, _), v in _median_by_key(recs, arm).items()] for arm in ARMS}
    return plot(out / f"ttft_{name}.png", f"{name}: TTFT per request", series, "request")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m eval.bench_workload",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--datasets", default="musique,2wikimqa", help="comma list of musique, 2wikimqa")
    ap.add_argument("--limit", type=int, default=None, help="questions per dataset (default 10; --quick 1)")
    ap.add_argument(
        "--passages",
        type=int,
        default=None,
        help="passages ingested per question (default all 10; --quick 4)",
    )
    ap.add_argument(
        "--model", default=None, help="model (default: the default model; 'tiny': models/stories260k)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the service's and llama.cpp's")
    ap.add_argument(
        "--repeats", type=int, default=None, help="passes of each workload (default 3; --quick 1)"
    )
    ap.add_argument(
        "--top-k", type=int, default=None, help="passages per question (default: the service's, 6)"
    )
    ap.add_argument(
        "--chunk-tokens", type=int, default=None, help="tokens per chunk (default: the service's)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default 16; --quick 8)")
    ap.add_argument("--zipf-requests", type=int, default=None, help="requests per Zipf workload (default 48)")
    ap.add_argument(
        "--burst-topics", type=int, default=None, help="topics of the bursts workload (default 6)"
    )
    ap.add_argument("--burst-len", type=int, default=4, help="queries per burst")
    ap.add_argument("--chat-conversations", type=int, default=None, help="conversations (default 6)")
    ap.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_workload", help="folder of the plots and results.json")
    ap.add_argument("--work-dir", default=None, help="where the data folders go (default: the system's temp)")
    ap.add_argument("--keep-work", action="store_true", help="keep the data folders and server logs")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: 1 question and 4 passages per dataset, 1 pass, top-k 3, 8 new tokens, 4 Zipf "
        "requests, 1 burst of 3, 2 conversations (3-7 minutes on the tiny model; the default model took "
        "40 minutes beside busy jobs on 2 cores)",
    )
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp column")
    return ap


def resolve_args(args) -> argparse.Namespace:
    """Defaults that depend on ``--quick`` and the model; checked."""
    from ragkv import DEFAULT_MODEL

    q = args.quick
    args.model = {None: DEFAULT_MODEL, "tiny": str(TINY_MODEL)}.get(args.model, args.model)
    tiny = Path(args.model).resolve() == TINY_MODEL.resolve()
    defaults = dict(
        limit=1 if q else 10,
        passages=4 if q else 10,
        repeats=1 if q else 3,
        top_k=(2 if tiny else 3) if q else 6,
        max_new_tokens=(4 if tiny else 8) if q else 16,
        zipf_requests=4 if q else 48,
        burst_topics=1 if q else 6,
        chat_conversations=2 if q else 6,
        chunk_tokens=96 if tiny else None,
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if q:
        args.burst_len = min(args.burst_len, 3)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; use any of {', '.join(WORKLOADS)}")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in args.datasets:
        get_spec(d)
    for k in (
        "limit",
        "passages",
        "repeats",
        "top_k",
        "max_new_tokens",
        "zipf_requests",
        "burst_topics",
        "chat_conversations",
        "threads",
    ):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(build_parser().parse_args(argv))
    import torch

    torch.set_num_threads(args.threads)
    b = Bench(args)
    t_start = time.perf_counter()
    figures: dict[str, dict] = {}
    plots: list[str] = []
    (b.out / "records.jsonl").write_text("")

    def result() -> dict:
        return {
            "bench": "workload",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": args.model,
            "threads": args.threads,
            "datasets": args.datasets,
            "limit": args.limit,
            "passages": args.passages,
            "repeats": args.repeats,
            "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens,
            "quick": args.quick,
            "llamacpp": None if b.llama is None else "llama-cpp-python",
            "llamacpp_skipped": b.llama_skip,
            "ingest": b.ingest,
            "seconds": round(time.perf_counter() - t_start, 1),
            "plots": plots,
            "notes": b.notes,
            "workloads": figures,
        }

    def done(w: str, recs: list[Rec], figs: dict) -> None:
        """A finished workload: its figures, records (``records.jsonl``), plot, results so far."""
        figures[w] = figs
        with open(b.out / "records.jsonl", "a") as f:
            for r in recs:
                f.write(json.dumps(vars(r)) + "\n")
        p = plot_workload(b.out, w, recs) if w in LIBRARY or w in ("chat", "zipf-1-service") else None
        plots.extend([str(p)] if p else [])
        (b.out / "results.json").write_text(json.dumps(result(), indent=1))
        print(
            f"  {w}: default p50 {_fmt(figs.get('default_ttft_p50_s'))} s, full {_fmt(figs.get('full_ttft_p50_s'))} s, "
            f"llama.cpp {_fmt(figs.get('llamacpp_ttft_p50_s'))} s, hit {_fmt(figs.get('default_hit_rate'))}",
            flush=True,
        )

    try:
        b.load_data()
        b.setup_llama()
        b.build_base()
        for w in [w for w in args.workloads if w in LIBRARY]:
            print(f"workload {w} ...", flush=True)
            recs, extra = b.run_library(w)
            done(w, recs, {**summarize(recs), **extra})
        svc = [w for w in args.workloads if w in ("chat", "zipf-1-service", "restart")]
        if svc:
            print(f"workloads {', '.join(svc)} (service) ...", flush=True)
            for w, (recs, extra) in b.run_chat(svc).items():
                figs = {**(summarize_chat(recs) if w == "chat" else summarize(recs)), **extra}
                if w == "restart":
                    figs.update(restart_figures(recs))
                done(w, recs, figs)
        if "two-process" in args.workloads:
            print("workload two-process (two services, one Redis store) ...", flush=True)
            got = b.run_two_process()
            if isinstance(got, dict):
                figures["two-process"] = got
            else:
                recs, extra = got
                done("two-process", recs, {**summarize(recs), **extra, **restart_figures(recs)})
    finally:
        b.cleanup()
    res = result()
    (b.out / "results.json").write_text(json.dumps(res, indent=1))
    print()
    print(table(figures))
    if b.llama_skip:
        print(b.llama_skip)
    for n in b.notes:
        print("note:", n)
    print(f"plots, records.jsonl and results.json in {b.out}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
