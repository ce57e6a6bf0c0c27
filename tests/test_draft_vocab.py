"""Draft-vocabulary strategies and token-map files: ids map back to the target vocabulary,
an exact ranker reproduces the full head, files round-trip, bad files are refused."""

import pytest
import torch

from vocabspec.speculation.vocab.draft_vocab import (FullVocab, SpecVocab, StaticSubset, make_draft_vocab,
                                               parse_draft_vocab)
from vocabspec.speculation.vocab.draft_vocab import load_ranker, save_ranker
from vocabspec.training.ranker import svd_init
from vocabspec.speculation.vocab.token_map import (eagle3_tensors, load_successors, load_token_map, rank,
                                                   save_eagle3, save_successors, save_token_map, successor_lists)

torch.manual_seed(0)
HEAD = torch.randn(500, 16)
STATES = torch.randn(7, 16)


def test_parse_draft_vocab():
    assert parse_draft_vocab("full") == ("full", None)
    assert parse_draft_vocab("fr:32k") == ("fr", 32768)
    assert parse_draft_vocab("trim:8000") == ("trim", 8000)
    assert parse_draft_vocab("spec:2048") == ("spec", 2048)
    for bad in ("", "fr", "fr:", "fr:0", "fr:-3", "fr:abc", "bogus:12", "full:3"):
        with pytest.raises(ValueError):
            parse_draft_vocab(bad)


def test_static_subset_maps_back_to_target_ids():
    ids = torch.randperm(500)[:120]
    tokens, log_probs = StaticSubset(HEAD, ids).top_k(STATES, 5)
    logits = STATES @ HEAD[ids].T
    expected = ids[torch.topk(logits, 5).indices]
    assert torch.equal(tokens, expected)
    assert torch.allclose(log_probs, torch.topk(torch.log_softmax(logits, -1), 5).values, atol=1e-5)
    assert set(tokens.flatten().tolist()) <= set(ids.tolist())


