"""Train a KV adapter by KL to full prefill: ``ragkv adapter train``.

* **Teacher**: the model's own float32 full prefill of the same token ids the student sees (each
  passage tokenized on its own), its greedy answer (teacher-forced rows), and per loss row the top-k
  logits and the log-sum-exp, stored once per (model, data) in ``<out>.teacher.pt``.
* **Student**: the same prompt with the instruction head exact (as the prefix cache serves it),
  every passage's chunk KV reused, the question and the teacher's answer computed on the one layer
  loop (:func:`ragkv.model.forward.run_layers` with a :class:`~ragkv.blend.core.BlendKV`). Two kinds:
  ``kv`` (W-kv, :mod:`ragkv.adapter.kv_adapter`): stored chunk KV read through the adapter, gradients
  through the reader rows only; ``writer`` (W-full, :mod:`ragkv.adapter.writer`): chunk KV written by
  the model with a LoRA on, gradients through the reader rows and the whole writer pass. With
  ``blend_ratios`` the student runs the serving blend (the default schedule) at those ratios in turn
  instead of plain reuse: blend in the loop. A third kind, ``link`` (L, :mod:`ragkv.adapter.links`):
  learned link rows after each reused chunk, computed in context; only their embeddings learn.
* **Loss**: forward KL(teacher || student) over the top-k plus one bucket for the rest of the
  vocabulary, on the last prompt row (weight ``FIRST_WEIGHT``) and every answer row.

Resumable (``<out>.ckpt.pt`` every ``save_every`` steps), deterministic for a seed, a progress bar
with time left, one JSON line at the end (the CLI prints it).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.adapter.data import Item, training_set
from ragkv.adapter.kv_adapter import KVAdapter
from ragkv.adapter.links import LinkedModel, LinkRows
from ragkv.adapter.writer import WriterLoRA
from ragkv.blend.core import COMPUTED, EXACT, REUSED, BlendKV, BlendSchedule, qpass_rows
from ragkv.blend.prefill import prefill
from ragkv.generate import decode_step, load_prompt, make_cache
from ragkv.model.forward import compute_chunk_kv, run_layers
from ragkv.prompt import prompt_parts

TOPK = 64
FIRST_WEIGHT = 3.0
MAX_ANSWER = 16


KINDS = ("kv", "writer", "link")

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    kind: str = "kv"  # "kv": W-kv (reads stored KV); "writer": W-full (writes chunk KV); "link": L
    num_links: int = 8  # link only: rows after each chunk
    rank: int = 16
    alpha: float = 16.0  # writer only: LoRA scale alpha / rank
    steps_per_epoch: int | None = None  # None: every item once per epoch
    epochs: int = 3
    lr: float = 2e-3
    weight_decay: float = 0.0
    batch: int = 4
    seed: int = 0
    n_facts: int = 160
    n_real: int = 40
    n_continue: int = 30
    save_every: int = 20
    #: blend in the loop: the student runs the default schedule at one of these ratios (taken in
    #: turn, per example and step; 0 = plain reuse) instead of always reusing. Empty: reuse only
    blend_ratios: tuple[float, ...] = ()

    def schedule(self, turn: int) -> BlendSchedule | None:
        """The student's blend for the ``turn``-th example it sees (None: plain reuse)."""
        if not self.blend_ratios:
            return None
        ratio = float(self.blend_ratios[turn % len(self.blend_ratios)])
        return BlendSchedule(ratios=(ratio,)) if ratio > 0 else None


@dataclass
class Example:
    """A prompt's token ids and its teacher's targets (``rows`` = last prompt row + answer rows)."""

    prefix: list[int]
    chunks: list[list[int]]
    suffix: list[int]
    answer: list[int]  # teacher's greedy tokens (EOS included when it stopped)
    top_ids: torch.Tensor  # [rows, TOPK]
    top_logp: torch.Tensor  # [rows, TOPK] teacher log-probs
    kind: str = ""


def item_ids(model, item: Item) -> tuple[list[int], list[list[int]], list[int]]:
    """``(prefix, chunks, suffix)`` token ids of an item, as ragkv prompts it."""
    chunks = [model.encode(p) for p in item.passages]
    if item.question is None:  # continuation: BOS, the passages, the start of one more
        bos = model.config.bos_token_id
        return ([bos] if bos is not None else []), chunks, model.encode(" " + item.suffix_text)
    prefix, suffix = prompt_parts(model, item.question)
    return prefix, chunks, suffix


