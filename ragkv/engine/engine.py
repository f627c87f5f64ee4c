"""The serving engine: submit, step, stream, cancel, metrics (docs/ENGINE.md, "One engine step").

A step (nano-vllm style, prefill first) takes submissions, cancellations and finished fetches, starts
the fetches of requests whose chunk KV needs I/O, admits what fits, and prefills it into paged blocks
(first token from the prefill logits); with nothing to admit it fuses the due BFF group and decodes
every running request in one batch, preempting the newest ones (recomputed later) if blocks run out.
Drive it from your thread (``step``, ``generate``, a handle's stream) or in the background (``start``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ragkv.blend import ChunkResolver, KVTree, prefill
from ragkv.blend.plan import BlendPlan, BlendPlanError
from ragkv.engine.block_manager import OutOfBlocksError
from ragkv.engine.paged_cache import KVPool, PagedSequence, batched_decode_step, block_keys
from ragkv.engine.provider import KVFetcher, as_tokens, normalize_item
from ragkv.engine.request import Request, RequestHandle, RequestOutput, RequestStatus
from ragkv.engine.scheduler import EngineBusyError, Scheduler, SchedulerConfig
from ragkv.fidelity.plan import RequestSettings
from ragkv.fusion.bff import FusionConfig
from ragkv.fusion.paged import BlockFusion
from ragkv.generate import Detokenizer, SamplingParams
from ragkv.llm import LLM
from ragkv.metrics.serving import EngineMetrics
from ragkv.model.forward import decode_weights_of

log = logging.getLogger("ragkv.engine")


@dataclass
class EngineConfig:
    """Engine settings. ``num_blocks`` wins over ``kv_memory_bytes`` (dense block bytes) when given."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int = 256 << 20
    #: every request's defaults (:class:`~ragkv.fidelity.plan.RequestSettings`: mode, ratio, schedule,
    #: fidelity; unset ratio: ``blend`` runs at the fidelity gate's point) and the KV adapter reused
    #: chunk KV is read through (unset: "auto"; see ragkv.LLM's ``adapter``)
    settings: RequestSettings = field(default_factory=RequestSettings)
    attention: str = "fp16"  # "fp16" (dense, model dtype) or "hack" (2-bit, HACK attention)
    #: HackConfig options over HACK's defaults (``hack_cache.DEFAULTS``, partition = block_size)
    hack: dict = field(default_factory=dict)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    share_prefix_blocks: bool = True
    bff: FusionConfig | None = None
    cff: FusionConfig | None = None
    compute_missing: bool = True

    def __post_init__(self):
        if not isinstance(self.settings, RequestSettings):
            raise TypeError("EngineConfig.settings must be a ragkv.RequestSettings")
        if self.attention not in ("fp16", "dense", "hack"):
            raise ValueError(f"unknown attention {self.attention!r}; use 'fp16' or 'hack'")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be >= 1")


