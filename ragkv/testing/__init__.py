"""What the test suites of ragkv and of its distributions share (as LangChain's partner packages share
``langchain-tests``): the tiny model, the evaluation corpus, stop-string checks, chat templates, free
ports, wheels built from a copy. Pytest fixtures (one torch thread, the embedder, Redis servers, an empty
fidelity cache) are in :mod:`ragkv.testing.fixtures`; a distribution's ``conftest.py`` imports the ones it
uses, so ``cd integrations/langchain && pytest`` runs that package's suite from its own folder.

The tiny model (``models/stories260k``, 1.1 MB) and the MuSiQue sample (``data/musique_s.json``) are a
source checkout's: found beside an editable install's ``ragkv/``, or where ``$RAGKV_TEST_MODEL`` /
``$RAGKV_TEST_DATA`` point. Nothing here is imported by the library.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ragkv.adapter.writer import WriterLoRA
    from ragkv.fidelity.report import FidelityReport, PointStats

#: the source checkout this ragkv was installed from (editable), if it is one
CHECKOUT = Path(__file__).resolve().parents[2]


def worker_threads() -> int:
    """Torch threads for one test process: the machine's cores shared among pytest-xdist's workers.

    Two workers of two intra-op threads each on a 2-core machine oversubscribe it (OpenMP threads
    spin waiting for a core); a service a test starts gets the same share.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def stories_path() -> Path:
    """The tiny trained test model (a 260K-parameter Llama: every code path, no real answers):
    ``$RAGKV_TEST_MODEL``, else the checkout's ``models/stories260k``."""
    return Path(os.environ.get("RAGKV_TEST_MODEL") or CHECKOUT / "models" / "stories260k")


@functools.lru_cache(maxsize=1)
def stories_model():
    """The tiny model, loaded once per process."""
    from ragkv.model import load_model

    return load_model(stories_path())


def data_dir() -> Path:
    """The evaluation sets (``$RAGKV_TEST_DATA``, else the checkout's ``data/``)."""
    return Path(os.environ.get("RAGKV_TEST_DATA") or CHECKOUT / "data")


def musique_samples(n: int) -> list[dict]:
    """The first ``n`` MuSiQue samples of the repository's copy (a question, its passages ``ctxs``)."""
    return json.loads((data_dir() / "musique_s.json").read_text())[:n]


#: the words of :func:`synthetic_docs`
WORDS = (
    "river mountain lantern copper violin harbor meadow falcon orchard glacier ember cobalt tundra "
    "saffron quartz willow canyon beacon thistle marble comet prairie lagoon cedar basalt heron "
    "citadel juniper monsoon obsidian pebble raven sierra tulip velvet walnut yonder zephyr amber "
    "bramble cinder dune fjord grove hollow island jasper kelp ledge mesa nectar onyx"
).split()


