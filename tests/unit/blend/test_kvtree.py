"""The exact KV tree: reuse is bit-identical to full prefill, at any split, across tiers, and untrusted
pages are recomputed (ragkv/blend/kvtree.py, ragkv/blend/exact.py, ragkv/attention/exact.py)."""

from __future__ import annotations

import torch

from ragkv.attention.exact import exact_attention
from ragkv.blend import KVTree, prefill
from ragkv.blend.exact import exact_prefill
from ragkv.blend.kvtree import PAGE_TOKENS, page_keys, tree_root
from ragkv.model import random_model
from ragkv.model.forward import exact_forward
from ragkv.store import store_from_url
from ragkv.testing import SlowStore


def _model(seed=3):
    return random_model("llama", seed=seed, init_std=0.1)


def _ids(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()


def test_exact_attention_rows_do_not_depend_on_the_pass():
    """A row's attention is the same bits whether it is computed in the whole square, in a tail pass
    after cached keys, or alone: across tile boundaries, with few and many rows."""
    g = torch.Generator().manual_seed(0)
    n = 700
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (6, 2, 2))
    full = exact_attention(q, k, v, 0, 0.25, tile=64)
    for first in (1, 63, 64, 65, 300, 640, 699):
        part = exact_attention(q[first:], k, v, first, 0.25, tile=64)
        assert torch.equal(part, full[first:]), first
    for first, end in ((0, 5), (0, 17), (3, 40), (64, 81), (100, 128), (129, 150), (250, 333)):
        head = exact_attention(q[first:end], k[:end], v[:end], first, 0.25, tile=64)  # a cut causal square
        assert torch.equal(head, full[first:end]), (first, end)
    # and it is attention: against the plain causal kernel, within float rounding
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=0.25,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert torch.allclose(full, ref, atol=1e-5)


def test_exact_pass_after_any_cached_prefix_equals_full_prefill_bit_for_bit():
    m = _model()
    ids = _ids(m, 300)
    full = exact_forward(m, ids)
    for split in (1, 5, 15, 16, 17, 64, 129, 250, 284, 290, 299):
        head = exact_forward(m, ids[:split])
        assert torch.equal(head.k, full.k[:, :split]) and torch.equal(head.v, full.v[:, :split]), split
        rest = exact_forward(m, ids, [(head.k, head.v)])
        assert torch.equal(rest.logits, full.logits), split
        assert torch.equal(rest.k, full.k) and torch.equal(rest.v, full.v), split


def test_prefix_mode_reuses_the_longest_prefix_and_equals_full(one_thread):
    """A chat-like sequence of prompts, each extending the last: every turn reuses the whole previous
    prompt from the tree (token level, no segment structure needed) and gives full's logits bit for bit."""
    m = _model()
    tree = KVTree()
    convo = _ids(m, 80, seed=1)
    prev_len = 0
    for turn in range(4):
        full = prefill(m, convo, [], [], "full")
        got = prefill(m, convo, [], [], "prefix", prefix_cache=tree)
        assert torch.equal(got.logits, full.logits), turn
        assert torch.equal(got.kv.k, full.kv.k) and torch.equal(got.kv.v, full.kv.v), turn
        if turn:
            assert got.stats["cached_tokens"] == prev_len, (turn, got.stats["cached_tokens"])
        prev_len = len(convo)
        convo = convo + _ids(m, 30 + 7 * turn, seed=10 + turn)
    # a prompt that shares only part of a node: matched inside the node, then the node splits
    branch = convo[:100] + _ids(m, 40, seed=99)
    got = prefill(m, branch, [], [], "prefix", prefix_cache=tree)
    assert got.stats["cached_tokens"] == 100
    assert torch.equal(got.logits, prefill(m, branch, [], [], "full").logits)
    again = prefill(m, branch, [], [], "prefix", prefix_cache=tree)
    assert again.stats["cached_tokens"] == len(branch) - 1  # all but the last row
    assert torch.equal(again.logits, got.logits)


def test_a_fully_cached_prompt_recomputes_its_last_row_exactly():
    m = _model()
    tree = KVTree()
    ids = _ids(m, 50)
    first = prefill(m, ids[:30], [ids[30:45]], ids[45:], "prefix", prefix_cache=tree)
    second = prefill(m, ids[:30], [ids[30:45]], ids[45:], "prefix", prefix_cache=tree)
    assert second.stats["cached_tokens"] == 49 and second.stats["computed_tokens"] == 1
    assert torch.equal(first.logits, second.logits)


