"""The answering side of a RAG: retrieve, build the prompt, answer and stream over a corpus.

Every entry point parses its ``mode``/``ratio``/``fidelity`` keywords once into a
:class:`~ragkv.fidelity.plan.RequestSettings` and builds one :class:`~ragkv.rag.generation.PromptJob`
whose :class:`~ragkv.blend.plan.BlendPlan` is resolved once here (:meth:`Answerer.job`, this side's
settings over its LLM's as defaults: :attr:`Answerer.planner`) and hands it to the generator. It reads the corpus
(:mod:`ragkv.rag.corpus`: index, embedder, locator) and takes its chunk resolver, passed in.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from ragkv.blend.controller import LoadingController
from ragkv.blend.locate import Located, append_chunks
from ragkv.blend.resolver import ChunkResolver
from ragkv.defaults import CHUNK_ORDERS, DEFAULT_CHUNK_ORDER, DEFAULT_MODE, Mode
from ragkv.fidelity.plan import Planner, RequestSettings
from ragkv.generate import SamplingParams, TokenEvent
from ragkv.llm import LLM
from ragkv.prompt import DEFAULT_INSTRUCTION, DEFAULT_QUESTION, prompt_parts
from ragkv.rag.collections import collection_name
from ragkv.rag.corpus import Corpus
from ragkv.rag.generation import Generated, Generator, PromptJob, ThreadGenerator
from ragkv.rag.index import ChunkRecord
from ragkv.rag.splitter import encode_with_offsets

log = logging.getLogger("ragkv.rag")


@dataclass
class RagPrompt:
    """A question's prompt before prefill: token-id head, chunks (in prompt order), token-id tail."""

    prefix: list[int]
    chunks: list[ChunkRecord]
    suffix: list[int]
    seconds: float  # retrieval (and fitting) time


@dataclass
class RagAnswer:
    """An answer with its sources, timings (seconds) and prefill statistics."""

    text: str
    sources: list[ChunkRecord]
    mode: str
    timings: dict
    stats: dict
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids, as prefilled
    token_ids: list[int] = field(default_factory=list)  # the answer's


