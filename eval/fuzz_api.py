"""schemathesis with every check against the live service: 0 failures other than deliberate rejections.

Starts ``python -m ragkv_server.server`` on a free loopback port (stories260k, small limits so every request
is cheap), ingests a few documents, then runs ``schemathesis run URL/openapi.json --checks all``
(examples, coverage, fuzzing and stateful phases; ``--max-examples`` per operation, a fixed seed).
``--keys`` configures a write key and a read key (every endpoint but ``/healthz`` then needs a key
and declares its security scheme, and ``ignored_auth`` checks that each refuses a
request without a valid key); the run itself sends the write key. Each failure schemathesis reports
is matched against :data:`DELIBERATE`, the rejections the service makes on purpose (docs/API.md);
anything else is unexpected. Prints the failures by kind; ends with one JSON line.

    python -m eval.fuzz_api                      # no keys
    python -m eval.fuzz_api --keys               # API keys configured
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from eval.bench_api import start_server
from eval.faults import make_docs
from eval.harness import stop_server
from eval.prompts import TINY_MODEL

W_KEY = "fuzz-write-key-0123456789"
R_KEY = "fuzz-read-key-0123456789"
#: the server's limits: small, and a question, prompt or answer that passes them fits the model's
#: 512 positions (so a schema-valid request is not refused for its context)
LIMITS = {
    "RAGKV_TORCH_THREADS": "1",
    "RAGKV_CHUNK_TOKENS": "64",
    "RAGKV_TOP_K": "3",
    "RAGKV_MAX_NEW_TOKENS": "8",
    "RAGKV_MAX_NEW_TOKENS_LIMIT": "48",
    "RAGKV_MAX_QUEUE": "34",
    "RAGKV_MAX_BODY_BYTES": str(64 << 10),
    "RAGKV_MAX_UPLOAD_BYTES": str(256 << 10),
    "RAGKV_MAX_DOCUMENTS": "4",
    "RAGKV_MAX_DOCUMENT_CHARS": "1500",
    "RAGKV_MAX_QUESTION_CHARS": "120",
    "RAGKV_MAX_CHUNK_IDS": "4",
    "RAGKV_MAX_MESSAGES": "4",
    "RAGKV_MAX_PROMPT_CHARS": "200",
    "RAGKV_MAX_PROMPT_TOKENS": "200",
    "RAGKV_LOG_LEVEL": "warning",
}

#: (name, check code, status, regex on the response body): rejections made on purpose
DELIBERATE = [
    # strict types (issue 16): an integer field refuses 2.0; JSON Schema counts 2.0 as an integer
    ("integral float for an integer", "ST202", 422, r"Input should be a valid integer"),
    # semantic rules a JSON Schema does not state
    ("whitespace-only text", "ST202", 422, r"must contain non-whitespace text"),
    ("token id outside the vocabulary", "ST202", 400, r"outside the vocabulary"),
    ("malformed kv_transfer_params", "ST202", 400, r"kv_transfer_params"),
    ("unknown chunk or document id", "ST202", 404, r"unknown"),
    # the model's context: prompt + max_tokens over its positions
    ("prompt + max_tokens over the context", "ST202", 413, r"context|longer than|too long"),
    # the OpenAI routes answer the same rejections as OpenAI does: 400 (context: context_length_exceeded)
    ("integral float for an integer (OpenAI routes)", "ST202", 400, r"Input should be a valid integer"),
    # a chat with retrieval needs a question: its last message a user message with text
    ("RAG chat without a question (OpenAI routes)", "ST202", 400, r"last message must be a user message"),
    # ragkv options that would be ignored are refused (top_k without retrieval, chunk_ids and retrieve)
    ("ragkv option without retrieval (OpenAI routes)", "ST202", 400, r"applies to retrieval|not both"),
    # the model's chat template refuses a conversation (roles that do not alternate ...)
    ("chat template refusal (OpenAI routes)", "ST202", 400, r"chat template refused"),
    ("a model id not served (OpenAI routes)", "ST202", 404, r"model_not_found"),
    ("prompt + max_tokens over the context (OpenAI routes)", "ST202", 400, r"context_length_exceeded"),
    # OpenAI parameters this server does not serve are refused by name, never ignored (docs/API.md)
    ("unsupported OpenAI parameter", "ST202", 400, r'"code": "unsupported_parameter"'),
    # a parameter that only means something beside another (as OpenAI refuses them)
    (
        "a parameter without the one it needs",
        "ST202",
        400,
        r"(tool_choice needs tools|top_logprobs needs logprobs)",
    ),
    # a POST not declared JSON is refused (415) before it is read, a bodyless one included: a web page
    # cannot make a local keyless service act (CSRF guard, docs/API.md); /v1/admin/gc takes no body
    ("POST without a JSON content type", "ST202", 415, r"unsupported content type"),
    # a body over max_body_bytes is refused (413) before it is parsed, valid or not
    ("body over max_body_bytes", "ST201", 413, r"request body larger than"),
    ("body over max_body_bytes", "ST202", 413, r"request body larger than"),
]

_OP = re.compile(r"^_{3,} (\w+ \S+) _{3,}$")
_CHECK = re.compile(r"^- (ST\d+|[A-Z]\w+) (.+)$")
_STATUS = re.compile(r"^\[(\d{3})\] ")


def schemathesis_cli() -> str:
    """The schemathesis CLI of this interpreter's environment (a venv not activated), else from PATH."""
    beside = Path(sys.executable).with_name("schemathesis")
    return str(beside) if beside.exists() else shutil.which("schemathesis") or "schemathesis"