def test_full_mode_reuses_and_inserts_nothing():
    m = _model()
    tree = KVTree()
    ids = _ids(m, 60)
    prefill(m, ids, [], [], "prefix", prefix_cache=tree)
    n_nodes, nbytes = len(tree), tree.nbytes
    res = prefill(m, ids, [], [], "full", prefix_cache=tree)
    assert res.stats["cached_tokens"] == 0 and (len(tree), tree.nbytes) == (n_nodes, nbytes)


def test_nodes_end_at_chunk_boundaries_and_eviction_keeps_the_budget_and_pins():
    m = _model()
    ids = _ids(m, 120)
    probe = KVTree()
    prefill(m, ids[:20], [ids[20:60], ids[60:100]], ids[100:], "prefix", prefix_cache=probe)
    assert len(probe) == 4  # prefix, two chunks, question
    per_token = probe.nbytes // 120
    tree = KVTree(max_bytes=per_token * 150)
    prefill(m, ids[:20], [ids[20:60], ids[60:100]], ids[100:], "prefix", prefix_cache=tree)
    other = ids[:20] + _ids(m, 100, seed=5)
    pinned = tree.match(m, ids)  # a request in flight holds the first prompt's path
    prefill(m, other[:20], [other[20:]], [], "prefix", prefix_cache=tree)
    assert tree.nbytes <= per_token * 150 or all(nd.pins for nd, _ in pinned.path)
    tree.release(pinned)
    prefill(m, other[:20], [other[20:]], [], "prefix", prefix_cache=tree)
    assert tree.nbytes <= per_token * 150
    assert tree.stats()["evictions"] >= 1


def test_pgdsf_keeps_the_node_that_saves_more_recompute_than_lru():
    """Two prompts of equal bytes, one hit often: with a budget for one, PGDSF keeps the hot one even
    when the cold one was used last; LRU keeps the last used."""
    m = _model()
    hot, cold = _ids(m, 40, seed=1), _ids(m, 40, seed=2)
    kept = {}
    for policy in ("pgdsf", "lru"):
        probe = KVTree()
        prefill(m, hot, [], [], "prefix", prefix_cache=probe)
        tree = KVTree(max_bytes=int(probe.nbytes * 1.5), policy=policy)
        tree.cost.observe = lambda *a: None  # the default cost model, not this run's timings
        for _ in range(4):
            prefill(m, hot, [], [], "prefix", prefix_cache=tree)
        prefill(m, cold, [], [], "prefix", prefix_cache=tree)  # over budget: one goes
        kept[policy] = prefill(m, hot, [], [], "prefix", prefix_cache=tree).stats["cached_tokens"]
    assert kept["pgdsf"] == 39 and kept["lru"] == 0


def test_pages_survive_the_process_and_are_shared_through_the_store(tmp_path):
    m = _model()
    ids = _ids(m, 3 * PAGE_TOKENS + 10)
    url = str(tmp_path / "kv")
    a = KVTree(store=store_from_url(url))
    full = prefill(m, ids, [], [], "full")
    prefill(m, ids, [], [], "prefix", prefix_cache=a)
    assert a.flush() and a.stats()["store_pages_written"] == 3
    b = KVTree(store=store_from_url(url))  # a restart, or another process on the same store
    got = prefill(m, ids, [], [], "prefix", prefix_cache=b)
    assert got.stats["cached_tokens"] == 3 * PAGE_TOKENS and got.stats["store_tokens"] == 3 * PAGE_TOKENS
    assert torch.equal(got.logits, full.logits) and torch.equal(got.kv.k, full.kv.k)
    # another model's tree never matches these pages (its root differs)
    other = random_model("llama", seed=4, init_std=0.1)
    assert tree_root(other) != tree_root(m)
    res = prefill(other, ids, [], [], "prefix", prefix_cache=KVTree(store=store_from_url(url)))
    assert res.stats["cached_tokens"] == 0


