"""The JSON of a finished answer (sources, timings, stats, usage), shared by /v1/query and chat."""

from fastapi.encoders import jsonable_encoder

from ragkv_server.service import STAT_KEYS, Final


def source(r) -> dict:
    """One retrieved chunk as the API reports it."""
    return {
        "chunk_id": r.chunk_id,
        "doc_id": r.doc_id,
        "seq": r.seq,
        "kv_key": r.kv_key,
        "score": float(r.score),
        "text": r.text,
        "metadata": r.metadata,
    }


def stats(f: Final) -> dict:
    """The prefill statistics the API reports (:data:`ragkv_server.service.STAT_KEYS`)."""
    return jsonable_encoder({k: f.answer.stats[k] for k in STAT_KEYS if k in f.answer.stats})


def timings(f: Final) -> dict:
    """Where the time went: queue, retrieval, KV fetch, first token, total."""
    t = f.answer.timings
    return {
        "queue_s": f.queue_s,
        "retrieval_s": t["retrieval_s"],
        "kv_fetch_s": t["kv_fetch_s"],
        "ttft_s": t["ttft_s"],
        "total_s": t["total_s"],
    }


def usage(f: Final) -> dict:
    """Token counts (OpenAI's ``usage``)."""
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def ragkv_info(f: Final) -> dict:
    """The ``ragkv`` field of a chat completion: sources, timings and statistics."""
    return {"sources": [source(r) for r in f.answer.sources], "timings": timings(f), "stats": stats(f)}


def query_body(rid: str, text: str, f: Final) -> dict:
    """The ``/v1/query`` response (also the streamed ``answer`` event)."""
    return {
        "id": rid,
        "answer": text,
        "mode": f.answer.mode,
        "finish_reason": f.finish_reason,
        "sources": [source(r) for r in f.answer.sources],
        "timings": timings(f),
        "stats": stats(f),
        "usage": usage(f),
    }
