"""Datasets and prompts as CacheBlend's evaluation builds them: instruction prefix, passages, query.

The prompt is ``[prefix] + [passage_1 .. passage_n] + [suffix]``: the prefix is BOS, the chat
template's head and the instruction; every passage (``"{title}\\n\\n{text}\\n\\n"``) is its own
chunk, tokenized alone so its KV can be precomputed once; the suffix is the query text, the
normalized question, ``"\\nAnswer:"`` and the chat template's tail. Instruction and query strings
are copied verbatim from the reference scripts (``example/blend_musique.py`` /
``blend_wikimqa.py``), including the reference's double period in the MuSiQue prefix.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.model.chat import tokenizer_adds_bos

log = logging.getLogger("eval.prompts")

REPO = Path(__file__).resolve().parents[1]
_SENTINEL = "\u2063RAGKV_CONTENT\u2063"


class UnknownDatasetError(ValueError):
    """A dataset name other than the supported ones."""


class DatasetFormatError(ValueError):
    """A data file that is not a JSON array of {ctxs, question, answers} samples."""


@dataclass(frozen=True)
class DatasetSpec:
    """One evaluation set: its file under the shared data folder and its prompt texts."""

    name: str
    filename: str
    prefix: str
    query: str


DATASETS: dict[str, DatasetSpec] = {
    "musique": DatasetSpec(
        "musique",
        "musique_s.json",
        "You will be asked a question after reading several passages. Please directly answer the question "
        "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.."
        "\nPassages:\n",
        "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
        "The answer should be within 5 words. \nQuestion:",
    ),
    "2wikimqa": DatasetSpec(
        "2wikimqa",
        "wikimqa_s_clean.json",
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n",
        "\n\nAnswer the question based on the given passages. Answer the question within 5 words. Do NOT "
        "repeat the question or output any other words. Question: ",
    ),
}


@dataclass
class Sample:
    """One question with its passages and gold answers (``list[str]`` or ``list[list[str]]``)."""

    index: int
    question: str
    answers: list
    titles: list[str]
    texts: list[str]

    @property
    def passages(self) -> list[str]:
        return [passage_text(t, x) for t, x in zip(self.titles, self.texts, strict=True)]


def get_spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownDatasetError(f"unknown dataset {name!r}; use one of {sorted(DATASETS)}") from None


#: the evaluation sets the repository carries (data/README.md: provenance and licences)
DATA_DIR = REPO / "data"
#: the tiny trained test model the repository carries (fast runs; it cannot answer questions)
TINY_MODEL = REPO / "models" / "stories260k"


def dataset_path(spec: DatasetSpec, data: str | os.PathLike | None = None) -> Path:
    """The data file: ``data`` if a file, ``data/<filename>`` if a folder, else the repository's copy."""
    if data is None:
        return DATA_DIR / spec.filename
    p = Path(data).expanduser()
    return p / spec.filename if p.is_dir() else p


def load_samples(spec: DatasetSpec, data: str | os.PathLike | None = None) -> list[Sample]:
    """Read and validate a data file; every sample keeps its index in the file."""
    path = dataset_path(spec, data)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (pass --data FILE_OR_DIR)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise DatasetFormatError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, list):
        raise DatasetFormatError(f"{path}: expected a JSON array of samples")
    out = []
    for i, ex in enumerate(raw):
        try:
            ctxs = ex["ctxs"]
            titles = [str(c.get("title") or "") for c in ctxs]
            texts = [str(c["text"]) for c in ctxs]
            q, answers = str(ex["question"]), ex["answers"]
        except (KeyError, TypeError, AttributeError) as e:
            raise DatasetFormatError(f"{path}: sample {i} lacks ctxs/question/answers ({e!r})") from e
        if not texts:
            raise DatasetFormatError(f"{path}: sample {i} has no passages")
        out.append(Sample(i, q, answers if isinstance(answers, list) else [answers], titles, texts))
    return out


def normalize_question(q: str) -> str:
    """As the reference: end with '?', lower-case the first letter."""
    q = q.strip()
    if not q.endswith("?"):
        q += "?"
    return q[:1].lower() + q[1:]


def passage_text(title: str, text: str) -> str:
    return f"{title}\n\n{text}\n\n"


def query_text(spec_query: str, question: str) -> str:
    return f"{spec_query}{normalize_question(question)}\nAnswer:"


@dataclass(frozen=True)
class ChatFrame:
    """The chat template around one user message: ``head`` goes into the prefix, ``tail`` into the suffix."""

    head: str = ""
    tail: str = ""


def chat_frame(tokenizer, use_template: bool = True) -> ChatFrame:
    """Split the tokenizer's chat template (user turn + generation prompt) around the message content.

    BOS is dropped from the head only when the tokenizer adds it itself (``Model.encode(add_bos=True)``
    then adds it as a token); a ChatML head keeps its ``<|im_start|>``, which is that BOS. No template,
    or a template that cannot render a lone user turn, gives an empty frame (plain text prompt).
    """
    if not use_template or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ChatFrame()
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # templates may demand a system turn, alternate roles, ...
        log.warning("chat template not usable (%s); using plain prompts", e)
        return ChatFrame()
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        log.warning("chat template did not render the message once; using plain prompts")
        return ChatFrame()
    head, tail = text.split(_SENTINEL)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and head.startswith(bos) and tokenizer_adds_bos(tokenizer, tokenizer.bos_token_id):
        head = head[len(bos) :]
    return ChatFrame(head, tail)


@dataclass
class PromptIds:
    """Token ids of one prompt: prefix (with BOS), one list per passage chunk, suffix."""

    prefix: list[int]
    chunks: list[list[int]]
    suffix: list[int]
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prefix) + sum(map(len, self.chunks)) + len(self.suffix)

    @property
    def all_ids(self) -> list[int]:
        return self.prefix + [t for c in self.chunks for t in c] + self.suffix


class PromptBuilder:
    """Tokenizes the three parts of a prompt for one model, chat frame and instruction pair."""

    def __init__(self, model, frame: ChatFrame, instruction: str, query: str):
        self.model = model
        self.frame = frame
        self.instruction = instruction
        self.query = query
        # the frame is a rendered chat template: its control tokens' text is parsed (specials=True)
        self.prefix_ids = model.encode(frame.head + instruction, add_bos=True, specials=True)

    def passage_ids(self, passage: str) -> list[int]:
        return self.model.encode(passage)

    def suffix_ids(self, question: str) -> list[int]:
        return self.text_suffix_ids(query_text(self.query, question))

    def text_suffix_ids(self, text: str) -> list[int]:
        """Any suffix text followed by the chat template's tail (the evaluation's own text: parsed whole)."""
        return self.model.encode(text + self.frame.tail, specials=True)

    def build(self, question: str, passages: list[str]) -> PromptIds:
        return PromptIds(self.prefix_ids, [self.passage_ids(p) for p in passages], self.suffix_ids(question))