def test_pages_that_straddle_nodes_are_stored_with_the_rows_of_full_prefill(tmp_path):
    """A chat: each turn adds rows after the last; pages cut across the nodes of several turns (and
    are gathered page by page, not from a copy of the whole path): another process reads them back
    equal to full prefill's rows."""
    m = _model()
    ids = _ids(m, 4 * PAGE_TOKENS + 7)
    url = str(tmp_path / "kv")
    a = KVTree(store=store_from_url(url))
    for cut in (
        PAGE_TOKENS // 2 + 3,
        2 * PAGE_TOKENS - 5,
        3 * PAGE_TOKENS + 1,
        len(ids),
    ):  # nodes off the pages
        prefill(m, ids[:cut], [], [], "prefix", prefix_cache=a)
    assert a.flush() and a.stats()["store_pages_written"] == 4
    match = a.match(m, ids, len(ids) - 1)
    try:
        k, v = match.kv()
        for lo, hi in ((0, 7), (PAGE_TOKENS - 3, 2 * PAGE_TOKENS + 2), (5, match.tokens)):
            rk, rv = match.rows(lo, hi)
            assert torch.equal(rk, k[:, lo:hi]) and torch.equal(rv, v[:, lo:hi])
    finally:
        a.release(match)
    full = prefill(m, ids, [], [], "full")
    b = KVTree(store=store_from_url(url))
    got = prefill(m, ids, [], [], "prefix", prefix_cache=b)
    assert got.stats["store_tokens"] == 4 * PAGE_TOKENS
    assert torch.equal(got.logits, full.logits) and torch.equal(got.kv.k, full.kv.k)


def test_corrupt_or_foreign_pages_are_recomputed_never_used(tmp_path):
    m = _model()
    ids = _ids(m, 2 * PAGE_TOKENS + 5)
    url = str(tmp_path / "kv")
    store = store_from_url(url)
    a = KVTree(store=store)
    full = prefill(m, ids, [], [], "full")
    prefill(m, ids, [], [], "prefix", prefix_cache=a)
    assert a.flush()
    (_, key0), (_, key1) = page_keys(tree_root(m), ids)
    # flip a byte in the second page's data: its digest fails
    path = store.path_of(key1)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF
    path.write_bytes(bytes(raw))
    b = KVTree(store=store_from_url(url))
    got = prefill(m, ids, [], [], "prefix", prefix_cache=b)
    assert got.stats["cached_tokens"] == PAGE_TOKENS  # the first page only
    assert torch.equal(got.logits, full.logits)
    assert b.flush()  # b rewrote the recomputed page
    # a page that verifies but holds other tokens (a copy under the wrong key) is refused too
    path.write_bytes(store.path_of(key0).read_bytes())
    c = KVTree(store=store_from_url(url))
    got = prefill(m, ids, [], [], "prefix", prefix_cache=c)
    assert got.stats["cached_tokens"] == PAGE_TOKENS and torch.equal(got.logits, full.logits)


class _DownStore:
    """A store whose backend is gone: every call fails as a network store's would."""

    auth = None

    def get(self, *a, **k):
        raise OSError("connection refused")

    def put_blob(self, *a, **k):
        raise OSError("connection refused")


def test_a_store_that_is_down_costs_reuse_never_the_answer():
    m = _model()
    ids = _ids(m, 2 * PAGE_TOKENS + 5)
    tree = KVTree(store=_DownStore())
    full = prefill(m, ids, [], [], "full")
    got = prefill(m, ids, [], [], "prefix", prefix_cache=tree)
    assert torch.equal(got.logits, full.logits)
    tree.flush()
    again = prefill(m, ids, [], [], "prefix", prefix_cache=tree)  # RAM still serves
    assert again.stats["cached_tokens"] == len(ids) - 1 and torch.equal(again.logits, full.logits)
    assert tree.stats()["store_errors"] >= 1


def test_exact_prefill_reports_what_was_reused():
    m = _model()
    tree = KVTree()
    ids = _ids(m, 90)
    cold = exact_prefill(m, ids, tree)
    assert (cold.stats["cached_tokens"], cold.stats["computed_tokens"], cold.stats["tree_depth"]) == (
        0,
        90,
        0,
    )
    warm = exact_prefill(m, ids + _ids(m, 20, seed=8), tree)
    assert warm.stats["cached_tokens"] == 90 and warm.stats["computed_tokens"] == 20
    assert warm.stats["tree_depth"] == 1 and tree.stats()["token_hit_rate"] > 0


