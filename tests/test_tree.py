"""EAGLE-2 tree construction against hand-worked cases (Figure 7 of the paper)."""

import math
import random

import torch

from vocabspec.speculation.tree import TreeBuilder, chain, graft

WORDS = ["It", "is", "has", "a", "the", "to", "good", "nice", "be", "do"]
ID = {w: i for i, w in enumerate(WORDS)}


def lp(*probs):
    return torch.tensor([[math.log(p) for p in probs]])


def ids(*words):
    return torch.tensor([[ID[w] for w in words]])


def figure7_builder(total_tokens=7, expanded=("a", "to")):
    b = TreeBuilder(ID["It"], top_k=2, total_tokens=total_tokens)
    b.add_children([0], ids("is", "has"), lp(0.6, 0.2))
    frontier = b.frontier()
    assert [WORDS[b.token[i]] for i in frontier] == ["is", "has"]
    b.add_children(frontier, torch.cat([ids("a", "the"), ids("to", "a")]),
                   torch.cat([lp(0.8, 0.1), lp(0.7, 0.1)]))
    frontier = b.frontier()
    # values: a 0.48, the 0.06, to 0.14, a 0.02 -> expand "a" (0.48) and "to" (0.14)
    assert [WORDS[b.token[i]] for i in frontier] == list(expanded)
    children = {"a": (ids("good", "nice"), lp(0.7, 0.1)), "to": (ids("be", "do"), lp(0.6, 0.2))}
    b.add_children(frontier, torch.cat([children[w][0] for w in expanded]),
                   torch.cat([children[w][1] for w in expanded]))
    return b


def test_figure7_values():
    b = figure7_builder()
    values = sorted((WORDS[b.token[i]], b.depth[i], round(math.exp(b.value[i]), 4))
                    for i in range(1, len(b.token)))
    assert values == sorted([("is", 1, 0.6), ("has", 1, 0.2), ("a", 2, 0.48), ("the", 2, 0.06),
                             ("to", 2, 0.14), ("a", 2, 0.02), ("good", 3, 0.336), ("nice", 3, 0.048),
                             ("be", 3, 0.084), ("do", 3, 0.028)])


def test_figure7_rerank_flatten_and_mask():
    tree = figure7_builder().build()
    assert [WORDS[t] for t in tree.tokens.tolist()] == ["It", "is", "has", "a", "the", "to", "good", "be"]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103, 103]
    paths = {tuple(p for p in row if p >= 0) for row in tree.leaf_paths().tolist()}
    assert paths == {(0, 1, 3, 6), (0, 1, 4), (0, 2, 5, 7)}
    assert tree.children[1] == [3, 4]   # "a" (0.8) before "the" (0.1): draft order


def test_smaller_budget_keeps_best_nodes():
    # With 3 tokens, "to" (0.14) is beaten by is, a and has already: it is not expanded.
    tree = figure7_builder(total_tokens=3, expanded=("a",)).build()
    assert [WORDS[t] for t in tree.tokens.tolist()] == ["It", "is", "a", "good"]


def test_ties_prefer_shallower_nodes_and_stay_connected():
    b = TreeBuilder(0, top_k=2, total_tokens=2)
    b.add_children([0], torch.tensor([[1, 2]]), torch.tensor([[0.0, math.log(0.5)]]))
    b.add_children([1], torch.tensor([[3, 4]]), torch.tensor([[0.0, -5.0]]))
    # Node 3 ties with its parent (value 1.0): the parent must come first.
    tree = b.build()
    assert tree.tokens.tolist() == [0, 1, 3]
    b = TreeBuilder(0, top_k=2, total_tokens=1)
    b.add_children([0], torch.tensor([[1, 2]]), torch.tensor([[0.0, -1.0]]))
    b.add_children([1], torch.tensor([[3, 4]]), torch.tensor([[0.0, -1.0]]))
    assert b.build().tokens.tolist() == [0, 1]


def test_random_trees_are_connected():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        b = TreeBuilder(0, top_k=3, total_tokens=int(torch.randint(1, 30, (1,), generator=g)))
        b.add_children([0], torch.arange(3)[None], torch.rand(1, 3, generator=g).log())
        for _ in range(4):
            f = b.frontier()
            b.add_children(f, torch.randint(0, 50, (len(f), 3), generator=g),
                           torch.rand(len(f), 3, generator=g).log())
        tree = b.build()
        parents = tree.parents.tolist()
        assert all(0 <= parents[i] < i for i in range(1, len(parents)))
        assert tree.depths.tolist() == sorted(tree.depths.tolist())