def test_static_subset_rejects_bad_lists():
    for bad in (torch.tensor([1, 2, 2]), torch.tensor([0, 500]), torch.tensor([-1]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError):
            StaticSubset(HEAD, bad)


def test_full_rank_ranker_reproduces_full_head():
    # A ranker equal to the head itself (rank = d) must pick the true top tokens of one row.
    spec = SpecVocab(HEAD, torch.eye(16), HEAD.clone(), candidates=64)
    one_row, _ = spec.top_k(STATES[:1], 5)
    assert torch.equal(one_row, FullVocab(HEAD).top_k(STATES[:1], 5)[0])
    # A tree level's rows are siblings with nearby states: one shared set serves them all.
    siblings = STATES[:1] + 0.05 * torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(spec.top_k(siblings, 5)[0], FullVocab(HEAD).top_k(siblings, 5)[0])
    assert {"rank", "head", "topk"} <= set(spec.timings)


def test_a_tree_level_shares_the_candidates_of_its_mean_state():
    spec = SpecVocab(HEAD, torch.eye(16), HEAD.clone(), candidates=64)
    ids = spec.candidate_ids(STATES)
    assert ids.numel() == 64 and ids.unique().numel() == 64
    mean_scores = STATES.mean(0) @ HEAD.T
    assert set(torch.topk(mean_scores, 32).indices.tolist()) <= set(ids.tolist())
    # Each row's draft tokens come from that set, with the exact head's log-probabilities
    # over it.
    tokens, log_probs = spec.top_k(STATES, 5)
    assert set(tokens.flatten().tolist()) <= set(ids.tolist())
    exact = torch.log_softmax(STATES @ HEAD[ids].T, dim=-1)
    assert torch.allclose(log_probs, torch.topk(exact, 5).values, atol=1e-4)


def test_deeper_levels_draft_from_the_roots_candidates_and_their_successors():
    down, vocab = svd_init(HEAD, 2)               # a weak ranker: rank 2
    # Every token's usual successor: the next id (offsets/ids as token_map.successor_lists makes).
    successors = (torch.arange(501), (torch.arange(500) + 1) % 500)
    shared = SpecVocab(HEAD, down, vocab, candidates=16, context_tokens=0, successors=successors,
                       successor_count=1)
    per_level = SpecVocab(HEAD, down, vocab, candidates=16, context_tokens=0, successors=successors,
                          successor_count=1, shared_levels=0)
    root_tokens, _ = shared.top_k(STATES[:1], 5, [7], level=0)
    root_ids = set(shared.candidate_ids(STATES[:1], [7]).tolist())
    assert set(root_tokens.flatten().tolist()) <= root_ids
    # Level 1 ranks nothing: its rows see the root's candidates plus their tokens' successors
    # (each once), with the exact head's log-probabilities over that set.
    read = [3, 3, 480]
    tokens, log_probs = shared.top_k(STATES[1:4], 5, read, level=1)
    allowed = sorted(root_ids | {4, 481})
    exact = torch.log_softmax(STATES[1:4] @ HEAD[allowed].T, dim=-1)
    assert torch.allclose(log_probs, torch.topk(exact, 5).values, atol=1e-4)
    assert torch.equal(tokens, torch.tensor(allowed)[torch.topk(exact, 5).indices])
    assert all(row.unique().numel() == 5 for row in tokens)
    # A new tree ranks afresh at its root, and the paper's per-level ranking is still there.
    shared.top_k(STATES[4:5], 5, [9], level=0)
    assert set(shared.top_k(STATES[5:6], 16, [0], level=1)[0].flatten().tolist()) <= \
        set(shared.candidate_ids(STATES[4:5], [9]).tolist()) | {1}
    per_level.top_k(STATES[:1], 5, [7], level=0)
    own = set(per_level.candidate_ids(STATES[1:4], read).tolist())
    assert set(per_level.top_k(STATES[1:4], 5, read, level=1)[0].flatten().tolist()) <= own
    with pytest.raises(ValueError, match="shared levels"):
        SpecVocab(HEAD, down, vocab, candidates=16, shared_levels=-1)


def test_svd_ranker_recall_is_high_for_the_top_token():
    down, vocab = svd_init(HEAD, 8)
    spec = SpecVocab(HEAD, down, vocab, candidates=100)
    ids = spec.candidate_ids(STATES[:1])
    assert int(FullVocab(HEAD).top_k(STATES[:1], 1)[0]) in ids.tolist()


def test_token_map_round_trips(tmp_path):
    ids = torch.randperm(500)[:64].tolist()
    save_token_map(ids, tmp_path / "map.pt")
    assert load_token_map(tmp_path / "map.pt", 500).tolist() == ids
    assert isinstance(torch.load(tmp_path / "map.pt"), list)  # SGLang's format: a plain list
    save_eagle3(ids, 500, tmp_path / "d2t.safetensors")
    back = load_token_map(tmp_path / "d2t.safetensors", 500).tolist()
    assert back == sorted(ids)
    t = eagle3_tensors(ids, 500)
    assert t["t2d"].sum() == 64 and t["t2d"][ids].all()
    assert torch.equal(torch.arange(64) + t["d2t"], torch.tensor(sorted(ids)))


def test_bad_token_maps_are_refused(tmp_path):
    save_token_map([1, 2, 900], tmp_path / "big.pt")
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_token_map(tmp_path / "big.pt", 500)
    save_token_map([1, 2, 2], tmp_path / "dup.pt")
    with pytest.raises(ValueError, match="twice"):
        load_token_map(tmp_path / "dup.pt", 500)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="unreadable"):
        load_token_map(tmp_path / "junk.pt", 500)
    with pytest.raises(FileNotFoundError):
        load_token_map(tmp_path / "missing.pt", 500)


def test_make_draft_vocab_explains_missing_files(tmp_path):
    with pytest.raises(ValueError, match="token map"):
        make_draft_vocab("fr:16", HEAD, tmp_path)
    with pytest.raises(ValueError, match="ranker"):
        make_draft_vocab("spec:16", HEAD, tmp_path)
    save_token_map(list(range(40)), tmp_path / "token_map_fr.pt")
    strategy = make_draft_vocab("fr:16", HEAD, tmp_path)
    assert strategy.size == 16
    with pytest.raises(ValueError, match="ranks only 40"):
        make_draft_vocab("fr:64", HEAD, tmp_path)


def test_ranker_file_must_fit_the_head(tmp_path):
    down, vocab = svd_init(HEAD, 4)
    save_ranker(down, vocab, tmp_path / "r.safetensors")
    d, v = load_ranker(tmp_path / "r.safetensors", HEAD)
    assert d.shape == (4, 16) and v.shape == (500, 4)
    with pytest.raises(ValueError, match="another model"):
        load_ranker(tmp_path / "r.safetensors", torch.randn(300, 16))


def test_rank_orders_by_count_then_fallback():
    from collections import Counter

    assert rank(Counter({5: 3, 2: 3, 7: 9}), 10, fallback=[9, 5])[:5] == [7, 2, 5, 9, 0]