def test_a_finished_answer_is_committed_so_the_next_turn_reuses_it():
    """The decode loop hands the answer to the exact prefill's ``on_finish``: the next turn's prompt
    (prompt + answer + more) then reuses the answer's rows too, and still equals full prefill."""
    from ragkv.generate import SamplingParams, generate

    m = _model()
    tree = KVTree()
    prompt = _ids(m, 70)
    res = prefill(m, prompt, [], [], "prefix", prefix_cache=tree)
    gen = generate(m, res, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    assert len(gen.token_ids) == 6
    turn2 = prompt + gen.token_ids + _ids(m, 20, seed=4)
    got = prefill(m, turn2, [], [], "prefix", prefix_cache=tree)
    assert got.stats["cached_tokens"] == len(prompt) + 6
    assert torch.equal(got.logits, prefill(m, turn2, [], [], "full").logits)
    full = prefill(m, prompt, [], [], "full")
    assert full.on_finish is None  # full prefill commits nothing


def test_a_match_keeps_its_rows_when_another_request_splits_its_node():
    """A request matched part of a node; before it reads the rows, another request's insert splits that
    node (concurrent requests): the first still gets its matched rows at their positions."""
    m = _model()
    tree = KVTree()
    ids = _ids(m, 80)
    full = prefill(m, ids, [], [], "full")
    prefill(m, ids[:60], [], [], "prefix", prefix_cache=tree)  # one node of 60 rows
    mine = tree.match(m, ids[:50] + _ids(m, 5, seed=9))  # 50 rows of it, pinned
    prefill(m, ids[:30] + _ids(m, 30, seed=7), [], [], "prefix", prefix_cache=tree)  # splits it at 30
    k, v = mine.kv()
    assert k.shape[1] == 50
    assert torch.equal(v, full.kv.v[:, :50])
    tree.release(mine)


def test_a_machine_where_passes_are_not_split_invariant_gets_full_prefill(monkeypatch, caplog):
    """The per-machine self-check: where a tail pass's attention is not the whole pass's bits (simulated:
    the attention's result depends on the pass's row count, as a GEMM that changes its order with M
    would), the tree is bypassed with a warning and every prompt is computed whole."""
    import ragkv.attention.exact as exact_attn
    from ragkv.blend import exact as exact_mod

    m = _model(seed=5)
    assert exact_mod.exactness_check(m)  # this machine: invariant
    honest = exact_attn.exact_attention

    def order_dependent(q, k, v, first, scale, tile=exact_attn.TILE):
        return honest(q, k, v, first, scale, tile) * (1 + 1e-6 * (q.shape[0] % 7))

    monkeypatch.setattr(exact_attn, "exact_attention", order_dependent)
    monkeypatch.setattr(exact_mod, "_CHECKED", {})
    tree = KVTree()
    ids = _ids(m, 90)
    with caplog.at_level("WARNING", logger="ragkv.blend.exact"):
        exact_prefill(m, ids, tree)
        again = exact_prefill(m, ids + _ids(m, 20, seed=8), tree)
    assert "not split-invariant" in caplog.text
    assert again.stats["cached_tokens"] == 0 and again.stats["computed_tokens"] == 110
    assert tree.stats()["ram_nodes"] == 0


def test_passes_are_split_invariant_with_widths_that_split_threads_inside_a_vector():
    """stories260k's MLP is 172 wide: at 2 threads an elementwise op's per-thread chunk used to end
    inside a vector at a row that depended on the pass's length (rows 152-153 after a 5-token head gave
    other bits). Passes are now a whole number of rows per chunk (``exact_row_multiple``)."""
    from ragkv.model.forward import exact_row_multiple
    from tests.helpers import stories_model

    m = stories_model()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert exact_row_multiple(m) == 32  # 172 * 32 = 43 whole 128-element blocks (2 threads x 64)
        ids = _ids(m, 300, seed=52)
        whole = exact_forward(m, ids)
        for split in (5, 17, 130):
            head = exact_forward(m, ids[:split])
            rest = exact_forward(m, ids, [(head.k, head.v)])
            assert torch.equal(rest.logits, whole.logits) and torch.equal(rest.k, whole.k), split
    finally:
        torch.set_num_threads(before)


def test_a_request_ends_with_its_prompt_in_the_store_for_the_next_process(tmp_path):
    """A request's end (the decode loop's ``on_finish``) waits for its prompt's pages, so a second
    process on the store, asked right after, finds the prompt (two-process workload of issue 52: the
    writer used to be behind and the second process found part of it)."""
    from ragkv.generate import SamplingParams, generate

    m = _model()
    ids = _ids(m, 4 * PAGE_TOKENS + 3)
    url = str(tmp_path / "kv")
    a = KVTree(store=SlowStore(store_from_url(url), write_delay_s=0.05))
    res = exact_prefill(m, ids, a)
    generate(m, res, SamplingParams(max_new_tokens=2))
    b = KVTree(store=store_from_url(url))  # the other process, asked as soon as the answer is out
    got = exact_prefill(m, ids, b)
    assert got.stats["store_tokens"] == 4 * PAGE_TOKENS
    assert torch.equal(got.logits, exact_prefill(m, ids).logits)
    # a store slower than the wait bounds it: the request ends anyway, the pages follow
    c = KVTree(store=SlowStore(store_from_url(str(tmp_path / "kv2")), write_delay_s=0.5), persist_wait_s=0.1)
    ep = exact_forward(m, ids)
    keys = c.insert(m, ids, 0, ep.k, ep.v)
    assert len(keys) == 4 and not c.wait_persisted(keys)  # 0.1 s: not yet
    assert c.flush() and c.wait_persisted(keys)


def _pooled(monkeypatch):
    """Pool the tiny model's pass buffers too (the default model's are pooled from ~350 tokens)."""
    from ragkv.attention import buffers

    monkeypatch.setattr(buffers, "MIN_POOLED_BYTES", 0)
    return buffers.KV_BUFFERS


def test_a_chat_turn_appends_to_the_previous_turns_rows_in_place(monkeypatch):
    """The answer's commit extends the prompt's own pass buffer and the next turn claims it back: no copy
    of the cached prefix out of the tree, and still full prefill's bits."""
    from ragkv.generate import SamplingParams, generate

    pool = _pooled(monkeypatch)
    m = _model()
    tree = KVTree()
    prompt = _ids(m, 70)
    res = exact_prefill(m, prompt, tree)
    address = res.kv.k.data_ptr()
    gen = generate(m, res, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    del res  # the request is over: its buffers are free, and keep the prompt + answer rows
    claimed = pool.claimed
    turn2 = prompt + gen.token_ids + _ids(m, 20, seed=4)
    got = exact_prefill(m, turn2, tree)
    assert pool.claimed == claimed + 2 and got.kv.k.data_ptr() == address  # K and V found again
    assert got.stats["cached_tokens"] == len(prompt) + 6
    full = exact_prefill(m, turn2)
    assert torch.equal(got.logits, full.logits)
    assert torch.equal(got.kv.k, full.kv.k) and torch.equal(got.kv.v, full.kv.v)


def test_kept_rows_in_use_or_written_since_are_not_used(monkeypatch):
    """A buffer another request still views is not claimed (the rows it reads stay as they were); one
    whose kept rows were written since is claimed but not used (the guard): full prefill's bits."""
    pool = _pooled(monkeypatch)
    m = _model()
    tree = KVTree()
    ids = _ids(m, 120)
    first = exact_prefill(m, ids[:80], tree)
    before = first.kv.k.clone()
    claimed = pool.claimed
    second = exact_prefill(m, ids[:100], tree)  # `first` still views its buffer: not claimed
    assert pool.claimed == claimed and torch.equal(first.kv.k, before)
    assert torch.equal(second.logits, exact_prefill(m, ids[:100]).logits)
    pool.whole(second.kv.k)[:, 0] += 1.0  # a writer that broke the contract
    del first, second
    third = exact_prefill(m, ids, tree)
    assert pool.claimed == claimed + 2  # found by its tag, then refused by the guard
    full = exact_prefill(m, ids)
    assert torch.equal(third.logits, full.logits) and torch.equal(third.kv.k, full.kv.k)


def test_a_turn_sent_during_the_previous_answers_commit_waits_for_it(monkeypatch):
    """Back to back on two workers: the next turn starts while the answer's commit is under way; it
    waits for that pass and reuses its rows instead of computing them beside it (same bits either way)."""
    import threading

    from ragkv.blend import exact

    m = _model()
    tree = KVTree()
    prompt, answer = _ids(m, 60), _ids(m, 12, seed=5)
    exact_prefill(m, prompt, tree)
    started, proceed = threading.Event(), threading.Event()
    real = exact.exact_forward

    def gated(model, ids, *a, **kw):  # the commit's pass pauses until the next turn is waiting
        if len(ids) == len(prompt) + len(answer):
            started.set()
            assert proceed.wait(30)
        return real(model, ids, *a, **kw)

    monkeypatch.setattr(exact, "exact_forward", gated)
    committer = threading.Thread(target=exact.commit, args=(m, tree, prompt, answer))
    committer.start()
    assert started.wait(30)
    turn2 = prompt + answer + _ids(m, 9, seed=6)
    got: dict = {}
    follower = threading.Thread(target=lambda: got.setdefault("r", exact_prefill(m, turn2, tree)))
    follower.start()
    follower.join(0.5)
    assert follower.is_alive()  # waiting for the commit, not computing beside it
    proceed.set()
    committer.join(30)
    follower.join(30)
    res = got["r"]
    assert res.stats["cached_tokens"] == len(prompt) + len(answer)
    assert torch.equal(res.logits, exact_prefill(m, turn2).logits)
