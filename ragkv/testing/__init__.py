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
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

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
