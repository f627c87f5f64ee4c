"""An hour of faults (issue 54): the service under concurrent load while faults are injected, then a
check that nothing acknowledged was lost and no wrong answer was served.

Starts Redis and the service (``python -m ragkv_server.server``) on loopback, the service's chunk KV and
exact KV tree in Redis (``RAGKV_STORE``), its data folder on a small tmpfs made for the run where
``mount`` is allowed (root). ``--clients`` threads (:mod:`eval.soak_clients`) ingest and delete MuSiQue
passages, ask ``/v1/query`` (the default setting, and blend), chat (single and multi-turn, with and
without retrieval, streamed and not) and complete, for ``--minutes``. After a quiet phase (no faults: the
latency baseline), a fault injector (:mod:`eval.soak_faults`) hits, one at a time at seeded random times,
``--faults-per-kind`` of each kind: SIGKILL the service (restarted, time back to serving measured),
restart Redis, flip or truncate stored chunk blobs and tree pages, a full store (Redis at maxmemory,
noeviction), a full disk (tmpfs filled), a slow store (Redis paused 2/3 of the time). Every one of them is
injected: an injector behind schedule (restarts take seconds) goes on past ``--minutes``.

Afterwards (:mod:`eval.soak_check`) from the JSONL history: every acknowledged document listed and
retrievable, no deleted one listed or served; every exact answer equal to full prefill's greedy answer
for its served prompt ids (recomputed here, ``mode="full"``); every error a clean JSON error with an
expected status, no hang; no stored chunk KV that no chunk of the index references; RSS and store bytes
(stored chunk KV + the index; SQLite's write-ahead log and the exact KV tree's pages, a cache that Redis'
``maxmemory`` bounds, reported apart) at the end within :data:`RSS_FACTOR` / :data:`STORE_FACTOR` of the
end of the quiet phase; p99 TTFT outside the faults' windows (and :data:`eval.soak_check.SETTLE_S` after)
vs the quiet phase's. Ends with one JSON line; ``--plot`` draws latency over time with the faults marked.

``--store file``: the service's default store (files under its data folder) instead of Redis;
``--generation engine``: continuous batching instead of worker threads.

    python -m eval.soak --plot soak.png               # 60 minutes, the default model, 40 faults per kind
    python -m eval.soak --minutes 2.5 --tiny --fork --faults-per-kind 2    # the slow test's size
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import httpx

from eval.soak_check import check_answers, check_documents, check_errors, deleted_served, ttft_figures
from eval.soak_clients import Client, History, Ledger
from eval.soak_faults import FileStore, Injector, Redis, Service, healthy, mount_small_fs, unmount
from ragkv.testing import musique_samples, stories_path

#: RSS at the end may be at most this many times RSS at the end of the quiet phase
RSS_FACTOR = 2.0
#: store bytes (stored chunk KV + the index, :func:`store_bytes`) likewise
STORE_FACTOR = 3.0
#: faults of each kind in a 60-minute run (scaled to --minutes)
FAULTS_PER_HOUR = 40
#: the issue's goals reported (not part of ``ok``: durations on a shared machine): the service answers
#: again within this long of every restart, and p99 TTFT outside faults within this factor of quiet's
RECOVERY_GOAL_S = 30.0
TTFT_GOAL_RATIO = 2.0
#: the data folder's filesystem (tmpfs), MiB: the index with a Redis store, the KV too with the file store
DISK_MIB = 64
FILE_DISK_MIB = 512
#: what a corrupting fault reports when it found nothing to hit (not counted; tried again once)
MISSED = ("nothing stored", "gone")


def corpus(n_docs: int, chars: int = 400) -> tuple[dict[str, dict], list[str]]:
    """``n_docs`` MuSiQue passages (4 of each sample, cut to ``chars``) and the samples' questions."""
    samples = musique_samples((n_docs + 3) // 4)
    docs = {}
    for i, s in enumerate(samples):
        for j, c in enumerate(s["ctxs"][:4]):
            if len(docs) < n_docs:
                docs[f"s{i}-p{j}"] = {
                    "id": f"s{i}-p{j}",
                    "text": c["text"][:chars],
                    "metadata": {"title": c["title"]},
                }
    return docs, [s["question"] for s in samples]


def service_env(
    data: Path, store: str | None, model: str | None, max_tokens: int, generation: str = "threads"
) -> dict[str, str]:
    """The service's settings: the exact default setting (no ratio: answers must equal full prefill's),
    one torch thread, small limits, a queue deadline under the clients' deadline."""
    env = {
        "RAGKV_DATA_DIR": str(data),
        "RAGKV_TORCH_THREADS": "1",
        "RAGKV_MAX_NEW_TOKENS": str(max_tokens),
        "RAGKV_MAX_NEW_TOKENS_LIMIT": "64",
        "RAGKV_TOP_K": "3",
        "RAGKV_CHUNK_TOKENS": "64",
        "RAGKV_MAX_CONCURRENCY": "2",
        "RAGKV_MAX_QUEUE": "64",
        "RAGKV_QUEUE_TIMEOUT_S": "30",
        "RAGKV_LOG_LEVEL": "warning",
        "RAGKV_GENERATION": generation,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if model:
        env["RAGKV_MODEL"] = model
    if store:  # else the default: files under data_dir/kv
        env["RAGKV_STORE"] = store
    return env


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sqlite_bytes(path: Path) -> int:
    """A SQLite database's size as its readers see it (pages x page size, the write-ahead log's pages
    included): the same before and after a checkpoint moves them into the file."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()


def store_bytes(store: Redis | FileStore, data: Path) -> dict[str, int]:
    """What grows with the documents: stored chunk KV and the index (SQLite's pages, FAISS), and beside
    them SQLite's write-ahead log files (their high-water mark, bounded by SQLite's checkpoints). The exact KV tree's
    pages are a cache (bounded by Redis' ``maxmemory``, LRU; on disk by the file store's byte bound)."""
    index = wal = 0
    for p in data.rglob("*"):
        if p.is_file() and "kv" not in p.relative_to(data).parts:
            if p.name.endswith(("-wal", "-shm")):
                wal += p.stat().st_size
            elif p.suffix == ".sqlite":
                index += sqlite_bytes(p)
            else:
                index += p.stat().st_size
    return {"chunk_kv": sum(store.chunk_bytes().values()), "index": index, "wal": wal}


def referenced_keys(data: Path) -> tuple[set[str], set[str]]:
    """The chunk KV keys the index's chunks reference, and those its write-ahead record lists (KV an
    unfinished ingest or delete may have left, deleted by the next write or start), read from its
    SQLite (the service stopped)."""
    db = sqlite3.connect(f"file:{data / 'index' / 'chunks.sqlite'}?mode=ro", uri=True)
    try:
        used = {k for (k,) in db.execute("SELECT DISTINCT kv_key FROM chunks")}
        return used, {k for (k,) in db.execute("SELECT DISTINCT kv_key FROM kv_intents")}
    finally:
        db.close()


def scrape(base: str) -> dict[str, float]:
    """The service's integrity counters now: corrupt chunk blobs and tree pages found (their digests
    failed: recomputed, never used), tree pages rejected (another prefix) and read, chunk KV misses."""
    want = {
        'ragkv_store_ops{op="corrupt"}': "blobs_corrupt_detected",
        'ragkv_kv_tree{figure="store_pages_rejected"}': "tree_pages_rejected",
        'ragkv_kv_tree{figure="store_pages_corrupt"}': "tree_pages_corrupt_detected",
        'ragkv_kv_tree{figure="store_pages_read"}': "tree_pages_read",
        "ragkv_kv_chunk_misses": "chunk_misses",
    }
    out = dict.fromkeys(want.values(), 0.0)
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


class Counters:
    """Integrity counters summed over every start of the service (each start counts from zero)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def fold(self) -> None:
        for k, v in self.last.items():
            self.total[k] = self.total.get(k, 0.0) + v
        self.last = {}

    def read(self, base: str) -> None:
        self.last = scrape(base)

    def figures(self) -> dict[str, int]:
        keys = set(self.total) | set(self.last)
        return {k: int(self.total.get(k, 0.0) + self.last.get(k, 0.0)) for k in sorted(keys)}