def parse_failures(text: str) -> list[dict]:
    """The failures of a schemathesis CLI report: operation, check code and title, status, body."""
    out: list[dict] = []
    op = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := _OP.match(line.strip()):
            op = m.group(1)
        elif (m := _CHECK.match(line.strip())) and op:
            out.append({"operation": op, "code": m.group(1), "title": m.group(2), "status": None, "body": ""})
        elif (m := _STATUS.match(line.strip())) and out and out[-1]["status"] is None:
            out[-1]["status"] = int(m.group(1))
            body = next((x.strip() for x in lines[i + 1 : i + 4] if x.strip()), "")
            out[-1]["body"] = body[:400]
    return out


def classify(f: dict) -> str | None:
    """The name of the deliberate rejection ``f`` is, or None."""
    for name, code, status, pattern in DELIBERATE:
        if f["code"] == code and f["status"] == status and re.search(pattern, f["body"]):
            return name
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m eval.fuzz_api", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", action="store_true", help="configure API keys (reads need a key too)")
    ap.add_argument("--max-examples", type=int, default=25, help="cases per operation and phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    ap.add_argument("--model", default=str(TINY_MODEL))
    ap.add_argument("--keep", action="store_true", help="keep the work directory (server log, report)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ragkv-fuzz-"))
    server_args = SimpleNamespace(
        model=args.model,
        top_k=3,
        max_tokens=8,
        server_workers=2,
        clients=1,
        generation="threads",
        torch_threads=1,
        chunk_tokens=64,
    )
    env = dict(LIMITS)
    headers = {}
    if args.keys:
        env |= {
            "RAGKV_API_KEYS": W_KEY,
            "RAGKV_READ_API_KEYS": R_KEY,
            "RAGKV_REQUIRE_KEY_FOR_READS": "true",
        }
        headers = {"Authorization": f"Bearer {W_KEY}"}
    proc = None
    t0 = time.perf_counter()
    try:
        proc, base, log_path = start_server(server_args, tmp / "data", env)
        docs = [{"id": d["id"], "text": d["text"][:1500]} for d in make_docs(8, seed=3)]
        for i in range(0, len(docs), 4):
            r = httpx.post(
                base + "/v1/documents", json={"documents": docs[i : i + 4]}, headers=headers, timeout=300
            )
            r.raise_for_status()
        cmd = [
            schemathesis_cli(),
            "run",
            base + "/openapi.json",
            "--checks",
            "all",
            "--phases",
            args.phases,
            "--max-examples",
            str(args.max_examples),
            "--seed",
            str(args.seed),
            "--workers",
            "1",
            "--request-timeout",
            "120",
            "--no-color",
            "--output-sanitize",
            "false",
            "--report",
            "json",
            "--report-dir",
            str(tmp / "report"),
        ]
        for k, v in headers.items():
            cmd += ["-H", f"{k}: {v}"]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=3600)
        (tmp / "schemathesis.txt").write_text(run.stdout + run.stderr)
        server_log = log_path.read_text()
    finally:
        if proc is not None:
            stop_server(proc)
    report = json.loads(next((tmp / "report").glob("json-*.json")).read_text())
    failures = parse_failures(run.stdout)
    kinds: dict[str, int] = {}
    unexpected = []
    for f in failures:
        name = classify(f)
        if name is None:
            unexpected.append(f)
        else:
            kinds[name] = kinds.get(name, 0) + 1
    for f in failures:
        tag = classify(f) or "UNEXPECTED"
        print(f"{f['operation']:32s} {f['code']} [{f['status']}] {tag}: {f['body'][:160]}")
    res = {
        "keys": args.keys,
        "cases": report["test_cases"]["generated"],
        "operations": report["operations"]["tested"],
        "phases": {k: v["status"] for k, v in report["phases"].items()},
        "max_examples": args.max_examples,
        "seed": args.seed,
        "failures": len(failures),
        "reported_failures": sum(f["count"] for f in report["failures"]),
        "errors": len(report["errors"]),
        "deliberate": kinds,
        "unexpected": len(unexpected),
        "server_5xx_logged": server_log.count("error serving"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(
        f"{res['cases']} cases over {res['operations']} operations (keys: {args.keys}): {res['failures']} failures, "
        f"{res['unexpected']} unexpected, {res['errors']} errors"
    )
    print(json.dumps(res))
    if args.keep:
        print(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
