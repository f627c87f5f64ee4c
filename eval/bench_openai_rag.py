"""Issue 39's goal: the most common RAG code there is, LangChain's stuff chain
``ChatPromptTemplate([system, "Context:\\n{context}\\n\\nQuestion: {question}"]) | ChatOpenAI(base_url=...)``,
against a live ragkv service on the real default model with MuSiQue passages ingested.

For 2, 4, 6 and 10 passages of the first MuSiQue question the chain is invoked through
``langchain-openai``'s ``ChatOpenAI`` twice: as is (the service's default: the stored chunks inside
the messages are reused in its default mode) and with ``extra_body={"ragkv": {"mode": "full"}}`` (a
full prefill of the same token ids). Reported per size: prompt tokens, the passages' tokens, rows
taken from stored KV (``stats.num_reused_rows``) and their share of the passages' tokens, the
service's time to first token in both modes (``ragkv.timings.ttft_s``, after the queue) and their
ratio, and the two answers. What the service answered is read from its JSON with an httpx response
hook on the client ChatOpenAI uses (LangChain keeps only the message). Ends with one JSON line.

    python -m eval.bench_openai_rag                       # the real default model, 2 torch threads
    python -m eval.bench_openai_rag --sizes 10 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from eval.harness import launch_server, stop_server

DATA = Path(__file__).resolve().parents[1] / "data" / "musique_s.json"
SYSTEM = "You are a helpful assistant. Answer the question from the context, in a few words."
HUMAN = "Context:\n{context}\n\nQuestion: {question}"


def musique_passages(n: int = 18) -> tuple[str, list[str]]:
    """The first MuSiQue question and ``n`` passages (``title\\ntext``): its 10, then the next question's."""
    samples = json.loads(DATA.read_text())
    texts = [f"{c['title']}\n{c['text']}".strip() for s in samples[:3] for c in s["ctxs"]]
    return samples[0]["question"], texts[:n]


class Recorder:
    """The JSON bodies of the service's answers, read by an httpx response hook (what the client saw)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def hook(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            if response.headers.get("content-type", "").startswith("application/json"):
                self.bodies.append(response.json())

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=600, event_hooks={"response": [self.hook]})

    @property
    def last(self) -> dict:
        return self.bodies[-1]


def chat_openai(base: str, model: str, recorder: Recorder | None = None, **kw):
    """``langchain-openai``'s ``ChatOpenAI`` pointed at the service (greedy, no retries)."""
    from langchain_openai import ChatOpenAI

    extra = {"http_client": recorder.client()} if recorder is not None else {}
    return ChatOpenAI(
        base_url=base + "/v1", api_key="unused", model=model, max_retries=0, temperature=0, **extra, **kw
    )


def stuff_chain(llm):
    """LangChain's stuff chain: the passages joined by blank lines in one human turn after a system turn."""
    from langchain_core.prompts import ChatPromptTemplate

    return ChatPromptTemplate([("system", SYSTEM), ("human", HUMAN)]) | llm


def start_service(
    data_dir: Path,
    model: str,
    threads: int,
    passages: list[str],
    ratio: float | None = None,
    fork: bool = False,
) -> tuple:
    """A live ``python -m ragkv_server.server`` on ``model`` with ``passages`` ingested (ids ``p0``...);
    ``ratio``: an explicit blend ratio for the service (None: the fidelity gate's operating point);
    ``fork``: forked from a fork server (``eval.harness.spawn_server``: the tests)."""
    env = {
        "RAGKV_MODEL": model,
        "RAGKV_TORCH_THREADS": str(threads),
        "RAGKV_DATA_DIR": str(data_dir),
        "RAGKV_LOG_LEVEL": "warning",
        "RAGKV_MAX_CONCURRENCY": "1",
        **({"RAGKV_RATIO": str(ratio)} if ratio is not None else {}),
    }
    proc, base = launch_server(env, data_dir.parent / "server.log", 600, fork=fork)
    docs = [{"id": f"p{i}", "text": t} for i, t in enumerate(passages)]
    r = httpx.post(base + "/v1/documents", json={"documents": docs}, timeout=1200)
    r.raise_for_status()
    return proc, base


def main(argv: list[str] | None = None) -> int:
    from ragkv import DEFAULT_MODEL
    from ragkv.model.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--sizes", default="2,4,6,10", help="passages per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="the service's blend ratio (default: the fidelity gate's point)",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    question, passages = musique_passages(18)
    tok = load_model(args.model).tokenizer
    rows = []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        proc, base = start_service(Path(d) / "data", args.model, args.threads, passages, args.ratio)
        print(f"service up, 18 passages ingested in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            rec = Recorder()
            chain = stuff_chain(chat_openai(base, name, rec, max_tokens=args.max_tokens))
            full_chain = stuff_chain(  # the same messages, prefilled in full
                chat_openai(
                    base, name, rec, max_tokens=args.max_tokens, extra_body={"ragkv": {"mode": "full"}}
                )
            )
            chain.invoke({"context": passages[10], "question": question})  # warm-up (self-check, locator)
            for n in sizes:
                inputs = {"context": "\n\n".join(passages[:n]), "question": question}
                default = chain.invoke(inputs).content
                got = rec.last
                full = full_chain.invoke(inputs).content
                ref = rec.last
                stats = got["ragkv"]["stats"]
                ctx = sum(len(tok.encode(p, add_special_tokens=False)) for p in passages[:n])
                row = {
                    "passages": n,
                    "chars": len(inputs["context"]),
                    "prompt_tokens": got["usage"]["prompt_tokens"],
                    "passage_tokens": ctx,
                    "reused_rows": stats["num_reused_rows"],
                    "reused_share": round(stats["num_reused_rows"] / ctx, 4),
                    "mode": stats["mode"],
                    "ratio": stats["ratio"],
                    "ttft_s": round(got["ragkv"]["timings"]["ttft_s"], 3),
                    "ttft_full_s": round(ref["ragkv"]["timings"]["ttft_s"], 3),
                    "answer": default,
                    "answer_full": full,
                }
                row["speedup"] = round(row["ttft_full_s"] / row["ttft_s"], 2)
                rows.append(row)
                print(
                    f"{n:>2} passages: {row['prompt_tokens']} tokens, {row['reused_rows']}/{ctx} passage tokens "
                    f"reused ({row['reused_share']:.3f}), TTFT {row['ttft_s']:.2f} s vs full "
                    f"{row['ttft_full_s']:.2f} s ({row['speedup']}x); {default!r} / full {full!r}",
                    flush=True,
                )
        finally:
            stop_server(proc, 60)
    print(
        json.dumps(
            {
                "bench": "openai_rag",
                "model": args.model,
                "threads": args.threads,
                "max_tokens": args.max_tokens,
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
