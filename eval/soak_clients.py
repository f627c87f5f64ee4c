"""The soak's clients: threads that ingest and delete documents, ask ``/v1/query``, chat (single and
multi-turn, streamed and not) and complete, each request and response written to the history (JSONL)
with its timestamps, status and the served prompt's and answer's token ids where the route returns them.

Each client owns a disjoint share of the document ids, so what it was told about a document (the
:class:`Ledger`) is the document's true state whenever no request on it is in flight.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

#: a request's operation and its weight in the mix
MIX = {
    "ingest": 10,
    "delete": 5,
    "query": 12,
    "query_blend": 5,
    "chat": 14,
    "chat_rag": 10,
    "chat_multi": 10,
    "chat_stream": 12,
    "completion": 8,
    "completion_stream": 8,
}


class History:
    """The run's JSONL history: one line per request, written as responses arrive."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.file = path.open("w")
        self.lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def write(self, rec: dict) -> None:
        with self.lock:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass
class DocState:
    """What a document's owner was last told: ``present`` (ingest acknowledged), ``absent`` (deleted,
    never ingested, or an ingest refused whole) or ``unknown`` (a request with no answer)."""

    state: str = "absent"
    #: (start, end) of spans it was known absent: from a delete's acknowledgement to the next ingest
    absent_spans: list = field(default_factory=list)
    absent_since: float | None = 0.0


class Ledger:
    """Every document's :class:`DocState` (each written only by its owning client)."""

    def __init__(self, docs: dict[str, dict]) -> None:
        self.docs = docs
        self.state = {d: DocState() for d in docs}

    def begin_ingest(self, doc: str, t: float) -> None:
        s = self.state[doc]
        if s.absent_since is not None:
            s.absent_spans.append((s.absent_since, t))
            s.absent_since = None

    def end(self, doc: str, state: str, t: float) -> None:
        """The answer to a write on ``doc`` came at ``t``: it is ``state`` from then on."""
        s = self.state[doc]
        s.state = state
        if state == "absent" and s.absent_since is None:
            s.absent_since = t

    def close(self, t: float) -> None:
        for s in self.state.values():
            if s.absent_since is not None:
                s.absent_spans.append((s.absent_since, t))
                s.absent_since = None

    def absent_throughout(self, doc: str, t0: float, t1: float) -> bool:
        """Whether ``doc`` was known absent for the whole of ``[t0, t1]`` (no ingest of it began)."""
        s = self.state.get(doc)
        return s is not None and any(a <= t0 and t1 <= b for a, b in s.absent_spans)