def test_hits_in_top_counts_rows_whose_token_is_ranked_within_k():
    from vocabspec.training.ranker import hits_in_top

    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.6, 0.4], [0.1, 0.2, 0.3, 0.4]])
    tokens = torch.tensor([2, 1, 0])          # ranks 2nd, 1st and 4th in their rows
    assert hits_in_top(scores, tokens, [1, 2, 3, 4]) == {1: 1, 2: 2, 3: 2, 4: 3}


def test_two_pass_top_ids_find_the_same_scores_as_topk():
    from vocabspec.speculation.vocab.draft_vocab import top_ids

    generator = torch.Generator().manual_seed(0)
    # Sizes on both paths: two passes (262144 / 8 columns >= 16 k) and a plain top-k.
    for rows, size, k in ((1, 262144, 2048), (3, 65536, 100), (1, 1000, 7), (1, 4096, 64),
                          (2, 64, 16), (1, 96, 20)):
        scores = torch.randn(rows, size, generator=generator)
        ids = top_ids(scores, k)
        assert ids.shape == (rows, k)
        assert torch.equal(scores.gather(1, ids).sort(-1).values,
                           torch.topk(scores, k, dim=-1).values.sort(-1).values)
        assert all(row.unique().numel() == k for row in ids)


def test_spec_vocab_keeps_the_texts_own_tokens_among_its_candidates():
    down, vocab = svd_init(HEAD, 1)               # a weak ranker: rank 1
    ranked_only = SpecVocab(HEAD, down, vocab, candidates=8, context_tokens=0)
    outside = [t for t in range(500) if t not in ranked_only.candidate_ids(STATES[:1]).tolist()]
    spec = SpecVocab(HEAD, down, vocab, candidates=8, context_tokens=4)
    spec.see_tokens(outside[:3], reset=True)
    ids = spec.candidate_ids(STATES[:1]).tolist()
    assert len(ids) == 8 and set(outside[:3]) <= set(ids)
    # Only the most recently seen distinct tokens, at most context_tokens of them.
    spec.see_tokens(outside[3:6] + [outside[0]])
    assert spec.context_ids().tolist() == outside[3:6] + [outside[0]]
    assert set(spec.context_ids().tolist()) <= set(spec.candidate_ids(STATES[:1]).tolist())
    spec.see_tokens([], reset=True)               # a new text forgets the old one
    assert torch.equal(spec.candidate_ids(STATES[:1]).sort().values,
                       ranked_only.candidate_ids(STATES[:1]).sort().values)
    ranked_only.see_tokens(outside[:3], reset=True)
    assert not set(outside[:3]) & set(ranked_only.candidate_ids(STATES[:1]).tolist())
    with pytest.raises(ValueError, match="context tokens"):
        SpecVocab(HEAD, down, vocab, candidates=8, context_tokens=9)


def test_spec_options_are_named_parsed_and_checked(tmp_path):
    from vocabspec.speculation.vocab.draft_vocab import DEFAULT_SUCCESSORS, SpecVocabOptions, spec_options

    assert parse_draft_vocab("spec:2k,context=0") == ("spec", 2048)
    assert spec_options("spec:2048") == SpecVocabOptions()
    assert spec_options("spec:2048,context=128") == SpecVocabOptions(context=128)
    assert spec_options("spec:2048,successors=4,context=128,levels=0") == SpecVocabOptions(128, 4, 0)
    for bad in ("spec:2048:128", "spec:2048,", "spec:2048,context", "spec:2048,context=x",
                "spec:2048,context=-1", "spec:2048,depth=2", "spec:2048,context=1,context=2"):
        with pytest.raises(ValueError):
            parse_draft_vocab(bad)
    with pytest.raises(ValueError, match="named"):     # the old positional form says what changed
        parse_draft_vocab("spec:2048:128:4")
    save_ranker(*svd_init(HEAD, 4), tmp_path / "ranker.safetensors")
    assert make_draft_vocab("spec:16", HEAD, tmp_path).context_tokens == 8
    assert make_draft_vocab("spec:16,context=0", HEAD, tmp_path).name == "spec:16,context=0"
    with pytest.raises(ValueError, match="exceed"):
        make_draft_vocab("spec:16,context=20", HEAD, tmp_path)
    # Successors: none without a table (and asking for them is an error), 16 by default with one.
    assert make_draft_vocab("spec:16", HEAD, tmp_path).successor_count == 0
    with pytest.raises(ValueError, match="successor table"):
        make_draft_vocab("spec:16,context=8,successors=4", HEAD, tmp_path)
    save_successors(*successor_lists([[1, 2, 3, 1, 2]], 500, 4), tmp_path / "successors.safetensors")
    assert make_draft_vocab("spec:16", HEAD, tmp_path).successor_count == DEFAULT_SUCCESSORS
    ranker_alone = make_draft_vocab("spec:16,context=0,successors=0", HEAD, tmp_path)
    assert (ranker_alone.context_tokens, ranker_alone.successor_count) == (0, 0)
    assert make_draft_vocab("spec:16,successors=3", HEAD, tmp_path).successor_count == 3
    per_level = make_draft_vocab("spec:16,successors=3,levels=0", HEAD, tmp_path)
    assert per_level.shared_levels == 0
    assert make_draft_vocab("spec:16", HEAD, tmp_path).shared_levels is None


