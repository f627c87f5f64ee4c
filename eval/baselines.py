"""The paper's two RAG-method baselines, LangChain-style: MapReduce and MapRerank, with their TTFT.

Both process each passage in its own prompt ``[instruction] + [passage] + [question]``, so the
instruction + passage head is reusable by exact prefix caching (the CacheBlend paper's footnote 1);
as for the other modes, that head's KV is computed before the clock starts (the paper's setting of
KV already in memory). The prompts are compact paraphrases of LangChain's ``map_reduce`` and
``map_rerank`` QA prompts (LangChain's own include few-shot examples that do not fit a 512-token
model), plus the datasets' "within 5 words" constraint. Calls run one after another (no batching
of the map calls); TTFT is wall time until the first token of the final answer:

* MapReduce: every map call (prefill + generation of the extract), then the reduce prefill + first token.
* MapRerank: every per-passage call (prefill + answer and score generation); the final answer is
  the best-scored one, so it exists only when all calls are done.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from eval.prompts import ChatFrame, PromptBuilder, normalize_question
from ragkv.blend import PrefixCache, prefill
from ragkv.generate import SamplingParams, generate

MAP_INSTRUCTION = (
    "Use the following portion of a long document to see if any of the text is relevant to answer the "
    "question. Return any relevant text verbatim.\n"
)
MAP_QUERY = "\nQuestion: {question}\nRelevant text, if any:"
REDUCE_INSTRUCTION = (
    "Given the following extracted parts of a long document and a question, create a final answer. "
    "The answer should be within 5 words.\n"
)
REDUCE_QUERY = "QUESTION: {question}\n=========\n{summaries}\n=========\nFINAL ANSWER:"
RERANK_INSTRUCTION = (
    "Use the following pieces of context to answer the question at the end. If you don't know the "
    "answer, just say that you don't know. The answer should be within 5 words. In addition to giving "
    "an answer, also return a score of how fully it answered the user's question, in this format:\n"
    "Helpful Answer: [answer here]\nScore: [score between 0 and 100]\n\nContext:\n---------\n"
)
RERANK_QUERY = "---------\nQuestion: {question}\nHelpful Answer:"
_SCORE = re.compile(r"(.*?)\n\s*Score:\s*(\d+)", re.DOTALL)

BASELINES = ("mapreduce", "maprerank")


@dataclass
class BaselineResult:
    output: str
    ttft_s: float
    num_calls: int
    prompt_tokens: int
    details: dict = field(default_factory=dict)


def warm_prefix_cache(model, cache: PrefixCache, prefix: list[int], chunks: list[list[int]]) -> None:
    """Cache ``prefix`` and ``prefix + chunks`` (exact KV) unless already cached.

    A head that is entirely cached is not prefilled again: nothing would be computed (and the
    runtime expects at least one computed row).
    """
    want = len(prefix) + sum(map(len, chunks))
    m = cache.match(model, [t for seg in [prefix, *chunks] for t in seg])
    cache.release(m)
    if m.tokens < want:
        prefill(model, prefix, chunks, [], "prefix", prefix_cache=cache)


def parse_rerank(text: str) -> tuple[str, int]:
    """(answer, score) from a map-rerank output; score -1 when the format is not followed."""
    m = _SCORE.search(text)
    if m is None:
        return text.strip(), -1
    return m.group(1).strip(), int(m.group(2))


class Baselines:
    """Runs MapReduce / MapRerank on one model with greedy decoding."""

    def __init__(
        self, model, frame: ChatFrame, max_new_tokens: int, map_tokens: int, cache_bytes: int = 4 << 30
    ):
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.map_tokens = map_tokens
        self.map_b = PromptBuilder(model, frame, MAP_INSTRUCTION, "")
        self.reduce_b = PromptBuilder(model, frame, REDUCE_INSTRUCTION, "")
        self.rerank_b = PromptBuilder(model, frame, RERANK_INSTRUCTION, "")
        self.prefix_cache = PrefixCache(max_bytes=cache_bytes)

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def _warm(self, builder: PromptBuilder, chunks: list[list[int]]) -> None:
        """Cache the instruction and every instruction + passage head (untimed, like precomputed chunk KV)."""
        for c in chunks:
            warm_prefix_cache(self.model, self.prefix_cache, builder.prefix_ids, [c])

    def _call(self, builder: PromptBuilder, chunks: list[list[int]], suffix: list[int], n_new: int):
        self.model.check_length(len(builder.prefix_ids) + sum(map(len, chunks)) + len(suffix), n_new)
        res = prefill(
            self.model,
            builder.prefix_ids,
            chunks,
            suffix,
            "prefix",
            prefix_cache=self.prefix_cache,
            prefix_cache_insert=False,
        )
        return res, res.kv.num_tokens

    def _gen(self, res, n_new: int) -> str:
        return generate(self.model, res, SamplingParams(max_new_tokens=n_new, temperature=0.0)).text

    def map_reduce(self, question: str, chunks: list[list[int]]) -> BaselineResult:
        """Extract relevant text from each passage, then answer from the extracts."""
        q = normalize_question(question)
        map_suffix = self.map_b.text_suffix_ids(MAP_QUERY.format(question=q))
        self._warm(self.map_b, chunks)
        warm_prefix_cache(self.model, self.prefix_cache, self.reduce_b.prefix_ids, [])
        tokens = 0
        self._sync()
        t0 = time.perf_counter()
        extracts = []
        for c in chunks:
            res, n = self._call(self.map_b, [c], map_suffix, self.map_tokens)
            tokens += n
            extracts.append(self._gen(res, self.map_tokens).strip())
        summaries = "\n".join(e for e in extracts if e)
        red_suffix = self.reduce_b.text_suffix_ids(REDUCE_QUERY.format(question=q, summaries=summaries))
        res, n = self._call(self.reduce_b, [], red_suffix, self.max_new_tokens)
        int(res.logits.argmax())
        self._sync()
        ttft = time.perf_counter() - t0
        tokens += n
        out = self._gen(res, self.max_new_tokens)
        return BaselineResult(out, ttft, len(chunks) + 1, tokens, {"extracts": extracts})

    def map_rerank(self, question: str, chunks: list[list[int]]) -> BaselineResult:
        """Answer from each passage with a self-reported score; keep the best-scored answer."""
        q = normalize_question(question)
        suffix = self.rerank_b.text_suffix_ids(RERANK_QUERY.format(question=q))
        n_new = max(self.map_tokens, self.max_new_tokens)
        self._warm(self.rerank_b, chunks)
        tokens = 0
        self._sync()
        t0 = time.perf_counter()
        answers = []
        for c in chunks:
            res, n = self._call(self.rerank_b, [c], suffix, n_new)
            tokens += n
            answers.append(parse_rerank(self._gen(res, n_new)))
        best = max(range(len(answers)), key=lambda i: (answers[i][1], -i))  # first best on ties
        self._sync()
        ttft = time.perf_counter() - t0
        return BaselineResult(
            answers[best][0],
            ttft,
            len(chunks),
            tokens,
            {"scores": [s for _, s in answers], "chosen": best},
        )
