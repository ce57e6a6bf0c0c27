"""Greedy steps a CUDA graph can capture (graph_step.py), on the CPU: they emit plain
decoding's tokens in float32 on both models (Gemma's sliding window narrowed so that it cuts),
every step of a generation runs the same operations on the same shapes and keeps its state in
the same tensors (what replaying a captured graph needs), no operation reads the device back or
has a data-dependent shape, and a generation reads the device back once a step (counted by
wrapping every way a tensor reaches the host)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer, EagleGraphDrafting
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.hybrid import EagleLookupProposer
from vocabspec.speculation.families.medusa import MedusaHeads, MedusaProposer, bundled_medusa_dir
from vocabspec.speculation.families.pld import PromptLookupProposer
from vocabspec.speculation.config import bundled_drafter_dir
from vocabspec.decoding.graph_step import GraphDecoder, count_read_backs

from conftest import Loaded, loaded, spec_bench_prompts

# Operations a captured step may not run: a value handed to the host, an output whose shape
# depends on values, a tensor made from host data.
FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
             "unique_consecutive", "argwhere", "repeat_interleave")


class TorchModel(Loaded):
    """A bundled model on torch's kernels in float32 (the path a GPU takes), and its proposers:
    EAGLE-2 with the full head, Medusa with FR-Spec's 8k head, prompt lookup."""

    def __init__(self, name: str, sliding_window: int | None = None):
        if sliding_window is None:       # the run's shared copy (autotune's tests use it too)
            shared = loaded(name, "f32", "torch")
            self.name, self.model, self.path, self.tokenizer = name, shared.model, shared.path, shared.tokenizer
            return
        super().__init__(name, weights="f32", backend="torch")
        self.model.args.sliding_window = sliding_window

    def proposers(self) -> dict:
        drafter = EagleDrafter.load(bundled_drafter_dir(self.name), self.model)
        heads = MedusaHeads.load(bundled_medusa_dir(self.name), self.model.args)
        fr = make_draft_vocab("fr:8k", self.model.head_weight, bundled_drafter_dir(self.name))
        return {"plain": None, "pld": PromptLookupProposer(),
                "eagle": EagleProposer(drafter, depth=3, top_k=4, total_tokens=10),
                "medusa": MedusaProposer(self.model, heads, fr, total_tokens=16),
                "eagle+pld": EagleLookupProposer(drafter, depth=3, top_k=4, total_tokens=10,
                                                 lookup=PromptLookupProposer(num_draft=6))}


@pytest.fixture(scope="module")
def torch_smollm2():
    return TorchModel("smollm2")


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def torch_model(request, torch_smollm2):
    # Gemma's window narrowed to 48: prompt and answer outgrow it, so the graph cache's
    # distance mask is what keeps old keys out.
    return torch_smollm2 if request.param == "smollm2" else TorchModel("gemma3", sliding_window=48)


def test_graph_steps_emit_plain_decoding(torch_model):
    model, tokenizer = torch_model.model, torch_model.tokenizer
    config = GenerationConfig(max_new_tokens=24)
    vanilla = Engine(model, tokenizer)
    proposers = torch_model.proposers()
    if torch_model.name != "smollm2":      # the graft is the model's business no more than the tree
        del proposers["eagle+pld"]
    engines = {name: Engine(model, tokenizer, proposer, graphs=True, allow_inexact=True)
               for name, proposer in proposers.items()}
    mismatches, steps = [], {name: 0 for name in engines}
    for category, text in spec_bench_prompts()[::6]:
        ids = torch_model.prompt_ids(text[:600])
        want = vanilla.generate(ids, config).tokens
        for name, engine in engines.items():
            assert engine.graphs
            out = engine.generate(ids, config)
            # torch's kernels are not row-invariant (allowed explicitly); float32 ties that
            # close do not occur on these prompts.
            if out.tokens != want:
                mismatches.append((category, name))
            assert 1 + sum(s.accept_length for s in out.steps) >= len(out.tokens)
            steps[name] += len(out.steps)
    assert not mismatches, f"graph steps differ from plain decoding: {mismatches}"
    # Every drafter saves steps over plain decoding's one token each.
    assert all(steps[name] < steps["plain"] for name in engines if name not in ("plain", "pld")), steps