class Client(threading.Thread):
    """One client: requests drawn from :data:`MIX` with its own seeded generator until ``stop`` is set."""

    def __init__(
        self,
        n: int,
        seed: int,
        service,
        ledger: Ledger,
        own: list[str],
        questions: list[str],
        history: History,
        stop: threading.Event,
        max_tokens: int,
        deadline_s: float,
    ) -> None:
        super().__init__(name=f"soak-client-{n}", daemon=True)
        self.n, self.rng, self.service, self.ledger = n, random.Random(seed), service, ledger
        self.own, self.questions, self.history, self.stop = own, questions, history, stop
        self.max_tokens, self.deadline_s = max_tokens, deadline_s
        self.http = httpx.Client(timeout=httpx.Timeout(deadline_s, connect=5.0))

    def run(self) -> None:
        ops, weights = zip(*MIX.items(), strict=True)
        while not self.stop.is_set():
            op = self.rng.choices(ops, weights)[0]
            try:
                getattr(self, op)(op)
            except Exception as e:  # noqa: BLE001 - a client bug is recorded, not fatal to the run
                self.history.write({"client": self.n, "op": op, "t0": self.history.now(), "bug": repr(e)})

    # ---- one request -------------------------------------------------------------------------------
    def request(
        self, op: str, method: str, path: str, body: dict | None, stream: bool = False, **extra
    ) -> dict:
        """Send one request; its history record (written) with the response's JSON (``json``, not
        written) or the SSE events (``events``)."""
        rec: dict = {
            "client": self.n,
            "op": op,
            "path": path,
            "stream": stream,
            "t0": self.history.now(),
            **extra,
        }
        try:
            if stream:
                self._stream(rec, method, path, body)
            else:
                r = self.http.request(method, self.service.base + path, json=body)
                rec["status"] = r.status_code
                try:
                    rec["json"] = r.json()
                except ValueError:
                    rec["body"] = r.text[:500]
        except httpx.TimeoutException as e:
            rec["transport"] = f"timeout: {type(e).__name__}"
        except httpx.HTTPError as e:
            rec["transport"] = type(e).__name__
        rec["t1"] = self.history.now()
        self._summarise(rec)
        self.history.write({k: v for k, v in rec.items() if k not in ("json", "events")})
        if "transport" in rec and not rec["transport"].startswith("timeout"):
            time.sleep(0.5)  # the service is down: do not spin
        return rec

    def _stream(self, rec: dict, method: str, path: str, body: dict) -> None:
        events = rec["events"] = []
        with self.http.stream(method, self.service.base + path, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                try:
                    rec["json"] = r.json()
                except ValueError:
                    rec["body"] = r.text[:500]
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    rec["done"] = True
                    break
                ev = json.loads(data)
                if "ttft" not in rec and _has_text(ev):
                    rec["ttft"] = round(self.history.now() - rec["t0"], 4)
                events.append(ev)

    def _summarise(self, rec: dict) -> None:
        """The served ids, answer and sources of a response (kept), its error object (kept)."""
        j = rec.get("json")
        if isinstance(j, dict) and "error" in j:
            rec["error"] = j["error"]
        elif isinstance(j, dict) and rec.get("status") == 200:
            if "choices" in j:  # OpenAI chat or completion
                c = j["choices"][0]
                rec["token_ids"] = c.get("token_ids")
                rec["prompt_ids"] = j.get("prompt_token_ids") or c.get("prompt_token_ids")
                rec["text"] = c["message"]["content"] if "message" in c else c.get("text")
                _extra(rec, j.get("ragkv"))
            elif "answer" in j:
                rec["text"] = j["answer"]
                rec["sources"] = sorted({s["doc_id"] for s in j["sources"]})
                rec["mode"] = j.get("mode")
        for ev in rec.get("events", ()):
            if "error" in ev:
                rec["error"] = ev["error"]
                continue
            rec.setdefault("token_ids", [])
            for c in ev.get("choices", ()):
                rec["token_ids"] += c.get("token_ids") or []
                if c.get("prompt_token_ids"):  # a streamed completion's last chunk
                    rec["prompt_ids"] = c["prompt_token_ids"]
                piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                rec["text"] = rec.get("text", "") + (piece or "")
            if "prompt_token_ids" in ev:
                rec["prompt_ids"] = ev["prompt_token_ids"]
            if "ragkv" in ev:
                _extra(rec, ev["ragkv"])
        if "ttft" not in rec and rec.get("status") == 200 and "events" not in rec:
            rec["ttft"] = round(rec["t1"] - rec["t0"], 4)  # not streamed: the whole answer

    # ---- the operations ----------------------------------------------------------------------------
    def ingest(self, op: str) -> None:
        doc = self.rng.choice(self.own)
        before = self.ledger.state[doc].state
        self.ledger.begin_ingest(doc, self.history.now())
        d = self.ledger.docs[doc]
        rec = self.request(op, "POST", "/v1/documents", {"documents": [d]}, doc=doc)
        self.ledger.end(doc, _outcome(rec, "present", before), rec["t1"])

    def delete(self, op: str) -> None:
        known = [d for d in self.own if self.ledger.state[d].state != "absent"]
        if not known:
            return self.ingest("ingest")
        doc = self.rng.choice(known)
        before = self.ledger.state[doc].state
        rec = self.request(op, "DELETE", f"/v1/documents/{doc}", None, doc=doc)
        state = "absent" if rec.get("status") == 404 else _outcome(rec, "absent", before)
        self.ledger.end(doc, state, rec["t1"])

    def _question(self) -> str:
        return self.rng.choice(self.questions)

    def query(self, op: str) -> None:
        body = {"question": self._question(), "max_tokens": self.max_tokens}
        if op == "query_blend":
            body |= {"mode": "blend", "ratio": 0.12}
        self.request(op, "POST", "/v1/query", body)

    query_blend = query

    def _chat(self, op: str, messages: list[dict], stream: bool = False, rag: bool = False) -> dict:
        body = {
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": stream,
        }
        if rag:
            body["ragkv"] = {"retrieve": True}
        return self.request(op, "POST", "/v1/chat/completions", body, stream, max_tokens=self.max_tokens)

    def chat(self, op: str) -> None:
        self._chat(op, [{"role": "user", "content": self._question()}])

    def chat_rag(self, op: str) -> None:
        self._chat(op, [{"role": "user", "content": self._question()}], rag=self.rng.random() < 0.5)

    def chat_stream(self, op: str) -> None:
        self._chat(
            op, [{"role": "user", "content": self._question()}], stream=True, rag=self.rng.random() < 0.5
        )

    def chat_multi(self, op: str) -> None:
        messages = [{"role": "user", "content": self._question()}]
        for _turn in range(self.rng.randint(2, 3)):
            rec = self._chat(op, messages, stream=self.rng.random() < 0.3)
            if rec.get("status") != 200 or "error" in rec:
                return
            messages += [
                {"role": "assistant", "content": rec.get("text") or ""},
                {"role": "user", "content": self._question()},
            ]

    def completion(self, op: str, stream: bool = False) -> None:
        doc = self.ledger.docs[self.rng.choice(sorted(self.ledger.docs))]
        prompt = f"{doc['text'][:300]}\nQuestion: {self._question()}\nAnswer:"
        body = {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": stream,
        }
        self.request(op, "POST", "/v1/completions", body, stream, max_tokens=self.max_tokens, prompt=prompt)

    def completion_stream(self, op: str) -> None:
        self.completion(op, stream=True)


def _extra(rec: dict, info: dict | None) -> None:
    """The prefill mode and the sources from an OpenAI response's ``ragkv`` field (a completion's: its
    statistics; a chat's: sources, timings and statistics)."""
    info = info or {}
    rec["mode"] = info.get("mode") or (info.get("stats") or {}).get("mode")
    if info.get("sources"):
        rec["sources"] = sorted({s["doc_id"] for s in info["sources"]})


def _outcome(rec: dict, done: str, before: str) -> str:
    """A document's state after a write: ``done`` when acknowledged; as ``before`` when refused whole
    (429 busy or quota, 507 disk full: nothing committed; 4xx; no connection); ``unknown`` when no answer came or
    the answer may follow a partial attempt (5xx but 507)."""
    status = rec.get("status")
    if status == 200:
        return done
    if status is not None and (400 <= status < 500 or status == 507):
        return before
    if rec.get("transport") == "ConnectError":  # refused at connect: nothing was sent
        return before
    return "unknown"


def _has_text(ev: dict) -> bool:
    for c in ev.get("choices", ()):
        if (c.get("delta") or {}).get("content") or c.get("text") or c.get("token_ids"):
            return True
    return False