class Engine:
    """Continuous-batching RAG engine over paged KV; see the module docstring."""

    def __init__(
        self,
        llm,
        config: EngineConfig | None = None,
        store=None,
        resolver: ChunkResolver | None = None,
        kv_tree: KVTree | None = None,
    ):
        self.config = cfg = config or EngineConfig()
        if not isinstance(llm, LLM):  # a model or its name: served by an LLM of its own over ``store``
            llm = LLM(llm, store=store, settings=cfg.settings, self_check_on_load=False)
        else:  # the config's request settings over the LLM's (its KV adapter stays the LLM's)
            llm = llm.with_settings(cfg.settings)
        if resolver is not None:  # an owner's (a RAG's writes back only what its index holds)
            llm = llm.with_resolver(resolver)
        if kv_tree is not None:  # an owner's (a RAG's: one tree per model for every route)
            llm = llm.with_kv_tree(kv_tree)
        #: the LLM this engine serves: its model, request planner (settings and KV adapter), chunk
        #: resolver and exact KV tree are the engine's (``resolver`` / ``kv_tree``: an owner's instead)
        self.llm = llm
        #: the LLM's (not copies): how a request is planned (settings, KV adapter), where chunk KV comes from
        self.planner, self.resolver, self.kv_tree, self.adapter = (
            llm.planner,
            llm.resolver,
            llm.kv_tree,
            llm.adapter,
        )
        self.model = model = llm.model
        c = model.config
        hack_cfg = None  # the pool's KV backend: dense blocks, or HACK's pages (a byte budget buys more)
        if cfg.attention == "hack":
            from ragkv.attention.hack_seq import HackKV

            hack_cfg = HackKV.engine_config(cfg.hack, c.head_dim, cfg.block_size)
        block = KVPool.block_bytes_for(model, cfg.block_size, hack_cfg)
        num_blocks = cfg.num_blocks or max(1, cfg.kv_memory_bytes // block)
        self.pool = KVPool.for_model(model, num_blocks, cfg.block_size, hack_cfg)
        self.scheduler = Scheduler(cfg.scheduler, self.pool.manager, cfg.block_size, c.num_layers)
        self.fetcher = KVFetcher(self.resolver, cfg.compute_missing)
        #: the block-sharing policy (BFF/CFF; a no-op unless configured) and its stats
        self.fusion = BlockFusion(cfg.bff, cfg.cff)
        self.bff_stats, self.cff_stats = self.fusion.bff_stats, self.fusion.cff_stats
        self._salt = f"{model.fingerprint}|{cfg.attention}"
        self._lock = threading.RLock()  # held by step(): the engine state is single-threaded
        self._inbox_lock = threading.Lock()  # guards what other threads touch: inbox, cancels, fetches, live
        self._inbox: deque[Request] = deque()
        self._cancels: set[str] = set()
        self._fetch_done: deque[tuple[Request, Future, float]] = deque()
        self._live: dict[str, Request] = {}  # submitted and not finished
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._t0: float | None = None
        self._t_last: float | None = None
        counters = (
            "requests_finished requests_cancelled requests_failed prompt_tokens output_tokens preemptions"
        )
        self._counts = dict.fromkeys((*counters.split(), "steps", "prefill_steps", "decode_steps"), 0)
        self._peak_bytes = 0

    # ---- submission ---------------------------------------------------------------------------------
    def _ids(self, part, bos: bool) -> list[int]:
        if isinstance(part, str):
            return self.model.encode(part, add_bos=bos) if part or bos else []
        return [int(t) for t in (part.flatten().tolist() if isinstance(part, torch.Tensor) else part)]

    def make_request(
        self,
        prefix=(),
        chunks=(),
        question=(),
        params: SamplingParams | None = None,
        mode: str | None = None,
        ratio: float | None = None,
        request_id: str | None = None,
        fidelity: str | float | None = None,
        plan: BlendPlan | None = None,
        **sampling,
    ) -> Request:
        """Validate and tokenize a request (strings via the model's tokenizer; BOS starts a text prefix).

        ``plan``: what the prefill runs, resolved by the caller (:class:`~ragkv.blend.plan.BlendPlan`);
        else ``mode``/``ratio``/``fidelity`` (the edge: parsed once into a
        :class:`~ragkv.fidelity.plan.RequestSettings`) are planned here with the config's settings as
        defaults (:attr:`planner`: ``blend`` with no ratio and no config schedule runs at the fidelity
        gate's point; a ratio with the config's gradual schedule is refused, never overridden). The
        point is in the prefill stats."""
        if plan is None:
            plan = self.planner.plan(RequestSettings(mode, ratio, fidelity=fidelity))
        else:
            plan = self.planner.fill(plan)  # the engine's blend options at the plan's ratio
        if plan.auto:
            raise BlendPlanError("ratio 'auto' (the RAG's loading controller) is not served by the engine")
        params = params or SamplingParams(**sampling)
        req = Request(
            self._ids(prefix, bos=isinstance(prefix, str)),
            [normalize_item(self.model.encode(c) if isinstance(c, str) else c) for c in chunks],
            self._ids(question, bos=False),
            params,
            plan,
            request_id,
        )
        n = self._num_tokens(req, req.chunks)
        if n == 0:
            raise ValueError("empty prompt: no prefix, chunks or question")
        if n is not None:
            self._check(req, n)
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a prepared request; raises :class:`EngineBusyError` past ``max_queue`` (nothing queued)."""
        with self._inbox_lock:
            if req.request_id in self._live:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            queued = len(self._inbox) + self.scheduler.num_queued
            if queued >= self.config.scheduler.max_queue:
                raise EngineBusyError(
                    f"engine busy: {queued} requests queued (max_queue="
                    f"{self.config.scheduler.max_queue}); retry later"
                )
            self._live[req.request_id] = req
            req.metrics.arrival = time.perf_counter()
            self._t0 = self._t0 or req.metrics.arrival
            self._inbox.append(req)
        self._wake.set()

    def submit(self, prefix=(), chunks=(), question=(), params=None, **kw) -> RequestHandle:
        """Queue ``prefix + chunks`` (text, token ids, ``ChunkRef`` or ``ChunkKV``) ``+ question``; returns its
        handle. Raises ``EngineBusyError``, ``PromptTooLongError``, ``RequestTooLargeError``, ``UnknownModeError``
        or ``ValueError`` without queueing anything."""
        req = self.make_request(prefix, chunks, question, params, **kw)
        handle = RequestHandle(self, req)
        self.enqueue(req)
        return handle

    def cancel(self, request_id: str) -> bool:
        """Cancel a live request: its stream ends with finish_reason ``cancelled`` and its blocks are freed."""
        with self._inbox_lock:
            if request_id not in self._live:
                return False
            self._cancels.add(request_id)
        self._wake.set()
        if self._lock.acquire(blocking=False):
            try:
                self._apply_cancels()
            finally:
                self._lock.release()
        return True

    # ---- the step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduling iteration; returns whether it did any work (no autograd: every tensor the
        engine keeps across steps is made, and updated in place, in inference mode)."""
        with self._lock:
            self._counts["steps"] += 1
            with self._inbox_lock:
                while self._inbox:
                    self.scheduler.add(self._inbox.popleft())
            self._apply_cancels()
            self._take_fetched()
            fetches = self.scheduler.fetches(self._local) if self.config.scheduler.fetch_aware else []
            for r in fetches:
                self._start_fetch(r)
            self.scheduler.order_waiting(self._cached)
            admitted = self.scheduler.admit(self._local, self._cost, self._shares)
            if admitted:
                self._counts["prefill_steps"] += 1
                for r in admitted:
                    self._prefill(r)
                self._maybe_fuse(transition=False)
            elif self.scheduler.running:
                self._counts["decode_steps"] += 1
                self._maybe_fuse(transition=True)
                self._decode()
            else:
                return bool(fetches)
            self._track_peak()
            return True

    # ---- chunk KV: at hand, or fetched ----------------------------------------------------------------
    def _num_tokens(self, r: Request, items) -> int | None:
        """Prompt rows to prefill (a preempted request's tokens so far included); None if not known yet."""
        toks = [as_tokens(c) for c in items]
        if any(t is None for t in toks):
            return None
        return len(r.prefix) + sum(map(len, toks)) + len(r.question) + len(r.output_ids)

    def _check(self, r: Request, n: int) -> None:
        self.model.check_length(n, r.params.max_new_tokens)
        self.scheduler.check_fits(r, n)

    def _local(self, r: Request) -> bool:
        """Whether ``r``'s chunk KV is at hand (the blocking baseline fetches it now, in the step)."""
        if r.resolved is None:
            got = [self.fetcher.ready_now(c, r.needs_kv) for c in r.chunks]
            if any(g is None for g in got):
                if self.config.scheduler.fetch_aware:
                    return False
                r.metrics.fetch_start = time.perf_counter()
                try:  # a failure is raised again at prefill, which fails the request
                    got = self.fetcher.fetch_all(r.chunks, r.needs_kv)
                    self._check(r, self._num_tokens(r, got))
                except Exception as e:  # noqa: BLE001
                    r.error, got = e, []
                r.metrics.fetch_end = time.perf_counter()
                r.metrics.num_chunks_fetched = len(got)
            r.resolved = got
        return True

    def _start_fetch(self, r: Request) -> None:
        r.metrics.fetch_start = time.perf_counter()

        def done(fut: Future, r=r) -> None:
            with self._inbox_lock:
                self._fetch_done.append((r, fut, time.perf_counter()))
            self._wake.set()

        self.fetcher.submit(r.chunks, r.needs_kv, done)

    def _take_fetched(self) -> None:
        with self._inbox_lock:
            done = list(self._fetch_done)
            self._fetch_done.clear()
        for r, fut, t in done:
            r.metrics.fetch_end = t
            if r.finish_reason is not None:
                continue  # cancelled while fetching
            try:
                r.resolved = fut.result()
                r.metrics.num_chunks_fetched = len(r.resolved)
                self._check(r, self._num_tokens(r, r.resolved))
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                self._fail(r, e)
                continue
            self.scheduler.fetched(r)

    # ---- prefill ------------------------------------------------------------------------------------
    def _keys(self, r: Request, exact: int) -> list[str]:
        """Content keys of the prompt's leading full blocks whose ``exact`` rows depend on the prompt
        head only (all of them unless chunk KV is reused: blended rows are never shared)."""
        if not self.config.share_prefix_blocks:
            return []
        ids = r.prefix + [t for c in r.resolved for t in as_tokens(c)] + r.question + r.output_ids
        return block_keys(ids, self.config.block_size, exact // self.config.block_size, self._salt, exact)

    def _prompt_ids(self, r: Request) -> list[int] | None:
        """The prompt's token ids (None while a chunk's tokens are not known: a store key to fetch)."""
        toks = [as_tokens(c) for c in (r.resolved if r.resolved is not None else r.chunks)]
        if any(t is None for t in toks):
            return None
        return r.prefix + [t for c in toks for t in c] + r.question + r.output_ids

    def _cached(self, r: Request) -> tuple[int, int, tuple]:
        """(tokens the KV tree holds, prompt tokens, the first uncached tokens): the scheduler's order."""
        ids = self._prompt_ids(r)
        if ids is None or getattr(r.plan, "mode", None) != "prefix":  # only exact-prefix requests hit
            return 0, 1, (id(r),)
        m = self.kv_tree.peek(self.model, ids)
        return m, len(ids), (m, tuple(ids[m : m + 32]))

    def _shares(self, a: Request, b: Request) -> bool:
        """Whether ``b`` (an exact-prefix request: the only kind a tree hit speeds up) would reuse what
        ``a`` computes: its uncached part starts as ``a``'s (same cached length, same next 32 tokens)."""
        if getattr(b.plan, "mode", None) != "prefix":
            return False
        kb = self._cached(b)[2]
        return len(kb) > 1 and self._cached(a)[2] == kb

    def _cost(self, r: Request) -> tuple[int, int]:
        """(prompt rows, blocks its prefill takes now: shared prompt-head blocks are not taken)."""
        n = self._num_tokens(r, r.resolved)
        exact = len(r.prefix) if r.needs_kv and r.chunks else n
        shared = sum(map(len, self.pool.shared_blocks(self._keys(r, exact), n)))
        return n, self.scheduler.blocks_needed(n) - shared

    def _prefill(self, r: Request) -> None:
        recompute = r.detok is not None  # recompute: a preempted request comes back
        try:
            if r.error is not None:
                raise r.error
            r.metrics.prefill_start = r.metrics.prefill_start or time.perf_counter()
            res = prefill(
                self.model,
                r.prefix,
                r.resolved,
                r.question + r.output_ids,
                **r.plan.prefill_args(),
                prefix_cache=self.kv_tree,
            )
            n = res.kv.num_tokens
            keys = self._keys(r, n if res.stats.get("num_reused_rows", 0) == 0 else len(r.prefix))
            r.seq = PagedSequence(self.pool)
            while True:
                try:
                    shared = r.seq.load_prompt(res.kv.k, res.kv.v, keys)
                    break
                except OutOfBlocksError:  # sharing the admission counted on went away meanwhile
                    if not self._preempt_newest():
                        raise
            self.scheduler.running.append(r)
            r.status = RequestStatus.RUNNING
            if not recompute:
                r.metrics.prefill_end = time.perf_counter()
                r.metrics.num_prompt_tokens, r.metrics.blocks_shared_at_load = n, shared
                r.on_finish = res.on_finish  # a recompute's prompt holds output so far: not its hook
                r.prefill_stats = {k: v for k, v in res.stats.items() if not isinstance(v, torch.Tensor)}
                r.prefill_stats["decode_weights"] = decode_weights_of(self.model)
                if r.plan.point is not None:
                    r.prefill_stats["fidelity"] = r.plan.stats()
                self._counts["prompt_tokens"] += n
            self.fusion.prefilled(self.pool, r.seq)
            self._accept(r, res.logits)
            if r.finish_reason is None:
                self.fusion.decoding(r.seq)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
            log.warning(
                "request %s failed in prefill: %s: %s", r.request_id, type(e).__name__, e, exc_info=True
            )
            self._fail(r, e)

    # ---- decode and preemption ----------------------------------------------------------------------
    def _accept(self, r: Request, logits: torch.Tensor) -> None:
        """Choose the next token from ``logits`` and emit it, or finish: ``Detokenizer.step``, the step
        of ``generate.stream`` (constraint, sampling, logprobs)."""
        if r.detok is None:
            r.detok = Detokenizer(self.model, r.params)
            if r.detok.done:  # max_new_tokens == 0
                r.emit(r.detok.finish_empty())
                return self._finish(r, "length")
        ev, reason = r.detok.step(logits, r.generator)
        if ev.is_token:
            now = time.perf_counter()
            r.metrics.first_token = r.metrics.first_token or now
            r.metrics.last_token = now
            r.metrics.num_output_tokens += 1
            self._counts["output_tokens"] += 1
        r.emit(ev)  # a token, or the closing event of a stop token (the reason, any held-back text)
        if reason is not None:
            self._finish(r, reason)
        else:
            r.next_token = ev.token_id

    def _preempt_newest(self) -> bool:
        """Give the newest running request's blocks back (recomputed when admitted again); False if none runs."""
        if not self.scheduler.running:
            return False
        r = self.scheduler.running[-1]
        r.seq.release()
        r.seq, r.next_token = None, None
        self.scheduler.preempt(r)
        self._counts["preemptions"] += 1
        return True

    def _decode(self) -> None:
        bs, L, mgr = self.pool.block_size, self.pool.num_layers, self.pool.manager
        while L * sum(r.seq.length == r.seq.num_blocks * bs for r in self.scheduler.running) > mgr.num_free:
            self._preempt_newest()  # the step's new blocks do not fit: the newest requests wait
        reqs = self.scheduler.running
        if not reqs:
            return
        logits = batched_decode_step(self.model, [r.seq for r in reqs], [r.next_token for r in reqs])
        for r, lg in zip(list(reqs), logits, strict=True):
            r.next_token = None
            try:
                self._accept(r, lg)
            except Exception as e:  # noqa: BLE001 - e.g. a constraint's grammar failing: that request only
                log.warning("request %s failed in decode: %s: %s", r.request_id, type(e).__name__, e)
                self._fail(r, e)

    def _maybe_fuse(self, transition: bool) -> None:
        idle = self.scheduler.num_queued == 0 and not self._inbox
        self.fusion.step(self.pool, transition, idle)

    # ---- ending requests ----------------------------------------------------------------------------
    def _finish(self, r: Request, reason: str) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason, r.status, r.next_token = reason, RequestStatus.FINISHED, None
        if r.seq is not None:
            r.seq.release()
        self.scheduler.remove(r)
        r.metrics.finished = self._t_last = time.perf_counter()
        self._counts["requests_" + {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")] += 1
        with self._inbox_lock:
            self._live.pop(r.request_id, None)
        r.emit(r.output())
        r.done.set()
        if r.on_finish is not None and reason in ("stop", "length"):
            # the answer is out: its KV goes to the KV tree so the next chat turn reuses it (the
            # prompt's store pages are written behind, not waited for: other requests share this step)
            try:
                r.on_finish(r.output_ids, wait=False)
            except Exception as e:  # noqa: BLE001 - a cache that fails never fails the answer
                log.warning("could not commit the answer's KV: %s", e)

    def _fail(self, r: Request, exc: BaseException) -> None:
        r.error = exc
        self._finish(r, "error")

    def _apply_cancels(self) -> None:
        with self._inbox_lock:
            reqs = [self._live.get(i) for i in self._cancels]
            self._cancels.clear()
            for r in reqs:  # cancelled before the scheduler saw it
                if r is not None and r in self._inbox:
                    self._inbox.remove(r)
        for r in reqs:
            if r is not None:
                self._finish(r, "cancelled")

    # ---- driving ------------------------------------------------------------------------------------
    def wait_for_work(self, timeout: float) -> None:
        """Sleep until a submission, cancellation or finished fetch arrives (or ``timeout``)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def has_unfinished(self) -> bool:
        with self._inbox_lock:
            return bool(self._live)

    def run_until_idle(self, timeout: float | None = None) -> None:
        """Step until no request is live (waits for background fetches)."""
        end = None if timeout is None else time.perf_counter() + timeout
        while self.has_unfinished():
            if end is not None and time.perf_counter() > end:
                raise TimeoutError("engine did not become idle in time")
            if self.background_running:
                time.sleep(0.005)
            elif not self.step():
                self.wait_for_work(0.005)

    def generate(self, requests: list[dict], timeout: float | None = None) -> list[RequestOutput]:
        """Submit ``requests`` (each a dict of :meth:`submit` arguments), run them all, return outputs in order."""
        handles = [self.submit(**kw) for kw in requests]
        self.run_until_idle(timeout)
        return [h.request.output() for h in handles]

    @property
    def background_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run steps in a background thread until :meth:`shutdown`."""
        if self.background_running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="ragkv-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.step()
            except Exception:  # noqa: BLE001 - keep serving; the failure is logged
                log.exception("engine step failed")
                worked = False
            if not worked:
                self.wait_for_work(0.02)

    def shutdown(self, cancel: bool = True) -> None:
        """Stop the background loop (cancelling live requests) and the fetcher."""
        if cancel:
            for rid in list(self._live):
                self.cancel(rid)
            with self._lock:
                self._apply_cancels()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.fetcher.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- metrics ------------------------------------------------------------------------------------
    def kv_bytes_used(self) -> int:
        """Bytes of KV held now: used blocks (dense blocks, or HACK pages) + HACK's fp16 staging in use."""
        pool = self.pool
        return pool.manager.num_used * pool.block_bytes + pool.backend.staging_bytes_in_use()

    def kv_physical_bytes(self) -> int:
        """Bytes the KV storage occupies physically (every block, and HACK's staging capacity)."""
        return self.pool.nbytes()

    def _track_peak(self) -> None:
        """Peak KV bytes: exact for dense blocks (the allocator's peak); sampled at step ends for HACK."""
        if not self.pool.backend.staged:
            self._peak_bytes = self.pool.manager.peak_used * self.pool.block_bytes
        else:
            self._peak_bytes = max(self._peak_bytes, self.kv_bytes_used())

    def references(self) -> dict[int, int]:
        """Live block references of all running sequences (for accounting checks)."""
        refs: dict[int, int] = {}
        for r in self.scheduler.running:
            for b, n in r.seq.references().items():
                refs[b] = refs.get(b, 0) + n
        return refs

    def metrics(self) -> EngineMetrics:
        with self._lock:
            now, c, mgr, sch = time.perf_counter(), self._counts, self.pool.manager, self.scheduler
            span = ((self._t_last or now) - self._t0) if self._t0 is not None else 0.0
            logical = sum(r.seq.table.numel() for r in sch.running)
            return EngineMetrics(
                uptime_s=span,
                **c,
                output_tokens_per_s=c["output_tokens"] / span if span > 0 else 0.0,
                requests_per_s=c["requests_finished"] / span if span > 0 else 0.0,
                waiting=len(sch.waiting) + len(self._inbox),
                waiting_for_kv=len(sch.waiting_for_kv),
                ready=len(sch.ready),
                running=len(sch.running),
                kv_blocks_total=mgr.num_blocks,
                kv_blocks_used=mgr.num_used,
                kv_blocks_peak=mgr.peak_used,
                kv_bytes_used=self.kv_bytes_used(),
                kv_bytes_peak=self._peak_bytes,
                compression_ratio=logical / mgr.num_used if mgr.num_used else 1.0,
                bff=self.bff_stats.as_dict(),
                cff=self.cff_stats.as_dict(),
            )