class StepTrace(TorchDispatchMode):
    """Every operation run inside a step, with its outputs' shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.host_made = set()           # tensors made from host data inside the step
        self.host_copies = []            # operations that read one of them into another tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        # Arithmetic may take a 0-dim host tensor as a scalar, but a copy of one into a device
        # tensor is a host-to-device transfer, which CUDA graph capture refuses.
        if name in ("copy_", "index_put_", "index_copy_", "_to_copy", "masked_fill_", "where") and \
                any(id(t) in self.host_made for t in tensors[1:]):
            self.host_copies.append(name)
        out = func(*args, **(kwargs or {}))
        if name.startswith("lift_fresh"):
            self.host_made.add(id(out))
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                       if isinstance(t, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, shapes))
        return out


@pytest.mark.parametrize("method", ["plain", "pld", "eagle", "medusa", "eagle+pld"])
def test_every_step_runs_the_same_work_in_the_same_tensors(torch_smollm2, method, monkeypatch):
    model, tokenizer = torch_smollm2.model, torch_smollm2.tokenizer
    proposer = torch_smollm2.proposers()[method]
    engine = Engine(model, tokenizer, proposer, graphs=True, allow_inexact=True)
    traces, buffers, host_copies = {}, [], []
    step = GraphDecoder._step

    def traced(decoder, draft):
        buffers.append([t.data_ptr() for t in decoder._state()] + [decoder.cache.keys.data_ptr()])
        with StepTrace() as trace:
            out = step(decoder, draft)
        # One captured graph per (drafting, rows): eagle+pld's copy mode is a second shape.
        traces.setdefault((draft, decoder.rows(draft)), []).append(trace.ops)
        host_copies.extend(trace.host_copies)
        return out

    monkeypatch.setattr(GraphDecoder, "_step", traced)
    ids = torch_smollm2.prompt_ids("one two three four five six seven one two three four five six")
    out = engine.generate(ids, GenerationConfig(max_new_tokens=16, stop_on_eos=False))
    assert len(out.steps) >= 4
    assert max(len(runs) for runs in traces.values()) >= 3
    for key, runs in traces.items():
        # After one warm-up step (CPU weights are packed for oneDNN on first use; capture
        # warms up twice), every step of a shape runs the same operations on the same shapes.
        assert all(run == runs[1] for run in runs[1:]), f"{method}: a step's work changed ({key})"
        ops = [op for run in runs for op in run]
        used = {name for name, _ in ops}
        assert not used & set(FORBIDDEN), f"{method}: the step runs {used & set(FORBIDDEN)}"
        # Host data made into a tensor inside the step would be a copy a graph cannot hold;
        # only 0-dim constants (kernel scalars) may appear.
        assert all(shapes == ((),) for name, shapes in ops if name.startswith("lift_fresh")), method
    assert all(b == buffers[0] for b in buffers), f"{method}: a step's state moved to new tensors"
    assert not host_copies, f"{method}: the step copies host data into device tensors ({host_copies})"
    assert {draft for draft, _ in traces} == ({False} if method == "plain" else {True})
    # The prompt counts twice: the lookup's path is taken whole, and eagle+pld copies.
    assert len(traces) == (2 if method == "eagle+pld" else 1), sorted(traces)


def test_native_engine_refuses_graph_steps(smollm2):
    with pytest.raises(ValueError, match="torch's kernels"):
        Engine(smollm2.model, smollm2.tokenizer, graphs=True)


def paths(tree_tokens, parents, ranks=None) -> dict[tuple[int, ...], int]:
    """Every node as the token path from the root's child down to it, with its value rank."""
    out = {}
    for node in range(1, len(tree_tokens)):
        path, at = [], node
        while at != 0:
            path.append(tree_tokens[at])
            at = parents[at]
        out[tuple(reversed(path))] = ranks[node] if ranks is not None else None
    return out


def test_graph_tree_keeps_the_dynamic_trees_nodes(smollm2):
    model = smollm2.model
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    drafter.pack("bf16")
    ids = smollm2.prompt_ids("Write a short story about a lighthouse keeper.")
    for depth, top_k, total in ((1, 3, 3), (3, 4, 10), (5, 6, 24)):
        proposer = EagleProposer(drafter, depth=depth, top_k=top_k, total_tokens=total)
        # Reach a real mid-generation state, then draft both ways from it.
        Engine(model, smollm2.tokenizer, proposer).generate(ids, GenerationConfig(max_new_tokens=9))
        root = 42
        dynamic = proposer.propose(root)
        static = EagleGraphDrafting(proposer, proposer.cache).propose(torch.tensor(root))   # over its cache
        assert static.tokens.numel() == dynamic.tokens.numel() == total + 1
        # The same nodes with the same value ranks (what the autotuner reads from a step).
        assert paths(static.tokens.tolist(), static.parents.tolist(), static.ranks.tolist()) == \
            paths(dynamic.tokens.tolist(), dynamic.parents.tolist(), dynamic.ranks.tolist())
        mask = static.attention_mask()
        assert torch.equal(mask, mask & torch.ones_like(mask).tril())