def graft_chain(tree, path):
    """The eager loop's graft: (tree with `path` grafted, rows added)."""
    grafted = graft(tree, torch.tensor(path), torch.tensor(len(path))).compact()
    return grafted, grafted.size - tree.size


def test_chain_tree():
    tree = chain(5, [6, 7])
    assert tree.parents.tolist() == [-1, 0, 1] and tree.ranks.tolist() == [-1, 0, 1]
    assert torch.equal(tree.attention_mask(), torch.ones(3, 3, dtype=torch.bool).tril())


def test_graft_chain_shares_the_existing_prefix_and_appends_the_rest():
    tree = figure7_builder().build()            # It -> is -> a -> good ...
    words = [WORDS[t] for t in tree.tokens.tolist()]
    grafted, added = graft_chain(tree, [ID["is"], ID["a"], ID["be"], ID["do"]])
    assert added == 2                            # "is a" is already there
    tokens, parents = grafted.tokens.tolist(), grafted.parents.tolist()
    assert tokens[:len(words)] == tree.tokens.tolist()
    be, do = len(words), len(words) + 1
    assert [WORDS[tokens[be]], WORDS[tokens[do]]] == ["be", "do"]
    assert WORDS[tokens[parents[be]]] == "a" and WORDS[tokens[parents[parents[be]]]] == "is"
    assert parents[do] == be and grafted.children[be] == [do]
    assert grafted.depths[be] == 3 and grafted.depths[do] == 4
    assert grafted.ranks[be:].tolist() == [-1, -1]
    # The mask lets the new nodes see exactly their ancestors.
    mask = grafted.attention_mask()
    assert mask[do].nonzero().flatten().tolist() == sorted(grafted.path_to(do))
    # Siblings stay distinct; a chain the tree already holds adds nothing.
    for kids in grafted.children:
        assert len({tokens[k] for k in kids}) == len(kids)
    same, added = graft_chain(tree, [ID["is"], ID["a"]])
    assert added == 0 and torch.equal(same.tokens, tree.tokens) and torch.equal(same.parents, tree.parents)
    fresh, added = graft_chain(tree, [ID["do"]])  # a new child of the root, tried last
    assert added == 1 and fresh.children[0][-1] == len(words)


def _draft(builder: TreeBuilder, depth: int, k: int) -> TreeBuilder:
    """Grow a tree as the drafter does, children drawn from a fixed function of each node's path."""
    def children(node):
        path = []
        while node != -1:
            path.append(builder.token[node])
            node = builder.parent[node]
        rng = random.Random(str(path))
        probs = sorted((rng.random() ** 3 for _ in range(k)), reverse=True)
        return [rng.randrange(1000) for _ in range(k)], [math.log(p / (sum(probs) + 0.1)) for p in probs]

    def expand(parents):
        rows = [children(p) for p in parents]
        builder.add_children(parents, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))

    expand([0])
    calls = 0
    for _ in range(depth):
        frontier = builder.frontier()
        if not frontier:
            break
        calls += len(frontier)
        expand(frontier)
    builder.rows_drafted = calls
    return builder


def test_pruned_frontier_builds_the_same_tree_with_fewer_rows():
    saved = 0
    for seed in range(40):
        total = random.Random(seed).choice([4, 8, 16, 30, 60])
        pruned = _draft(TreeBuilder(seed, 6, total), depth=5, k=6)
        full = TreeBuilder(seed, 6, 10**9)              # no node can be ruled out
        _draft(full, depth=5, k=6)
        full.total_tokens = total
        a, b = pruned.build(), full.build()
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert pruned.rows_drafted <= full.rows_drafted
        saved += full.rows_drafted - pruned.rows_drafted
    assert saved > 0


def test_ancestor_mask_is_each_nodes_path_whatever_the_roots_convention():
    from vocabspec.runtime.kv_cache import ancestor_mask

    generator = torch.Generator().manual_seed(5)
    for n in (1, 2, 7, 40):
        parents = [-1] + [int(torch.randint(i, (1,), generator=generator)) for i in range(1, n)]
        want = torch.zeros(n, n, dtype=torch.bool)
        depth = [0] * n
        for i in range(n):
            node = i
            while node >= 0:
                want[i, node] = True
                node = parents[node]
            depth[i] = depth[parents[i]] + 1 if i else 0
        as_tensor = torch.tensor(parents)
        assert torch.equal(ancestor_mask(as_tensor), want)
        assert torch.equal(ancestor_mask(as_tensor.clamp_min(0), max(depth)), want)   # root its own parent
        if max(depth) > 1:          # a bound below the depth misses the deepest ancestors
            assert not torch.equal(ancestor_mask(as_tensor, max(depth) // 2 - 1 if max(depth) > 3 else 0), want)