def test_successor_lists_rank_each_tokens_followers_by_count(tmp_path):
    texts = [[1, 2, 1, 2, 1, 3], [1, 3, 1, 3, 4]]   # 1->3 three times, 1->2 twice, 3->1 and 3->4 once
    offsets, ids = successor_lists(texts, 5, width=2)
    rows = [ids[offsets[t]:offsets[t + 1]].tolist() for t in range(5)]
    assert rows == [[], [3, 2], [1], [1, 4], []]        # ties: lower id first
    offsets, ids = successor_lists(texts, 5, width=1)
    assert [ids[offsets[t]:offsets[t + 1]].tolist() for t in range(5)] == [[], [3], [1], [1], []]
    save_successors(offsets, ids, tmp_path / "s.safetensors")
    loaded = load_successors(tmp_path / "s.safetensors", 5)
    assert torch.equal(loaded[0], offsets) and torch.equal(loaded[1], ids.long())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        successor_lists([[1, 7]], 5, width=2)
    with pytest.raises(ValueError, match="another model"):
        load_successors(tmp_path / "s.safetensors", 6)
    save_successors(torch.tensor([0, 1, 0, 1, 1, 1]), torch.tensor([2]), tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="corrupt"):
        load_successors(tmp_path / "bad.safetensors", 5)
    save_successors(torch.tensor([0, 1, 1, 1, 1, 1]), torch.tensor([9]), tmp_path / "far.safetensors")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        load_successors(tmp_path / "far.safetensors", 5)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="unreadable"):
        load_successors(tmp_path / "junk.safetensors", 5)
    with pytest.raises(FileNotFoundError):
        load_successors(tmp_path / "none.safetensors", 5)


def test_spec_vocab_adds_the_successors_of_each_rows_token():
    down, vocab = svd_init(HEAD, 1)               # a weak ranker: rank 1
    ranked_only = SpecVocab(HEAD, down, vocab, candidates=12, context_tokens=0)
    outside = [t for t in range(500) if t not in ranked_only.candidate_ids(STATES[:2]).tolist()]
    # Token 0 is followed by outside[0..2] (most often first), token 1 by outside[3].
    texts = [[0, outside[0]]] * 3 + [[0, outside[1]]] * 2 + [[0, outside[2]], [1, outside[3]]]
    table = successor_lists(texts, 500, width=8)
    spec = SpecVocab(HEAD, down, vocab, candidates=12, context_tokens=0, successors=table, successor_count=2)
    ids = spec.candidate_ids(STATES[:1], [0]).tolist()
    assert len(ids) == 12 and set(outside[:2]) <= set(ids) and outside[2] not in ids
    # A tree level: the successors of every row's token.
    level = spec.candidate_ids(STATES[:2], [0, 1]).tolist()
    assert set(outside[:2] + [outside[3]]) <= set(level)
    # No tokens given (or a token nothing follows): the ranker's candidates alone.
    for tokens in (None, [5]):
        assert torch.equal(spec.candidate_ids(STATES[:1], tokens).sort().values,
                           ranked_only.candidate_ids(STATES[:1]).sort().values)
    # The drafted tokens are the exact head's best over that candidate set.
    tokens, log_probs = spec.top_k(STATES[:1], 3, [0])
    candidates = torch.tensor(ids)
    logits = STATES[:1] @ HEAD[candidates].T
    assert torch.equal(tokens.sort().values, candidates[logits.topk(3).indices].sort().values)
    torch.testing.assert_close(log_probs.sort().values, (logits - logits.logsumexp(-1, keepdim=True)).topk(3).values.sort().values)
    with pytest.raises(ValueError, match="successor table"):
        SpecVocab(HEAD, down, vocab, successor_count=2)