def reference_graft(tokens, parents, ranks, chain):
    """The path `chain` grafted onto a tree on the host, the plain way: follow the children that
    carry its tokens, append the rest (ranked -1) in order. Lists (tokens, parents, ranks)."""
    tokens, parents, ranks = list(tokens), list(parents), list(ranks)
    node = 0
    for token in chain:
        match = next((c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == token), None)
        if match is None:
            match = len(tokens)
            tokens.append(token)
            parents.append(node)
            ranks.append(-1)
        node = match
    return tokens, parents, ranks


def test_grafted_path_holds_the_nodes_a_host_graft_adds():
    """tree.graft (eagle+pld's path on a tree, fixed shapes) against a plain host graft: the
    valid rows spell the same token paths with the same ranks, on random trees and paths that
    follow them for a while; `compact` (the eager loop's form) gives exactly the host's rows;
    each row sees exactly its ancestors."""
    import random

    from vocabspec.speculation.tree import Tree, graft

    rng = random.Random(0)
    for case in range(200):
        parents, tokens, depths = [-1], [rng.randrange(5)], [0]
        for _ in range(rng.randrange(1, 13)):
            parent = rng.randrange(len(tokens))
            taken = {tokens[c] for c in range(1, len(tokens)) if parents[c] == parent}
            free = [t for t in range(5) if t not in taken]
            if not free:
                continue
            parents.append(parent)
            tokens.append(rng.choice(free))
            depths.append(depths[parent] + 1)
        ranks = list(range(len(tokens) - 1))
        rng.shuffle(ranks)
        ranks = [-1] + ranks
        k = rng.randrange(1, 6)
        # A path along the tree for a while, then anywhere; `count` of its k tokens drafted.
        chain, at = [], 0
        while len(chain) < k:
            kids = [c for c in range(1, len(tokens)) if parents[c] == at]
            if kids and rng.random() < 0.7:
                at = rng.choice(kids)
                chain.append(tokens[at])
            else:
                at = -1
                chain.append(rng.randrange(5))
        count = rng.randrange(0, k + 1)
        tree = Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), max(depths),
                    ranks=torch.tensor(ranks))
        grafted = graft(tree, torch.tensor(chain), torch.tensor(count))
        host = reference_graft(tokens, parents, ranks, chain[:count])
        valid = grafted.valid.tolist()
        g_tokens, g_parents, g_ranks = grafted.tokens.tolist(), grafted.parents.tolist(), grafted.ranks.tolist()
        assert all(valid[p] for i, p in enumerate(g_parents) if valid[i] and p >= 0), case
        kept = paths([t if v else None for t, v in zip(g_tokens, valid)], g_parents, g_ranks)
        kept = {p: r for p, r in kept.items() if None not in p}
        assert kept == paths(*host), case
        compact = grafted.compact()
        assert (compact.tokens.tolist(), compact.parents.tolist(), compact.ranks.tolist()) == host, case
        assert grafted.depths.tolist() == [len(path_of(g_parents, i)) - 1 for i in range(len(g_tokens))]
        for i in range(len(g_tokens)):
            assert grafted.attention_mask()[i].nonzero().flatten().tolist() == sorted(path_of(g_parents, i)), case


def path_of(parents, node) -> list[int]:
    """`node` and its ancestors up to the root (row 0)."""
    out = [node]
    while node != 0:
        node = parents[node]
        out.append(node)
    return out


@pytest.mark.parametrize("method", ["plain", "pld", "eagle", "medusa", "eagle+pld"])
def test_one_read_back_per_step(torch_smollm2, method):
    model, smollm2 = torch_smollm2.model, torch_smollm2
    proposer = torch_smollm2.proposers()[method]
    engine = Engine(model, smollm2.tokenizer, proposer, graphs=True, allow_inexact=True)
    ids = smollm2.prompt_ids("one two three four five six seven one two three four five six")
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine.generate(ids, config)                        # warm-up
    with count_read_backs() as counts:
        out = engine.generate(ids, config)
    steps = len(out.steps)
    assert steps >= 5
    # One a step, one for the prefill's token: nothing else may wait for the device.
    assert counts["n"] <= steps + 1, f"{counts['n']} read-backs in {steps} steps ({method})"