def synthetic_docs(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct synthetic documents (``{"id", "text"}``) of 60-200 words (a corpus of any size,
    the same for a seed: the fault-injection runs and the service's tests)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(60, 200))]
        sentences = [" ".join(words[j : j + 9]).capitalize() + "." for j in range(0, len(words), 9)]
        docs.append({"id": f"doc-{i:04d}", "text": f"Record {i} of the survey. " + " ".join(sentences)})
    return docs


def structured_schemas() -> list[dict]:
    """The 10 JSON schemas (name, prompt, schema, example) of the structured-output tests and benchmark."""
    return json.loads((data_dir() / "structured_schemas.json").read_text())


#: the ratio a synthetic report states for its points that are no ``blend@R``
FIXED_RATIOS = {"exact": None, "reuse": 0.0, "full-bf16": 1.0}


def fidelity_point(name: str, same: float, charged: float, speedup: float, recall: float = 0.5) -> PointStats:
    """One operating point of a synthetic fidelity report (``exact``, ``reuse``, ``blend@R`` or the
    floor, ``full-bf16``); its mode and ratio follow from its name."""
    from ragkv.fidelity.report import PointStats

    mode = "prefix" if name == "exact" else "reuse" if name == "reuse" else "blend"
    ratio = FIXED_RATIOS[name] if name in FIXED_RATIOS else float(name.split("@")[1])
    ci = (max(0.0, same - 0.1), min(1.0, same + 0.1))
    return PointStats(
        name, mode, ratio, 40, same, ci, same, ci, 0.1, (0.0, 0.2), recall, ci, charged, speedup, ci
    )


def fidelity_report(
    model, points: list[PointStats], floor_same: float = 0.8, full_recall: float = 0.5
) -> FidelityReport:
    """A sealed fidelity report of ``model`` with these points (what ``ragkv calibrate`` would save), for
    tests of the surfaces that show the gate's operating point."""
    from ragkv.fidelity.report import FidelityReport, ReportKey, calibration_set_digest

    return FidelityReport(
        model=model.name,
        fingerprint=model.fingerprint,
        schedule=ReportKey(model.fingerprint).schedule,
        calibration_set=calibration_set_digest(),
        n_questions=40,
        max_new_tokens=24,
        full_recall=full_recall,
        full_ttft_s=0.5,
        floor=fidelity_point("full-bf16", floor_same, 1.0, 1.0),
        points=points,
        monotone_ok=True,
        monotone_violations=[],
        compute_to_floor=None,
        measured_at="2026-11-27",
        machine="test",
    ).seal()


def fidelity_ladder() -> list[PointStats]:
    """A ladder of operating points with a dip (blend@0.5 above blend@0.7: not trusted); over a floor of
    0.8 the gate picks blend@0.8."""
    return [
        fidelity_point("exact", 1.0, 0.82, 1.1),
        fidelity_point("reuse", 0.1, 0.1, 5.0),
        fidelity_point("blend@0.3", 0.3, 0.38, 2.6),
        fidelity_point("blend@0.5", 0.85, 0.55, 1.8),  # a lucky point below a dip: not trusted
        fidelity_point("blend@0.7", 0.75, 0.71, 1.4),
        fidelity_point("blend@0.8", 0.82, 0.78, 1.3),
        fidelity_point("blend@0.9", 0.9, 0.85, 1.05),
    ]


def random_writer(model, rank: int = 4, seed: int = 1) -> WriterLoRA:
    """A chunk-KV writer (W-full LoRA) for ``model`` with small random weights: its KV differs from the
    model's own, as a trained one's does."""
    from ragkv.adapter.writer import WriterLoRA

    w = WriterLoRA.for_model(model, rank, 16.0, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (w.b_qkv, w.b_o):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return w.requires_grad_(False)


def writer_file(tmp_path: Path) -> tuple:
    """(the tiny model, the file of a random writer for it): what a writer named in settings loads."""
    m = stories_model()
    path = tmp_path / "writer.safetensors"
    random_writer(m, rank=2).save(path)
    return m, path


def bearer(key: str, collection: str | None = None) -> dict:
    """Request headers of an API key (and the collection it names)."""
    h = {"Authorization": f"Bearer {key}"}
    if collection is not None:
        h["X-Ragkv-Collection"] = collection
    return h


def musique_docs(n_samples: int = 2, per_sample: int = 3, chars: int = 300) -> list[dict]:
    """Documents of the first ``per_sample`` passages of ``n_samples`` MuSiQue samples, cut to ``chars``
    (ids ``s<i>-p<j>``): a corpus the tiny model's 512 positions hold a few of."""
    return [
        {"id": f"s{i}-p{j}", "text": c["text"][:chars]}
        for i, s in enumerate(musique_samples(n_samples))
        for j, c in enumerate(s["ctxs"][:per_sample])
    ]


def texts_rag(data_dir: Path | str, texts: list[str], embedder=None, model=None, **options):
    """A RAG on ``model`` (default: the tiny one) over ``texts`` (documents ``d0``, ``d1``...; each
    chunk's KV computed and stored; the texts kept as ``rag.texts``), blending at an explicit ratio (the
    tiny model has no fidelity report): ``options`` over chunk_tokens=64, top_k=3. The caller closes it."""
    from ragkv.blend import DEFAULT_RATIO
    from ragkv.llm import LLM
    from ragkv.rag import RAG, Embedder

    options = {"chunk_tokens": 64, "top_k": 3, "ratio": DEFAULT_RATIO, **options}
    rag = RAG(LLM(model or stories_model()), data_dir, embedder=embedder or Embedder(), **options)
    rag.ingest([{"id": f"d{i}", "text": t} for i, t in enumerate(texts)], show_progress=False)
    rag.texts = list(texts)
    return rag


def musique_rag(data_dir: Path | str, embedder=None, n_samples: int = 2, chars: int = 300, **options):
    """:func:`texts_rag` over :func:`musique_docs` (passages cut to ``chars``). The caller closes it."""
    return texts_rag(data_dir, [d["text"] for d in musique_docs(n_samples, chars=chars)], embedder, **options)


def assert_chunks_reused(info: dict, n_chunks: int) -> None:
    """An answer's ragkv statistics say its prefill reused every chunk's stored KV (blend)."""
    assert info["mode"] == "blend"
    assert info["kv_hits"] == n_chunks == info["num_chunks"]
    assert info["num_reused_rows"] > 0
    assert info["recomputed_per_layer"][-1] < info["num_tokens"]


@dataclass
class TwoCollections:
    """A RAG whose collections ``a`` and ``b`` hold two MuSiQue passages each (``pa``, ``pa2``; ``pb``,
    ``pb2``) and whose default collection is empty: the texts and each collection's chunk ids."""

    rag: Any
    texts: list[str]
    a_ids: set[int]
    b_ids: set[int]


def two_collections_rag(data_dir: Path | str, embedder=None) -> TwoCollections:
    """:class:`TwoCollections` on the tiny model (top_k=2, blend at an explicit ratio); the caller closes
    its ``rag``."""
    texts = [c["text"][:300] for s in musique_samples(2) for c in s["ctxs"][:2]]
    rag = musique_rag(data_dir, embedder, n_samples=0, top_k=2)
    for collection, ids in (("a", ("pa", "pa2")), ("b", ("pb", "pb2"))):
        first = 0 if collection == "a" else 2
        docs = [{"id": d, "text": texts[first + i]} for i, d in enumerate(ids)]
        rag.ingest(docs, show_progress=False, collection=collection)
    chunk_ids = {
        c: {r.chunk_id for d in ids for r in rag.index.chunks_of(d, c)}
        for c, ids in (("a", ("pa", "pa2")), ("b", ("pb", "pb2")))
    }
    return TwoCollections(rag, texts, chunk_ids["a"], chunk_ids["b"])


def checkout_harness(name: str):
    """The checkout's ``eval.<name>`` (e.g. ``standard_paths``, the frameworks' standard paths that
    ``python -m eval.bench_flat_reuse`` measures): importable in a run from the repository's root
    (``python -m pytest`` puts it on the path); the calling test skips elsewhere (a distribution's suite
    run from its own folder)."""
    import pytest

    return pytest.importorskip(f"eval.{name}", reason="the checkout's eval/ (run from the repository root)")


def document_tokens(rag, text: str) -> int:
    """The tokens ``rag`` stores for ``text``: the sum over its chunks (what a token quota counts)."""
    from ragkv.rag.splitter import split_tokens

    return sum(len(c.token_ids) for c in split_tokens(rag.model.tokenizer, text, rag.chunk_tokens))


def fill_index_disk(index) -> None:
    """Make a RAG index's SQLite answer as on a full disk (SQLITE_FULL, what ENOSPC gives): the database
    may not grow by a page until :func:`free_index_disk`."""
    pages = index.db.execute("PRAGMA page_count").fetchone()[0]
    index.db.execute(f"PRAGMA max_page_count = {pages}")


def free_index_disk(index) -> None:
    """Undo :func:`fill_index_disk`."""
    index.db.execute("PRAGMA max_page_count = 1073741823")


def committed_documents(data_dir: str | Path) -> int:
    """Documents committed in ``data_dir``'s index, read from its SQLite file as another process sees
    them (0 before the index exists): what a test or benchmark that kills an ingest counts as acknowledged."""
    import sqlite3

    path = Path(data_dir) / "index" / "chunks.sqlite"
    if not path.exists():
        return 0
    db = sqlite3.connect(path, timeout=30)
    try:
        return int(db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
    except sqlite3.OperationalError:  # the table is not created yet
        return 0
    finally:
        db.close()


def free_port() -> int:
    """A loopback TCP port free right now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: why the tests of the real vLLM package are skipped where it is missing
NO_VLLM = (
    "vllm is not installed in this environment (CUDA-only on PyPI; for the contract tests install "
    "vllm==0.32.* or 0.33.* --no-deps next to torch 2.13: integrations/vllm/examples/contract_venv.sh)"
)


def have_vllm() -> bool:
    """Whether the vLLM package is installed; without CUDA it is pointed at its CPU platform (so its
    models build without CUDA)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return True


def stop_cases(pieces: list[str]) -> dict[str, tuple[str, int]]:
    """Stop strings cut from a greedy output's per-token texts (``pieces``), each with the number of
    tokens whose last one completes it (``max_new_tokens`` that ends on it).

    ``"multi"``: three whole tokens; ``"split"``: from inside one token to inside another two tokens
    on. Each starts after some text and first occurs where it is cut from.
    """
    ends = list(itertools.accumulate(map(len, pieces)))
    starts = [e - len(p) for e, p in zip(ends, pieces, strict=True)]
    text = "".join(pieces)
    out: dict[str, tuple[str, int]] = {}
    for k in range(1, len(pieces) - 3):
        a, b, c = pieces[k : k + 3]
        if not (a.strip() and b.strip() and c.strip()):
            continue
        multi = text[starts[k] : ends[k + 2]]
        if "multi" not in out and text.find(multi) == starts[k]:
            out["multi"] = (multi, k + 3)
        split = text[starts[k] + 1 : ends[k + 2] - 1]
        if "split" not in out and len(a.strip()) >= 2 and len(c) >= 2 and text.find(split) == starts[k] + 1:
            out["split"] = (split, k + 3)
    assert set(out) == {"multi", "split"}, f"no stop cases in {pieces}"
    return out


def check_stop_strings(pieces: list[str], max_new: int, complete) -> None:
    """A surface never emits any part of a stop string and reports the right finish reason.

    ``pieces``: the surface's greedy output, one text per token, ``max_new`` tokens, no stop string;
    ``complete(stop, max_new_tokens, streamed) -> (text, finish_reason)``. Each case of
    :func:`stop_cases` is checked stopped mid-generation, completed on the last allowed token
    ("stop") and one token short of it ("length": the text held back as a possible stop string is
    flushed), streamed (the concatenated deltas) and not.
    """
    whole = "".join(pieces)
    for stop, n in stop_cases(pieces).values():
        want = whole[: whole.index(stop)]
        short = "".join(pieces[: n - 1])
        for limit, reason, text in ((max_new, "stop", want), (n, "stop", want), (n - 1, "length", short)):
            for streamed in (False, True):
                got = complete(stop, limit, streamed)
                assert got == (text, reason), (stop, limit, streamed, got)


#: a ChatML template (SmolLM2's, without its default system turn): contents between role markers
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: a Llama-2 / Mistral style template: BOS from the template, the system prompt folded into the first
#: user turn, roles that must alternate (a template's own refusal, ``raise_exception``)
INST_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' }}{% if loop.first and sys %}{{ '<<SYS>>\n' + sys + "
    "'\n<</SYS>>\n\n' }}{% endif %}{{ m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + "
    "eos_token }}{% endif %}{% endfor %}"
)


def templated_checkpoint(dest: Path, template: str) -> Path:
    """A copy of the tiny test model whose tokenizer has ``template`` as its chat template (what an
    instruct checkpoint ships in ``tokenizer_config.json``)."""
    shutil.copytree(stories_path(), dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def template_ids(checkpoint: Path, messages: list[dict]) -> list[int]:
    """transformers' own token ids of ``messages`` rendered by the checkpoint's chat template, with
    the generation prompt (``apply_chat_template(..., tokenize=True)``: what vLLM prefills)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def build_wheel(project: Path, tmp_path: Path) -> tuple[list[str], str]:
    """Build ``project``'s wheel from a copy (no build folders left in the source): its file names and
    its ``entry_points.txt`` ("" if none)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "tests")
    shutil.copytree(project, src, ignore=ignore)
    out = tmp_path / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        ".",
    ]
    subprocess.run(cmd, cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        return names, z.read(eps[0]).decode() if eps else ""


class SlowStore:
    """A real chunk store whose reads (``get``, ``get_blob``) and writes (``put``, ``put_blob``) each
    take a fixed extra delay (a slow link, a busy Redis, a remote tier); everything else is the store's."""

    #: the delayed methods and the delay each takes
    DELAYED = {
        "get": "read_delay_s",
        "get_blob": "read_delay_s",
        "put": "write_delay_s",
        "put_blob": "write_delay_s",
    }

    def __init__(self, store, read_delay_s: float = 0.0, write_delay_s: float = 0.0):
        self.inner, self.read_delay_s, self.write_delay_s = store, read_delay_s, write_delay_s

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.DELAYED:
            return attr

        def delayed(*args, **kwargs):
            time.sleep(getattr(self, self.DELAYED[name]))
            return attr(*args, **kwargs)

        return delayed


def descendants_named(word: str) -> list[int]:
    """Pids of this process's descendants whose command line contains ``word`` (e.g. the workers of a
    local Ray this process started, by the step they run: ``descendants_named("ChunkKV")``), to kill
    one in a fault test. Linux (``/proc``)."""
    parents: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    me, out = os.getpid(), []
    for pid in parents:
        q = pid
        while q in parents and q not in (0, 1, me):
            q = parents[q]
        if q == me:
            try:
                if word in (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(pid)
            except OSError:
                continue
    return out