@torch.inference_mode()
def teacher_example(model, item: Item, max_new: int = MAX_ANSWER) -> Example:
    """Float32 full prefill and greedy answer of ``item``; the top-k log-probs of every loss row."""
    prefix, chunks, suffix = item_ids(model, item)
    res = prefill(model, prefix, chunks, suffix, "full")
    n = res.kv.num_tokens
    cache = make_cache(model, capacity=n + max_new + 1)
    load_prompt(cache, res)
    eos = set(model.config.eos_token_ids)
    logits, rows, answer = res.logits, [], []
    for i in range(max_new):
        logp = torch.log_softmax(logits.float(), -1)
        rows.append(logp)
        tok = int(logp.argmax())
        answer.append(tok)
        if tok in eos or i == max_new - 1:
            break
        logits = decode_step(model, cache, tok, n + i)
    lp = torch.stack(rows)
    top = lp.topk(TOPK, dim=-1)
    return Example(prefix, chunks, suffix, answer, top.indices, top.values.half(), item.kind)


def _plain(ex: Example) -> Example:
    """The example with ordinary tensors (inference-mode tensors cannot enter autograd)."""
    ex.top_ids, ex.top_logp = ex.top_ids.clone(), ex.top_logp.clone()
    return ex


class _Stored:
    """The student's stored rows: the exact head, then each chunk's KV (``(k, v) [L, n, Hkv, D]`` pairs),
    read through a KV adapter when one is given."""

    def __init__(
        self, head: tuple[torch.Tensor, torch.Tensor], chunks: list, adapter: KVAdapter | None, dtype
    ):
        self.head, self.chunks, self.adapter, self.dtype = head, chunks, adapter, dtype
        self.pieces = [_Len(head[0].shape[1])] + [_Len(k.shape[1]) for k, _ in chunks]

    def layer(self, layer: int):
        ks, vs = [self.head[0][layer]], [self.head[1][layer]]
        for ck, cv in self.chunks:
            k, v = ck[layer].to(self.dtype), cv[layer].to(self.dtype)
            if self.adapter is not None:
                k, v = self.adapter.correct(layer, k, v)
            ks.append(k)
            vs.append(v)
        return torch.cat(ks), torch.cat(vs)

    def close(self) -> None:
        pass


@dataclass
class _Len:
    num_tokens: int


def student_logp(
    model,
    adapter: KVAdapter | None,
    ex: Example,
    head,
    chunk_kvs: list,
    schedule: BlendSchedule | None = None,
    links: LinkRows | None = None,
) -> torch.Tensor:
    """Log-probs ``[rows, vocab]`` of the student (reuse of ``chunk_kvs``, ``(k, v)`` pairs, read through
    ``adapter`` when given) on the loss rows. With a ``schedule`` (blend in the loop) the serving blend
    runs instead: the question pass picks the reused rows to recompute (no gradient: a discrete choice,
    as served), then those rows, the question and the answer go through every layer with the chunk
    offsets, the gradient reaching the adapter through all of them. With ``links`` their rows follow
    every chunk, computed (the gradient reaching their embeddings)."""
    ids, classes = list(ex.prefix), [EXACT] * len(ex.prefix)
    for c in ex.chunks:
        ids += c
        classes += [REUSED] * len(c)
        if links is not None:
            ids += links.ids
            classes += [COMPUTED] * len(links.ids)
    ids += ex.suffix + ex.answer[:-1]
    n = len(ids)
    rc = torch.full((n,), COMPUTED, dtype=torch.long)
    rc[: len(classes)] = torch.tensor(classes, dtype=torch.long)
    stored_rows = (rc != COMPUTED).nonzero().flatten()
    if links is not None:
        model = LinkedModel(model, links)
    src = _Stored(head, chunk_kvs, adapter, model.dtype)
    token_ids = torch.tensor(ids, device=model.device)
    if schedule is not None and schedule.selector != "qpass":
        raise ValueError("blend in the loop trains the qpass selector's blend (the default)")
    preselected = None
    if schedule is not None:  # chosen on the prompt alone, as served (the answer comes after the choice)
        n_prompt = n - len(ex.answer) + 1
        with torch.inference_mode():
            chosen, _ = qpass_rows(model, token_ids[:n_prompt], rc[:n_prompt], src, schedule)
        preselected = chosen.clone()  # an ordinary tensor: indices autograd may keep
    kv = BlendKV(model, rc, schedule, stored=src, stored_rows=stored_rows, preselected=preselected)
    rows = kv.first_rows(rc)
    h, _ = run_layers(
        model, model.embed(token_ids[rows]), rows, kv, select=kv.select, on_pre_rope=kv.on_pre_rope
    )
    # the loss rows are the last ones computed: the last prompt row, then the teacher-forced answer
    return torch.log_softmax(model.logits(h[h.shape[0] - len(ex.answer) :]).float(), -1)


