"""The tree-size chooser rests on one property: the tree of the best m nodes is exactly the
nodes of value rank < m of a larger tree, so accepted lengths at any m follow from one run."""

import random

import torch

from vocabspec.autotune import accept_length_at
from vocabspec.tree import TreeBuilder


def grow(total, seed):
    rng = random.Random(seed)
    builder = TreeBuilder(root_token=0, top_k=3, total_tokens=total)
    token = iter(range(1, 10_000))
    builder.add_children([0], torch.tensor([[next(token) for _ in range(3)]]),
                         torch.tensor([[rng.choice([-0.1, -0.5, -1.0, -2.0]) for _ in range(3)]]))
    for _ in range(3):
        frontier = builder.frontier()
        builder.add_children(frontier, torch.tensor([[next(token) for _ in range(3)] for _ in frontier]),
                             torch.tensor([[rng.choice([-0.1, -0.5, -1.0, -2.0]) for _ in range(3)]
                                           for _ in frontier]))
    return builder.build()


def test_smaller_tree_is_the_low_ranked_part_of_a_larger_one():
    for seed in range(20):
        big = grow(30, seed)
        for m in (1, 4, 9, 17):
            small = grow(m, seed)
            kept = {int(big.tokens[i]) for i, r in enumerate(big.ranks) if 0 <= r < m}
            assert set(small.tokens[1:].tolist()) == kept
            # every kept node's parent is kept (a connected tree)
            for i, r in enumerate(big.ranks):
                if 0 <= r < m and big.parents[i] > 0:
                    assert big.ranks[int(big.parents[i])] < m


def test_accept_length_at():
    assert accept_length_at((0, 3, 7), 64) == 4
    assert accept_length_at((0, 3, 7), 5) == 3
    assert accept_length_at((0, 3, 7), 1) == 2
    assert accept_length_at((), 8) == 1