class Answerer:
    """Retrieve -> prompt -> answer over ``corpus`` with ``llm`` (a view over the corpus's ``resolver``)."""

    def __init__(
        self,
        llm: LLM,
        corpus: Corpus,
        resolver: ChunkResolver,
        top_k: int = 6,
        order: str = DEFAULT_CHUNK_ORDER,
        settings: RequestSettings | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        question_template: str = DEFAULT_QUESTION,
        system: str | None = None,
        examples: Sequence[tuple[str, str]] = (),
        controller: LoadingController | None = None,
        seed: int = 0,
        generator: Generator | None = None,
    ):
        if order not in CHUNK_ORDERS:
            raise ValueError(f"order must be one of {CHUNK_ORDERS}")
        self.llm, self.corpus, self.resolver = llm, corpus, resolver
        self.model = llm.model
        self.top_k, self.order, self.seed = top_k, order, seed
        #: this side's request settings (mode, ratio, fidelity): every request's defaults, over the LLM's
        self.settings = settings or RequestSettings()
        self.instruction, self.question_template = instruction, question_template
        self.system = system
        self.examples = [(str(u), str(a)) for u, a in examples]
        self.controller = controller
        #: what generates once a prompt is built (:mod:`ragkv.rag.generation`): threads by default
        self.generator: Generator = generator or ThreadGenerator()
        self.store, self.index = resolver.store, corpus.index  # what generators and retrieval read

    @property
    def planner(self) -> Planner:
        """Plans this side's requests: its settings over its LLM's (:class:`~ragkv.fidelity.plan.Planner`)."""
        return self.llm.planner.under(self.settings)

    @property
    def mode(self) -> Mode:
        """The prefill mode of a request that names none (this side's, else the LLM's, else the default)."""
        return self.planner.settings.mode or DEFAULT_MODE

    @property
    def ratio(self) -> float | str | None:
        """The recompute ratio of a request that names none (None: the fidelity gate's point)."""
        return self.planner.settings.ratio

    @property
    def fidelity(self) -> str | None:
        """The fidelity setting of a request that names none (None: the gate's default)."""
        return self.planner.settings.fidelity

    # ---- retrieve ------------------------------------------------------------------------------
    def retrieve(
        self, question: str, k: int | None = None, collection: str | None = None
    ) -> list[ChunkRecord]:
        """Top-k chunks of ``collection`` (default: the default collection), ordered by score or (as in
        the paper's evaluation) seeded-randomly."""
        if not question or not question.strip():
            raise ValueError("empty question")
        k = self.top_k if k is None else k
        if k < 1:
            raise ValueError("k must be >= 1")
        coll = collection_name(collection)
        recs = self.index.search(self.corpus.embedder.embed([question])[0], k, coll)
        if self.order == "random":
            rnd = random.Random(f"{self.seed}|{question}")
            rnd.shuffle(recs)
        return recs

    def chunks_by_id(self, chunk_ids: list[int], collection: str | None = None) -> list[ChunkRecord]:
        """The chunks with these ids in ``collection`` (default: the default collection); KeyError for
        an id that is unknown or of another collection (the same error: nothing tells them apart)."""
        coll = collection_name(collection)
        recs = []
        for cid in chunk_ids:
            rec = self.index.chunk(cid, coll)
            if rec is None:
                raise KeyError(f"unknown chunk id {cid}")
            recs.append(rec)
        return recs

    # ---- answer --------------------------------------------------------------------------------
    def answer(self, question: str, *args, **kwargs) -> RagAnswer:
        """:meth:`answer_stream` (the same arguments) to its end: the final :class:`RagAnswer`, with
        timings retrieval, kv_fetch, ttft, total."""
        *_, ans = self.answer_stream(question, *args, **kwargs)
        assert isinstance(ans, RagAnswer)
        return ans

    def prompt_parts(
        self, question: str, conversation: Sequence[tuple[str, str]] | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids of the head (system, instruction, few-shot turns) and tail (question) of a prompt;
        ``conversation``: a chat's turns before the question (:func:`ragkv.prompt.prompt_parts`)."""
        return prompt_parts(
            self.model,
            question,
            self.instruction,
            self.question_template,
            system=self.system,
            examples=self.examples,
            conversation=conversation,
        )

    def prompt(
        self,
        question: str,
        k: int | None = None,
        chunks: list[ChunkRecord] | None = None,
        max_new_tokens: int = 0,
        collection: str | None = None,
        conversation: Sequence[tuple[str, str]] | None = None,
    ) -> RagPrompt:
        """The prompt of ``question``: its token-id head and tail, and the chunks between them.

        Retrieves unless ``chunks`` are given; retrieved chunks are fitted to the context next to the
        head, the tail and ``max_new_tokens`` (lowest scores dropped). Shared by every generation
        backend (in process here, a vLLM server through ``ragkv.remote.client``) so they ask the same thing.
        """
        t0 = time.perf_counter()
        prefix, suffix = self.prompt_parts(question, conversation)
        if chunks is not None:
            recs = list(chunks)
        else:
            recs = self.retrieve(question, k, collection)
            recs = self.fit_chunks(recs, len(prefix) + len(suffix) + max_new_tokens)
            if self.order == "cache":
                recs = cache_order(self.model, self.llm.kv_tree, prefix, recs)
        return RagPrompt(prefix, recs, suffix, time.perf_counter() - t0)

    def answer_stream(
        self,
        question: str,
        k: int | None = None,
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        chunks: list[ChunkRecord] | None = None,
        collection: str | None = None,
        conversation: Sequence[tuple[str, str]] | None = None,
        fidelity: str | float | None = None,
        settings: RequestSettings | None = None,
        **sampling,
    ) -> Iterator:
        """Yield ``TokenEvent``s as they are generated, then the final :class:`RagAnswer`. Retrieval
        and the stored chunks reused from inside the question are ``collection``'s (default: the
        default collection; :meth:`kv_visible`). ``conversation``: a chat's ``(role, text)`` turns
        before the question, kept as turns around the RAG prompt (:meth:`prompt_parts`). ``fidelity``:
        where ``blend`` without a ratio runs (``ragkv.fidelity``; None: this RAG's setting); the point
        used is in ``stats["fidelity"]``. ``settings``: the request's settings as one value (the
        loose keywords win over it)."""
        coll = collection_name(collection)
        params = params or SamplingParams(**sampling)
        t0 = time.perf_counter()
        rp = self.prompt(question, k, chunks, params.max_new_tokens, coll, conversation)
        ids = list(rp.prefix)
        found = append_chunks(ids, ((r.kv_key, r.token_ids) for r in rp.chunks))
        ids += rp.suffix
        request = RequestSettings.parse(settings, mode=mode, ratio=ratio, fidelity=fidelity)
        job = self.job(ids, found, request, params, kv_collection=coll)
        yield from self._answer(job, rp.chunks, t0, rp.seconds)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        collection: str | None = None,
        settings: RequestSettings | None = None,
    ) -> Iterator:
        """Complete ``prompt_ids`` exactly as given (an OpenAI client's rendered messages, parsed at the
        edge into ``settings``): token events, then a :class:`RagAnswer` without sources. In the modes
        that reuse KV the stored chunks found inside the ids are reused (:meth:`job`, ``collection``'s;
        None: any); the ids never change, so ``mode="full"`` prefills the same ids in full."""
        yield from self._stream_parts(prompt_ids, [], [], settings or RequestSettings(), params, collection)

    def stream_parts(
        self,
        prefix: Sequence[int],
        chunks: Sequence[Sequence[int]],
        suffix: Sequence[int],
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        fidelity: str | float | None = None,
        collection: str | None = None,
        settings: RequestSettings | None = None,
    ) -> Iterator:
        """Complete token-id ``prefix + chunks + suffix`` (a framework's prompt): token events, then a
        :class:`RagAnswer` without sources. Chunk KV is found by content; stored chunks inside the
        rest of the prompt are located (transparent reuse of a flat prompt, :meth:`job`; only
        ``collection``'s, None: any)."""
        request = RequestSettings.parse(settings, mode=mode, ratio=ratio, fidelity=fidelity)
        yield from self._stream_parts(prefix, chunks, suffix, request, params, collection)

    def _stream_parts(self, prefix, chunks, suffix, request: RequestSettings, params, collection) -> Iterator:
        """:meth:`stream_parts` of a parsed request."""
        params = params or SamplingParams()
        t0 = time.perf_counter()
        ids = [int(t) for t in prefix]
        found = append_chunks(ids, ((self.resolver.key(c), c) for c in chunks))
        ids += [int(t) for t in suffix]
        job = self.job(ids, found, request, params, kv_collection=collection)
        yield from self._answer(job, [], t0, 0.0)

    def stream_text(
        self,
        prefix: str,
        chunks: Sequence[str],
        question: str,
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        collection: str | None = None,
        fidelity: str | float | None = None,
        settings: RequestSettings | None = None,
    ) -> Iterator:
        """Complete a framework's prompt given as text, ``prefix + chunks + question`` (``chunks``
        may be empty: one flat prompt): token events, then a :class:`RagAnswer` without sources.
        ``collection``: only its stored chunks are found in the text (None: any; :meth:`job`).
        The prefix starts with BOS when the tokenizer adds one; each of ``chunks`` is a chunk whose
        KV is found by content (stored after first use). In modes that reuse KV the stored chunks
        inside ``prefix`` and ``question`` are given as themselves (:meth:`segment_text`), so a flat
        prompt is the same job as the same text with those chunks given explicitly; in other modes
        each part is tokenized as a whole."""
        t0 = time.perf_counter()
        params = params or SamplingParams()
        request = RequestSettings.parse(settings, mode=mode, ratio=ratio, fidelity=fidelity)
        reuse = Mode(request.mode or self.mode).reuses
        m = self.model

        def part(text: str, add_bos: bool) -> tuple[list[int], list[Located]]:
            if reuse:
                return self.segment_text(text, add_bos, collection)
            return m.encode(text, add_bos=add_bos, specials=True), []

        ids, found = part(prefix, True)
        toks = [m.encode(c) for c in chunks]
        found += append_chunks(ids, ((self.resolver.key(t), t) for t in toks))
        tail, inside = part(question, False)
        found += [replace(f, start=f.start + len(ids)) for f in inside]
        ids += tail
        if not chunks and not tail and len(ids) <= 1:
            raise ValueError("empty prompt")
        job = self.job(ids, found, request, params, kv_collection=collection)
        yield from self._answer(job, [], t0, 0.0)

    def segment_text(
        self, text: str, add_bos: bool = False, kv_collection: str | None = None, specials: bool = True
    ) -> tuple[list[int], list[Located]]:
        """``text``'s token ids with the stored chunks inside it given as themselves, and where.

        The locator finds stored chunks in ``text``'s tokens (:meth:`job`); each found chunk whose own
        text covers the rows found there is then given whole, its stored token ids in place of the
        text, and the text around the chunks is tokenized apart, as an explicit caller's prompt is.
        Where the text holds only part of a chunk (a framework trimmed its edge: LlamaIndex strips a
        node's text) the rows found are given, as found. The ids then differ from tokenizing ``text``
        as a whole only at a chunk's edge, where the two could merge differently; a prompt with no
        stored chunk is tokenized as a whole. ``add_bos``: start with BOS when the tokenizer adds one;
        ``kv_collection``: see :meth:`job`. ``specials``: ``text`` is a raw prompt (a framework's rendered
        template), so a special token's text in it is that token; False encodes it as text."""
        m = self.model
        head = m.encode("", add_bos=add_bos)
        flat = m.encode(text, specials=specials)
        found = self.resolver.find(flat, [], self.corpus.kv_visible(kv_collection)) if flat else []
        if not found:
            return head + flat, []
        as_found = head + flat, [replace(f, start=f.start + len(head)) for f in found]
        try:
            same, offsets = encode_with_offsets(m.tokenizer, text, specials)
        except (NotImplementedError, TypeError, ValueError):  # a tokenizer without offsets
            return as_found
        if list(same) != flat:
            return as_found
        chars = [(offsets[f.start][0], offsets[f.stop - 1][1]) for f in found]
        ids, out, pos = list(head), [], 0
        for k, f in enumerate(found):
            a, b = chars[k]
            if a < pos or not _own_chars(offsets, f.start, f.stop, len(flat)):
                return as_found
            recs = self.index.chunks_with_key(f.key)
            whole = recs[0].text if recs else None
            at = text.find(whole, max(pos, a - len(whole))) if whole and whole.strip() else -1
            end = at + len(whole)
            limit = chars[k + 1][0] if k + 1 < len(found) else len(text)
            # the chunk's own text is all there, where the rows were found: it covers them, up to
            # whitespace a token took from beside it (a sentencepiece "▁" holds the space before),
            # and reaches into no other chunk's rows
            if pos <= at and end <= limit and _covers(text, at, end, a, b):
                a, b, lo, hi = at, end, 0, len(f.token_ids)
            else:
                lo, hi = f.lo, f.hi
            ids += m.encode(text[pos:a], specials=specials) if a > pos else []
            out.append(Located(f.key, f.token_ids, len(ids), lo, hi))
            ids += f.token_ids[lo:hi]
            pos = b
        ids += m.encode(text[pos:], specials=specials) if pos < len(text) else []
        return ids, out

    def job(
        self,
        prompt_ids: Sequence[int],
        chunks: Sequence[Located],
        settings: RequestSettings | None = None,
        params: SamplingParams | None = None,
        locate: bool = True,
        kv_collection: str | None = None,
        **options,
    ) -> PromptJob:
        """A checked :class:`PromptJob`, its :class:`BlendPlan` resolved here once from the request's
        ``settings`` (:attr:`planner`: this side's and the LLM's settings fill what they leave unset).

        ``locate``: in modes that reuse KV, stored chunks found in the prompt's rows outside
        ``chunks`` (a document pasted into a question, a framework's own context format) are reused
        too (transparent reuse, :meth:`ChunkResolver.find`); False keeps exactly ``chunks``.
        ``kv_collection``: only that collection's stored chunks are located (:meth:`Corpus.kv_visible`;
        None: any). ``ratio="auto"``: the loading controller chooses it from the prompt's length and
        the rows that come from chunk KV (its decision is in the answer's stats)."""
        plan = self.planner.plan(settings)
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("empty prompt")
        self.model.check_length(len(ids), params.max_new_tokens)
        chunks = list(chunks)
        if locate and plan.reuses:
            chunks = self.resolver.find(ids, chunks, self.corpus.kv_visible(kv_collection))
        decision = None
        if plan.auto and self.controller is not None:
            n_cached = sum(c.hi - c.lo for c in chunks)
            decision = self.controller.choose_ratio(len(ids), n_cached, self._store_name())
            plan = plan.with_ratio(decision.ratio)
        return PromptJob(ids, chunks, plan, params, decision=decision, **options)

    def using(self, generator: Generator) -> Answerer:
        """A copy of this side that generates with ``generator`` (same corpus, resolver and settings)."""
        view = copy.copy(self)
        view.generator = generator
        return view

    def generate(self, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        """Complete ``job`` with this RAG's generator: token events, then one :class:`Generated`."""
        return self.generator.stream(self, job)

    def _answer(self, job: PromptJob, sources: list[ChunkRecord], t0: float, t_retrieval: float) -> Iterator:
        ttft = None
        for item in self.generate(job):
            if isinstance(item, Generated):
                total = time.perf_counter() - t0
                timings = {
                    "retrieval_s": t_retrieval,
                    "kv_fetch_s": item.kv_fetch_s,
                    "ttft_s": ttft if ttft is not None else total,
                    "total_s": total,
                    **item.timings,
                }
                stats = {**item.stats, "kv_hits": item.stats.get("kv_hits", 0), "chunk_order": self.order}
                yield RagAnswer(
                    item.text, sources, item.mode, timings, stats, list(job.prompt_ids), list(item.token_ids)
                )
            else:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield item

    def fit_chunks(self, recs: list[ChunkRecord], other_tokens: int) -> list[ChunkRecord]:
        """Drop the lowest-scored chunks until they fit the context next to ``other_tokens`` (order kept)."""
        budget = self.model.config.max_position - other_tokens
        kept = sorted(recs, key=lambda r: -r.score)
        while kept and sum(len(r.token_ids) for r in kept) > budget:
            dropped = kept.pop()
            log.info(
                "dropping retrieved chunk %d (score %.3f) to fit the context", dropped.chunk_id, dropped.score
            )
        keep_ids = {r.chunk_id for r in kept}
        return [r for r in recs if r.chunk_id in keep_ids]

    def _store_name(self) -> str:
        names = list(self.controller.load_bytes_per_s) if self.controller else []
        desc = self.corpus.store.describe()
        return next((n for n in names if n in desc), names[0] if names else desc)

    @property
    def counters(self) -> dict:
        """Chunk-KV counters of every query path: hits, misses, recomputed after a failed load..."""
        return self.resolver.counters


#: tree lookups one cache-aware ordering may make (the search over orders stops there)
CACHE_ORDER_PEEKS = 256


def cache_order(model, tree, head: Sequence[int], recs: list[ChunkRecord]) -> list[ChunkRecord]:
    """``recs`` reordered so that the KV tree's longest cached path comes first: after ``head``, the chunks
    (in the order the tree holds them) whose tokens make the longest run of cached tokens, then the rest
    in retrieval order. Retrieval order stays unless the path is two chunks or more and caches more than
    retrieval order does itself (with the first level precomputed at ingest every chunk is cached right
    after the head: one chunk is what any order gets). An opt-in operating point
    (``order="cache"``): the prompt changes, so the answer may (``eval.bench_order`` measures how often);
    retrieval order is the default."""
    if tree is None or not recs:
        return recs
    toks = [[int(t) for t in r.token_ids] for r in recs]
    budget = [CACHE_ORDER_PEEKS]  # tree lookups at most: a tree holding many orders costs no more

    def longest(ids: list[int], rest: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        best: tuple[int, tuple[int, ...]] = (0, ())
        for i in rest:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            nxt = ids + toks[i]
            if tree.peek(model, nxt) < len(nxt):
                continue
            n, path = longest(nxt, tuple(j for j in rest if j != i))
            if len(toks[i]) + n > best[0]:
                best = (len(toks[i]) + n, (i, *path))
        return best

    ids = [int(t) for t in head]
    given = 0  # what retrieval order itself has cached: its first chunk at least, with the first level
    for t in toks:
        if tree.peek(model, ids + t) < len(ids) + len(t):
            break
        ids, given = ids + t, given + len(t)
    cached, path = longest([int(t) for t in head], tuple(range(len(recs))))
    if len(path) < 2 or cached <= given:  # nothing gained over retrieval order: keep it
        return recs
    return [recs[i] for i in path] + [r for i, r in enumerate(recs) if i not in path]


def _covers(text: str, at: int, end: int, a: int, b: int) -> bool:
    """Whether characters ``[at, end)`` cover ``[a, b)`` but for whitespace at either end."""
    if at >= b or end <= a:
        return False
    return (at <= a or not text[a:at].strip()) and (end >= b or not text[end:b].strip())


def _own_chars(offsets, start: int, stop: int, n: int) -> bool:
    """Whether tokens ``[start, stop)`` cover characters no token outside them shares (a byte-level
    token holding part of a character shares it with its neighbour)."""
    before = start == 0 or offsets[start - 1][1] <= offsets[start][0]
    after = stop >= n or offsets[stop - 1][1] <= offsets[stop][0]
    return before and after