def run(
    minutes: float = 60.0,
    clients: int = 4,
    seed: int = 0,
    model: str | None = None,
    workdir: Path | None = None,
    fork: bool = False,
    faults_per_kind: int | None = None,
    window_s: float = 4.0,
    quiet_frac: float = 0.15,
    max_tokens: int = 8,
    n_docs: int = 40,
    check_limit: int | None = None,
    plot: Path | None = None,
    redis_mib: int = 512,
    generation: str = "threads",
    store: str = "redis",
    disk_mib: int | None = None,
) -> dict:
    """The soak (see the module doc); its figures. ``model``: a model folder (None: the default model)."""
    own = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ragkv-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t0 = time.monotonic()
    now = lambda: round(time.monotonic() - t0, 4)  # noqa: E731
    duration = 60.0 * minutes
    per_kind = faults_per_kind or max(1, round(FAULTS_PER_HOUR * minutes / 60))
    docs, questions = corpus(n_docs)
    ledger = Ledger(docs)
    disk = workdir / "disk"
    mounted = mount_small_fs(disk, disk_mib or (DISK_MIB if store == "redis" else FILE_DISK_MIB))
    kv = Redis(maxmemory=redis_mib << 20) if store == "redis" else FileStore(disk / "data")
    history = History(workdir / "history.jsonl", t0)
    service = None
    stop = threading.Event()
    threads: list[Client] = []
    counters = Counters()
    injector = None
    quiet_end = end_at = duration  # from the clients' start (set then)
    res: dict = {
        "minutes": minutes,
        "clients": clients,
        "seed": seed,
        "model": model or "default",
        "generation": generation,
        "store": store,
    }
    try:
        env = service_env(disk / "data", kv.store_url(), model, max_tokens, generation)
        service = Service(env, workdir, fork, t0)
        res["first_start_s"] = round(service.start(), 2)
        injector = Injector(service, kv, random.Random(seed + 1), disk if mounted else None, window_s)
        # half the documents first (acknowledged before the clients start)
        first = sorted(docs)[: n_docs // 2]
        with httpx.Client(base_url=service.base, timeout=300) as c:
            for i in range(0, len(first), 4):
                batch = [docs[d] for d in first[i : i + 4]]
                r = c.post("/v1/documents", json={"documents": batch})
                r.raise_for_status()
                for d in batch:
                    ledger.begin_ingest(d["id"], now())
                    ledger.end(d["id"], "present", now())
        ids = sorted(docs)
        for n in range(clients):
            own_ids = ids[n::clients]
            deadline = 90.0
            threads.append(
                Client(
                    n,
                    seed * 1000 + n,
                    service,
                    ledger,
                    own_ids,
                    questions,
                    history,
                    stop,
                    max_tokens,
                    deadline,
                )
            )
        for t in threads:
            t.start()
        quiet_end, end_at = now() + quiet_frac * duration, now() + duration
        time.sleep(max(0.0, quiet_end - now()))
        res["rss_start_bytes"] = service.rss_bytes()
        start = store_bytes(kv, disk / "data")
        res |= {f"{k}_start_bytes": v for k, v in start.items()}
        res["store_start_bytes"] = start["chunk_kv"] + start["index"]
        res["kv_used_start_bytes"] = kv.used_bytes()
        # the faults: per_kind of each kind, in seeded shuffled rounds, at seeded random times
        kinds = injector.kinds()
        order = []
        for _ in range(per_kind):
            rnd = list(kinds)
            injector.rng.shuffle(rnd)
            order += rnd
        crashes = 0
        retried = 0
        # every fault is injected: behind schedule (a restart takes ~13 s on the default model), the rest
        # come window_s + 1 s apart past --minutes; one that found nothing to hit goes again at the end
        for i, kind in enumerate(order):
            gap = max(window_s + 1.0, (end_at - window_s - now()) / (len(order) - i + 1))
            due = now() + rng.uniform(0.5, 1.0) * gap
            while now() < due:
                if service.proc.poll() is not None and service.up:  # died on its own: restart it
                    crashes += 1
                    counters.fold()
                    service.start()
                time.sleep(0.2)
            if kind == "kill_service":
                counters.read(service.base)
                counters.fold()
            ev = injector.inject(kind, now)
            print(f"[{ev.start:7.1f} s] {kind}: {ev.detail} ({ev.end - ev.start:.1f} s)", flush=True)
            if ev.detail in MISSED and retried < len(kinds):
                order.append(kind)
                retried += 1
        time.sleep(max(0.0, end_at - now()))
        stop.set()
        for t in threads:
            t.join(timeout=120)
        res["clients_stuck"] = sum(t.is_alive() for t in threads)
        ledger.close(now())
        if service.proc.poll() is not None:
            crashes += 1
            counters.fold()
            service.start()
        service.idle(300)
        res["rss_end_bytes"] = service.rss_bytes()
        end = store_bytes(kv, disk / "data")
        res |= {f"{k}_end_bytes": v for k, v in end.items()}
        res["store_end_bytes"] = end["chunk_kv"] + end["index"]
        res["kv_used_end_bytes"] = kv.used_bytes()  # Redis' used memory, or the KV folder's bytes
        res["redis_maxmemory_bytes"] = kv.maxmemory
        counters.read(service.base)
        res["crashes"] = crashes
        res["healthy_at_end"] = healthy(service.base)
        res |= check_documents(service.base, ledger)
    finally:
        stop.set()
        history.close()
        if service is not None:
            service.stop()
            if "store_end_bytes" in res:  # stored chunk KV that no chunk of the index references
                used, intended = referenced_keys(disk / "data")
                unused = set(kv.chunk_bytes()) - used
                res["orphan_chunk_blobs"] = len(unused - intended)  # recorded nowhere: stored for good
                res["pending_delete_blobs"] = len(unused & intended)  # the next write or start deletes them
        kv.close()
        if mounted:
            unmount(disk)
    records = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines()]
    events = injector.events if injector is not None else []
    kills = [(e.start, e.end) for e in events if e.kind == "kill_service"]
    windows = [(e.start, e.end) for e in events]
    res |= check_errors(records, kills)
    res["deleted_served"] = [r["t0"] for r in deleted_served(records, ledger)]
    res |= ttft_figures(records, quiet_end, windows)
    t_check = time.monotonic()
    res |= check_answers(records, model, check_limit, seed)
    res["answer_check_s"] = round(time.monotonic() - t_check, 1)
    res |= counters.figures()
    recoveries = [e.recovery_s for e in events if e.recovery_s is not None]
    res |= {
        "requests": len(records),
        "ops": dict(sorted(_count(r["op"] for r in records).items())),
        "faults": dict(sorted(_count(e.kind for e in events if e.detail not in MISSED).items())),
        "faults_missed": sum(e.detail in MISSED for e in events),
        "faults_per_kind": per_kind,
        "disk_full_available": mounted,
        "recovery_max_s": max(recoveries, default=None),
        "recovery_median_s": sorted(recoveries)[len(recoveries) // 2] if recoveries else None,
        "tracebacks": service.tracebacks() if service else None,
        "rss_factor": round(res["rss_end_bytes"] / res["rss_start_bytes"], 2)
        if res.get("rss_start_bytes")
        else None,
        "store_factor": round(res["store_end_bytes"] / res["store_start_bytes"], 2)
        if res.get("store_start_bytes")
        else None,
        "history": str(workdir / "history.jsonl"),
    }
    res["recovery_within_goal"] = all(r <= RECOVERY_GOAL_S for r in recoveries)
    ratio = res.get("ttft_p99_ratio")
    res["ttft_within_goal"] = None if ratio is None else ratio <= TTFT_GOAL_RATIO
    res["ok"] = passed(res)
    if plot is not None:
        draw(records, events, quiet_end, plot)
    with (workdir / "faults.jsonl").open("w") as f:
        for e in events:
            f.write(json.dumps(e.__dict__) + "\n")
    if own and res["ok"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def passed(res: dict) -> bool:
    """The run's goals that are counts (the latency ratio and the recovery time are reported)."""
    empty = (
        "acknowledged_lost",
        "deleted_listed",
        "unretrievable",
        "wrong_answers",
        "unclean_errors",
        "hangs",
        "dropped_while_up",
        "deleted_served",
        "orphan_chunk_blobs",
    )
    return (
        all(not res.get(k) for k in empty)
        and res.get("answers_checked", 0) > 0
        and res.get("clients_stuck") == 0
        and res.get("crashes") == 0
        and "orphan_chunk_blobs" in res
        and res.get("healthy_at_end", False)
        and (res.get("rss_factor") or 0) <= RSS_FACTOR
        and (res.get("store_factor") or 0) <= STORE_FACTOR
    )


def draw(records: list[dict], events, quiet_end: float, path: Path) -> None:
    """Latency (TTFT of streamed requests, the whole answer otherwise) over time, the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    ok = [r for r in records if r.get("status") == 200 and "ttft" in r]
    for stream, color, label in (
        (True, "tab:blue", "TTFT (streamed)"),
        (False, "tab:gray", "answer (not streamed)"),
    ):
        pts = [(r["t0"], 1000 * r["ttft"]) for r in ok if bool(r.get("stream")) == stream]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=4, color=color, label=label, alpha=0.6)
    colors = dict(zip(sorted({e.kind for e in events}), plt.cm.tab10.colors, strict=False))
    seen = set()
    for e in events:
        ax.axvspan(
            e.start,
            max(e.end, e.start + 0.5),
            color=colors[e.kind],
            alpha=0.25,
            label=None if e.kind in seen else e.kind,
        )
        seen.add(e.kind)
    ax.axvline(quiet_end, color="k", ls="--", lw=0.8, label="end of the quiet phase")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(res: dict) -> str:
    f = res.get("faults", {})
    return (
        f"{res['requests']} requests, {sum(f.values())} faults ({', '.join(f'{k} {v}' for k, v in f.items())}); "
        f"lost {len(res['acknowledged_lost'])}, deleted listed {len(res['deleted_listed'])}, unretrievable "
        f"{len(res['unretrievable'])}, wrong answers {len(res['wrong_answers'])} of {res['answers_checked']} "
        f"checked, unclean errors {len(res['unclean_errors'])}, hangs {len(res['hangs'])}; recovery max "
        f"{res['recovery_max_s']} s; p99 TTFT {res['ttft_quiet_p99_ms']} ms quiet, "
        f"{res['ttft_outside_faults_p99_ms']} ms outside faults; RSS x{res['rss_factor']}, store "
        f"x{res['store_factor']}: {'PASS' if res['ok'] else 'FAIL'}"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m eval.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model (default: the default model)")
    ap.add_argument("--model", default=None, help="a model folder (default: the default model)")
    ap.add_argument("--fork", action="store_true", help="fork the service from a fork server (faster starts)")
    ap.add_argument("--faults-per-kind", type=int, default=None, help=f"default {FAULTS_PER_HOUR} per hour")
    ap.add_argument("--window-s", type=float, default=4.0, help="length of a full disk / store, a slow store")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--check-limit", type=int, default=None, help="distinct prompts recomputed at most")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="kept (default: a temporary one, removed if ok)"
    )
    ap.add_argument("--store", choices=["redis", "file"], default="redis", help="the service's chunk store")
    ap.add_argument(
        "--disk-mib",
        type=int,
        default=None,
        help=f"the data folder's tmpfs (default {DISK_MIB}, {FILE_DISK_MIB} with --store file)",
    )
    ap.add_argument("--redis-mib", type=int, default=512, help="Redis' maxmemory (LRU): the store's bound")
    ap.add_argument("--generation", choices=["threads", "engine"], default="threads", help="the service's")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of latency over time with the faults")
    args = ap.parse_args(argv)
    model = str(stories_path()) if args.tiny else args.model
    res = run(
        args.minutes,
        args.clients,
        args.seed,
        model,
        args.workdir,
        args.fork,
        args.faults_per_kind,
        args.window_s,
        max_tokens=args.max_tokens,
        n_docs=args.docs,
        check_limit=args.check_limit,
        plot=args.plot,
        redis_mib=args.redis_mib,
        generation=args.generation,
        store=args.store,
        disk_mib=args.disk_mib,
    )
    print(summary(res))
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