def kl_loss(student_logp: torch.Tensor, ex: Example) -> torch.Tensor:
    """KL(teacher || student) per row over the teacher's top-k and the rest in one bucket; weighted mean."""
    t = ex.top_logp.float().to(student_logp.device)
    s = student_logp.gather(1, ex.top_ids.to(student_logp.device))
    p = t.exp()
    kl = (p * (t - s)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=1e-8)
    s_rest = torch.log1p(-s.exp().sum(-1).clamp(max=1 - 1e-6))
    kl = kl + p_rest * (p_rest.log() - s_rest)
    w = torch.ones_like(kl)
    w[0] = FIRST_WEIGHT
    return (w * kl).sum() / w.sum()


def fitting_items(model, items: list[Item]) -> tuple[list[Item], int]:
    """The items whose prompt and longest answer fit the model's context, and how many did not (a
    model of a short context trains on what fits; none fitting is an error, not an empty run)."""
    if not items:
        raise ValueError("no training items")
    limit = model.config.max_position - MAX_ANSWER
    fits = [it for it in items if _prompt_len(model, it) <= limit]
    if not fits:
        raise ValueError(
            f"no training prompt fits the model's context of {model.config.max_position} positions "
            f"(with {MAX_ANSWER} answer tokens)"
        )
    return fits, len(items) - len(fits)


def _prompt_len(model, item: Item) -> int:
    prefix, chunks, suffix = item_ids(model, item)
    return len(prefix) + sum(map(len, chunks)) + len(suffix)


def build_examples(model, items: list[Item], path: Path, progress: bool = True) -> list[Example]:
    """Teacher examples for ``items``, cached in ``path`` (resumed when the run is interrupted)."""
    from tqdm.auto import tqdm

    done: dict[str, Example] = {}
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved.get("fingerprint") == model.fingerprint:
            done = saved["examples"]
    todo = [it for it in items if it.id not in done]
    t_last = time.monotonic()
    for it in tqdm(todo, desc="teacher", unit="prompt", disable=not progress):
        done[it.id] = _plain(teacher_example(model, it))
        if time.monotonic() - t_last > 60:
            torch.save({"fingerprint": model.fingerprint, "examples": done}, path)
            t_last = time.monotonic()
    torch.save({"fingerprint": model.fingerprint, "examples": done}, path)
    return [done[it.id] for it in items]


class KVCacheOfChunks:
    """Each distinct chunk's stored KV (bf16 in memory), computed once; written after ``context``
    (token ids between BOS and the chunk: a context-primed student) when given."""

    def __init__(self, model, context: list[int] | None = None):
        self.model, self.kvs, self.context = model, {}, list(context or ())

    def get(self, ids: list[int]):
        key = tuple(ids)
        if key not in self.kvs:
            c = compute_chunk_kv(self.model, ids, context=self.context)
            c.k, c.v = c.k.to(torch.bfloat16).clone(), c.v.to(torch.bfloat16).clone()
            self.kvs[key] = c
        return self.kvs[key]


