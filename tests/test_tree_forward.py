"""A tree-masked forward of k tokens equals k sequential forwards; committing a path keeps
exactly the right KV entries."""

import pytest
import torch

from vocabspec.speculation.tree import TreeBuilder

from conftest import tiny_model, forward


def sequential_logits(model, context, path_tokens):
    """Logits after each of path_tokens, fed one at a time after context."""
    cache = model.new_cache()
    forward(model, torch.tensor(context), torch.arange(len(context)), cache)
    cache.commit()
    rows = []
    for token in path_tokens:
        _, logits = forward(model, torch.tensor([token]), torch.tensor([cache.length]), cache)
        cache.commit()
        rows.append(logits[0])
    return torch.stack(rows), cache


def random_tree(vocab, seed, top_k=3, depth=3, total=12):
    g = torch.Generator().manual_seed(seed)
    builder = TreeBuilder(int(torch.randint(vocab, (1,), generator=g)), top_k, total)
    builder.add_children([0], torch.randperm(vocab, generator=g)[:top_k][None],
                         torch.rand(1, top_k, generator=g).log())
    for _ in range(depth):
        frontier = builder.frontier()
        tokens = torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in frontier])
        builder.add_children(frontier, tokens, torch.rand(len(frontier), top_k, generator=g).log())
    return builder.build()


def check_tree_against_sequential(model, context, tree, atol):
    cache = model.new_cache()
    forward(model, torch.tensor(context), torch.arange(len(context)), cache)
    cache.commit()
    _, tree_logits = forward(model, tree.tokens, tree.positions(cache.length), cache,
                           tree_mask=tree.attention_mask(), all_logits=True)
    for path in tree.leaf_paths().tolist():
        path = [i for i in path if i >= 0]
        seq, _ = sequential_logits(model, context, tree.tokens[path].tolist())
        torch.testing.assert_close(tree_logits[path], seq, atol=atol, rtol=0)
    # Commit the deepest path; decoding on must equal decoding that path sequentially.
    path = max((p for p in tree.leaf_paths().tolist()), key=lambda p: sum(i >= 0 for i in p))
    path = [i for i in path if i >= 0]
    cache.commit(torch.tensor(path))
    seq_logits, seq_cache = sequential_logits(model, context, tree.tokens[path].tolist() + [5])
    _, after = forward(model, torch.tensor([5]), torch.tensor([cache.length]), cache)
    torch.testing.assert_close(after[0], seq_logits[-1], atol=atol, rtol=0)
    assert cache.length == seq_cache.length - 1


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_tiny_models(arch, seed):
    # Gemma's tiny window (6) is shorter than context + tree, so sliding layers are exercised.
    model = tiny_model(arch, seed)
    context = torch.randint(0, 97, (11 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    check_tree_against_sequential(model, context, random_tree(97, seed), atol=1e-4)


def test_tree_forward_real_models(real_model):
    context = real_model.prompt_ids("Describe a sunrise over the sea.")
    check_tree_against_sequential(real_model.model, context, random_tree(5000, 7), atol=2e-3)


def test_cache_overflow_is_refused():
    model = tiny_model("llama", max_seq_len=16)
    cache = model.new_cache()
    with pytest.raises(ValueError, match="max_seq_len|cache"):
        forward(model, torch.arange(20), torch.arange(20), cache)


@pytest.mark.parametrize("head_rows", [1, 3, 100])
def test_tree_logits_scores_the_likely_path_first_and_the_rest_when_reached(head_rows):
    from vocabspec.speculation.verify import TreeLogits, Verdict, greedy_verdict

    model = tiny_model("llama", 3)
    context = list(range(3, 14))
    cache = model.new_cache()
    forward(model, torch.tensor(context), torch.arange(len(context)), cache)
    cache.commit()
    tree = random_tree(97, 3)
    hidden, every = forward(model, tree.tokens, tree.positions(cache.length), cache,
                          tree_mask=tree.attention_mask(), all_logits=True)
    scored = []
    head = lambda rows: scored.append(rows.shape[0]) or model.lm_head(rows)  # noqa: E731
    lazy = TreeLogits(head, hidden, tree, head_rows=head_rows)
    # The first batch: the root, its first child, that child's first child..., then the other
    # rows in order, head_rows in all.
    chain = [0]
    while len(chain) < head_rows and tree.children[chain[-1]]:
        chain.append(tree.children[chain[-1]][0])
    first = chain + [i for i in range(tree.tokens.numel()) if i not in chain][:head_rows - len(chain)]
    assert sorted(lazy.rows) == sorted(first) and scored == [len(first)]
    outside = next((i for i in range(tree.tokens.numel()) if i not in lazy.rows), None)
    assert (outside is None) == (head_rows >= tree.tokens.numel())
    if outside is not None:
        torch.testing.assert_close(lazy[outside], every[outside])   # scored when reached
        assert len(scored) == 2 and 1 <= scored[-1] <= head_rows
    for node in range(tree.tokens.numel()):
        torch.testing.assert_close(lazy[node], every[node])
    # Greedy verification over every row's logits is the argmax walk from the root.
    node, path = 0, [0]
    while True:
        best = int(every[node].argmax())
        node = next((c for c in tree.children[node] if int(tree.tokens[c]) == best), None)
        if node is None:
            break
        path.append(node)
    assert greedy_verdict(tree, every) == Verdict(path, best)