def train(
    model,
    out: Path,
    cfg: TrainConfig,
    items: list[Item] | None = None,
    progress: bool = True,
    teacher_path: Path | None = None,
    student_context: list[int] | None = None,
    init: Path | None = None,
) -> dict:
    """Train (or resume) an adapter for ``model``; writes ``out`` (safetensors) and returns a summary.
    ``student_context``: the chunk KV it corrects is written after these token ids (a context-primed
    chunk convention, issue 38's candidate) instead of after BOS alone. ``init``: an adapter file of the
    same kind and shape to start from (training continued, e.g. on the CPU after a GPU run)."""
    from tqdm.auto import tqdm

    out = Path(out)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    items = (
        items if items is not None else training_set(model, cfg.n_facts, cfg.n_real, cfg.n_continue, cfg.seed)
    )
    items, too_long = fitting_items(model, items)
    examples = build_examples(model, items, Path(teacher_path or out.with_suffix(".teacher.pt")), progress)
    t_teacher = time.perf_counter() - t0
    chunks = KVCacheOfChunks(model, student_context)
    heads: dict[tuple, tuple] = {}
    if cfg.kind not in KINDS:
        raise ValueError(f"unknown adapter kind {cfg.kind!r} (one of {', '.join(KINDS)})")
    if cfg.kind == "writer":
        adapter = WriterLoRA.for_model(model, cfg.rank, cfg.alpha, cfg.seed).to(model.device)
    elif cfg.kind == "link":
        adapter = LinkRows.for_model(model, cfg.num_links, cfg.seed).to(model.device)
    else:
        adapter = KVAdapter.for_model(model, cfg.rank, cfg.seed).to(model.device)
    init_digest = None
    if init is not None:
        start = type(adapter).load(init, model)
        if start.spec != adapter.spec:
            raise ValueError(f"{init} is a {start.spec}, not a {adapter.spec}")
        with torch.no_grad():
            for k, t in start.state().items():
                getattr(adapter, k).copy_(t)
        init_digest = start.digest
    params = [p for p in adapter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = cfg.steps_per_epoch or math.ceil(len(examples) / cfg.batch)
    total = per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / total))
    ckpt = out.with_suffix(".ckpt.pt")
    step, curve = 0, []
    if ckpt.is_file():
        st = torch.load(ckpt, weights_only=False)
        same_student = (
            st.get("student_context", []) == list(student_context or ()) and st.get("init") == init_digest
        )
        if same_config(st["config"], cfg) and st["fingerprint"] == model.fingerprint and same_student:
            adapter.load_state_dict(st["adapter"])
            opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"])
            step, curve = st["step"], st["curve"]
        else:
            log.warning(
                "%s is another run's checkpoint (config, model or student differ): starting at step 0", ckpt
            )
    resumed_from = step
    order_rng = random.Random(cfg.seed)
    orders = [order_rng.sample(range(len(examples)), len(examples)) for _ in range(cfg.epochs)]
    flat = [i for o in orders for i in o]
    bar = tqdm(total=total, initial=step, desc="adapter", unit="step", disable=not progress)
    t_train = time.perf_counter()
    while step < total:
        batch = flat[step * cfg.batch : (step + 1) * cfg.batch] or flat[: cfg.batch]
        opt.zero_grad()
        loss_sum = 0.0
        for j, i in enumerate(batch):
            ex = examples[i]
            key = tuple(ex.prefix)
            if key not in heads:
                with torch.inference_mode():
                    _, k, v = model.forward(torch.tensor(ex.prefix), capture_kv=True)
                heads[key] = (k.clone(), v.clone())  # cloned outside inference mode: ordinary tensors
            if cfg.kind == "writer":  # written now, through the LoRA, stored precision (bf16) kept
                kvs = [
                    _as_stored(k, v) for k, v in adapter.chunk_kvs(model, ex.chunks, student_context or ())
                ]
                reader = None
            else:
                kvs = [(kv.k, kv.v) for kv in map(chunks.get, ex.chunks)]
                reader = adapter if cfg.kind == "kv" else None
            schedule = cfg.schedule(step * cfg.batch + j)
            links = adapter if cfg.kind == "link" else None
            logp = student_logp(model, reader, ex, heads[key], kvs, schedule, links)
            loss = kl_loss(logp, ex) / len(batch)
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        curve.append(loss_sum)
        bar.update(1)
        bar.set_postfix(loss=f"{sum(curve[-20:]) / len(curve[-20:]):.3f}")
        if step % cfg.save_every == 0 or step == total:
            torch.save(
                {
                    "config": asdict(cfg),
                    "fingerprint": model.fingerprint,
                    "student_context": list(student_context or ()),
                    "init": init_digest,
                    "adapter": adapter.state_dict(),
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "step": step,
                    "curve": curve,
                },
                ckpt,
            )
    bar.close()
    meta = {"config": asdict(cfg), "examples": len(examples), "init": init_digest}
    digest = adapter.cpu().save(out, meta=meta)
    return {
        "adapter": str(out),
        "kind": cfg.kind,
        "sha256": digest,
        "bytes": out.stat().st_size,
        "rank": cfg.rank if cfg.kind != "link" else None,
        "links": cfg.num_links if cfg.kind == "link" else None,
        "examples": len(examples),
        "skipped_too_long": too_long,
        "kinds": {k: sum(e.kind == k for e in examples) for k in ("facts", "real", "continue")},
        "steps": total,
        "resumed_from": resumed_from,
        "loss_first": sum(curve[:10]) / max(1, len(curve[:10])),
        "loss_last": sum(curve[-10:]) / max(1, len(curve[-10:])),
        "teacher_s": round(t_teacher, 1),
        "train_s": round(time.perf_counter() - t_train, 1),
        "curve": [round(x, 4) for x in curve],
    }


def same_config(saved: dict, cfg: TrainConfig) -> bool:
    """Whether a checkpoint's config is ``cfg``'s: a field the checkpoint lacks (added to
    :class:`TrainConfig` after it was written) counts as its default, which is what that run used."""
    return {**asdict(TrainConfig()), **saved} == asdict(cfg)


def _as_stored(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk KV rounded to the precision it is stored in (bf16), the gradient passing through."""
    return k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)


def main_json(summary: dict) -> str:
    s = {k: v for k, v in summary.items() if k != "curve"}
    return json.dumps(s)
