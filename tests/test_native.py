"""The native CPU engine is exact by construction: every row of a forward gets the bits it
would get in a forward of its own.

- Weight formats: every GGUF tensor type of both bundled files dequantizes to gguf-py's exact
  float32 values, in both layouts (float32 and 8-bit activations), and a gathered subset of
  rows (a draft head) keeps them.
- Matmuls: every kind gives each row the same bits at any row count.
- Whole models: every row of tree forwards of 1 to 64 tokens equals the one-token forwards of
  its path, bit for bit (hidden states and logits), in every format, on both real models; for
  Gemma also past its 512-token sliding window. Tiny models of both architectures (a window of
  6) run on the same engine and agree with torch's reference to float32 rounding.
- Speculative steps in one call: the native draft tree is tree.TreeBuilder's, node for node;
  one-call greedy verification accepts what the torch verifier (verify_greedy) accepts; the cache keeps
  exactly the accepted slots.
"""

import json
from itertools import product
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from vocabspec.runtime import formats, native
from vocabspec.runtime.kv_cache import DeviceKVCache
from vocabspec.runtime.loading import bundled_gguf, load_model
from vocabspec.runtime.model import ModelArgs
from vocabspec.speculation.tree import TreeBuilder

from conftest import tiny_args, tiny_native, forward

pytestmark = pytest.mark.skipif(not native.available()[0], reason=native.available()[1])

FORMATS = ["gguf", "gguf-a8", "bf16", "f32"]
TREE_SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64]


def int8() -> bool:
    return native.has_int8()


def formats_here():
    return [f for f in FORMATS if f != "gguf-a8" or int8()]


# ---------------------------------------------------------------- weights and matmuls

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def random_blocks(kind: str, rows: int, cols: int, seed: int):
    """Random valid GGUF blocks of a type (scripts/gguf_shapes.py, which writes the real-shape
    files): random codes, finite scales."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from gguf_shapes import random_blocks as blocks

    return blocks(np.random.default_rng(seed), kind, rows, cols)


def test_a_second_load_maps_the_pack_the_first_built(tmp_path, monkeypatch):
    """The first load packs the GGUF's blocks into one file in the cache; the second maps it:
    the same arguments, the same bytes, and no second pack."""
    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    first, _ = load_model("smollm2", weights="gguf")
    packs = list(tmp_path.glob("*-pack*.bin"))
    assert len(packs) == 1
    built = packs[0].stat().st_mtime_ns
    second, _ = load_model("smollm2", weights="gguf-a8" if int8() else "gguf")
    assert packs[0].stat().st_mtime_ns == built and second.args == first.args
    for name in ("wq", "w_down"):
        a, b = first.stack.keep[3][name], second.stack.keep[3][name]
        assert torch.equal(a.data, b.data) and a.int8_acts != b.int8_acts or not int8()
    for arch in ("gemma3", "qwen2"):            # features with flags set survive JSON too
        args = tiny_args(arch)
        assert ModelArgs(**json.loads(json.dumps(asdict(args)))) == args


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_gguf_blocks_dequantize_to_gguf_values(name):
    """Every quantized tensor type of both bundled files, packed from its blocks, dequantizes
    to gguf-py's exact float32 values, and a gathered subset of rows (a draft head) keeps them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(bundled_gguf(name)))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16") or (kind, tensor.shape[0]) in seen:
            continue
        seen.add((kind, tensor.shape[0]))
        raw = np.ascontiguousarray(np.asarray(tensor.data)[:64])      # 64 rows of each type and width
        rows, cols = raw.shape[0], int(tensor.shape[0])
        want = torch.from_numpy(np.ascontiguousarray(dequantize(raw, tensor.tensor_type), dtype=np.float32))
        packed = formats.pack_blocks(kind, raw, rows, cols)
        assert torch.equal(packed.dequantize(), want), f"{tensor.name} ({kind})"
        sub = torch.tensor([5, 0, 63, 17, 16])
        assert torch.equal(packed.take_rows(sub).dequantize(), want[sub]), tensor.name
    assert {"Q8_0", "Q4_1"} <= {k for k, _ in seen} if name == "smollm2" else \
        {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= {k for k, _ in seen}


@pytest.mark.parametrize("kind", QUANTIZED)
def test_every_type_dequantizes_to_gguf_values(kind):
    """Random valid blocks of every type the engine runs (every code pattern, random scales):
    packed, they dequantize to gguf-py's values, rows gathered in any order keep them, and a
    row order given at packing (Llama's q and k) takes the file's rows in that order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for seed, (rows, cols) in enumerate([(37, 256), (64, 512)]):
        raw = random_blocks(kind, rows, cols, seed)
        want = torch.from_numpy(np.ascontiguousarray(dequantize(raw, getattr(GGMLQuantizationType, kind)),
                                                     dtype=np.float32))
        packed = formats.pack_blocks(kind, raw, rows, cols)
        assert packed.data.numel() <= 1.04 * raw.nbytes * -(-rows // 16) * 16 / rows
        assert torch.equal(packed.dequantize(), want), (kind, rows, cols)
        sub = torch.tensor([rows - 1, 0, 17, 16, 5, 5])
        assert torch.equal(packed.take_rows(sub).dequantize(), want[sub]), kind
        order = np.random.default_rng(seed).permutation(rows)
        assert torch.equal(formats.pack_blocks(kind, raw, rows, cols, order=order).dequantize(), want[order])


def test_types_the_engine_lacks_are_refused_by_name():
    with pytest.raises(formats.UnsupportedType, match="IQ2_XXS"):
        formats.pack_blocks("IQ2_XXS", np.zeros((16, 66), np.uint8), 16, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        formats.pack_blocks("Q4_K", np.zeros((16, 72), np.uint8), 16, 128)


def random_packed(kind: str, rows: int, cols: int, seed: int, int8_acts: bool = False) -> formats.PackedWeight:
    g = torch.Generator().manual_seed(seed)
    if kind in ("f32", "bf16"):
        return formats.pack_float(torch.randn(rows, cols, generator=g), kind, bias=torch.randn(rows, generator=g))
    return formats.pack_blocks(kind, random_blocks(kind, rows, cols, seed), rows, cols, int8_acts=int8_acts,
                               bias=torch.randn(rows, generator=g) if seed % 2 else None)


@pytest.mark.parametrize("kind", ["f32", "bf16", *QUANTIZED])
@pytest.mark.parametrize("acts", ["float", "int8"])
def test_matmul_rows_do_not_depend_on_the_row_count(kind, acts):
    if acts == "int8" and (kind in ("f32", "bf16") or not int8()):
        pytest.skip("8-bit activations: quantized weights, on 8-bit dot products")
    for seed, (rows, cols) in enumerate([(100, 256), (257, 512), (48, 768)]):
        weight = random_packed(kind, rows, cols, seed, int8_acts=acts == "int8")
        x = torch.randn(40, cols, generator=torch.Generator().manual_seed(seed)) * 3
        alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(40)])
        for m in (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40):
            assert torch.equal(weight.matmul(x[:m]), alone[:m]), (kind, rows, cols, m)
        reference = x.double() @ weight.dequantize().double().T
        if weight.bias is not None:
            reference += weight.bias.double()
        error = (alone.double() - reference).abs().max() / reference.abs().max()
        # Float activations: float32 rounding; 8-bit ones: their quantization (1/254 of a unit's max).
        assert error < (2e-2 if acts == "int8" else 1e-5), (kind, float(error))


def test_fused_head_topk_matches_the_logits():
    weight = random_packed("Q8_0", 300, 256, 4)
    x = torch.randn(5, 256)
    ids, logprobs = weight.topk(x, 7)
    logits = weight.matmul(x)
    want = torch.topk(logits, 7, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(logprobs, want.values - torch.logsumexp(logits, -1, keepdim=True),
                               atol=1e-5, rtol=0)


# ---------------------------------------------------------------- trees against one-token decoding

def random_tree(vocab: int, size: int, seed: int, top_k: int = 4, depth: int = 6):
    g = torch.Generator().manual_seed(seed)
    builder = TreeBuilder(int(torch.randint(vocab, (1,), generator=g)), top_k, size)
    builder.add_children([0], torch.randperm(vocab, generator=g)[:top_k][None],
                         torch.rand(1, top_k, generator=g).log())
    for _ in range(depth):
        frontier = builder.frontier()
        if not frontier:
            break
        tokens = torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in frontier])
        builder.add_children(frontier, tokens, torch.rand(len(frontier), top_k, generator=g).log())
    return builder.build()


def assert_trees_match_one_token_forwards(model, context: list[int], sizes, vocab: int, seed: int = 0,
                                          cache=None):
    """Every node of each tree: its hidden state and logits from the tree forward are the bits of
    decoding its path one token at a time after `context`, in `cache` (default: a new one of the
    model's)."""
    cache = model.new_cache(len(context) + 80) if cache is None else cache
    with torch.inference_mode():
        forward(model, torch.tensor(context), torch.arange(len(context)), cache)
        cache.commit()
        base = cache.used
        for size in sizes:
            tree = random_tree(vocab, size, seed + size)
            hidden, logits = forward(model, tree.tokens, tree.positions(base), cache,
                                   tree_mask=tree.attention_mask(), all_logits=True)
            cache.discard()
            # The same tree given by its parents (visibility built natively): the same bits.
            by_parents, _ = forward(model, tree.tokens, tree.positions(base), cache, parents=tree.parents,
                                  logits_rows=[])
            cache.discard()
            assert torch.equal(by_parents, hidden), f"tree of {size}: parents and mask disagree"
            checked = set()
            for path in tree.leaf_paths().tolist():
                path = [i for i in path if i >= 0]
                for step, node in enumerate(path):
                    h, lg = forward(model, tree.tokens[node:node + 1], torch.tensor([base + step]), cache,
                                  all_logits=True)
                    cache.commit()
                    if node not in checked:
                        assert torch.equal(h[0], hidden[node]), f"tree of {size}: hidden of node {node}"
                        assert torch.equal(lg[0], logits[node]), f"tree of {size}: logits of node {node}"
                        checked.add(node)
                rewind(cache, base)      # back to the shared context for the next path
            assert checked == set(range(tree.tokens.numel()))


def rewind(cache, length: int) -> None:
    """The cache's committed tokens cut back to `length` (a device cache's count too)."""
    if isinstance(cache, DeviceKVCache):
        cache.length.fill_(length)
        cache.settle(length)
    else:
        cache.length = length


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_name(request):
    return request.param


@pytest.mark.parametrize("weights", FORMATS)
def test_tree_rows_are_bit_identical_to_one_token_decoding(model_name, weights):
    if weights == "gguf-a8" and not int8():
        pytest.skip("gguf-a8 needs 8-bit dot products")
    model, _ = load_model(model_name, weights=weights)
    assert model.exact and model.weights == weights
    # GGUF formats cache keys and values as halves, f32 and bf16 as floats: both exact.
    assert model.new_cache(16).keys.dtype == (torch.float16 if weights.startswith("gguf") else torch.float32)
    context = list(range(1000, 1000 + 90))
    assert_trees_match_one_token_forwards(model, context, TREE_SIZES, model.args.vocab_size)


def test_gemma_trees_past_the_sliding_window():
    """Local layers see the last 512 positions: a context of 600 tokens makes the tree's rows
    and their one-token forwards drop keys at the window's edge."""
    model, _ = load_model("gemma3", weights="gguf")
    assert model.args.sliding_window == 512
    context = [int(t) for t in torch.randint(3, 20000, (600,), generator=torch.Generator().manual_seed(1))]
    assert_trees_match_one_token_forwards(model, context, [5, 24], model.args.vocab_size, seed=3)


# ---------------------------------------------------------------- tiny models, both architectures

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_tiny_models_trees_and_reference(arch, weights):
    reference, fast = tiny_native(arch, seed=2, weights=weights)
    context = torch.randint(0, 200, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    # gemma3's tiny window (6) is shorter than context + tree: the local layers window.
    assert_trees_match_one_token_forwards(fast, context, [1, 3, 7, 12, 20], 200)
    if weights == "f32":
        ids = torch.tensor(context)
        with torch.inference_mode():
            _, want = forward(reference, ids, torch.arange(20), reference.new_cache(), all_logits=True)
            _, got = forward(fast, ids, torch.arange(20), fast.new_cache(), all_logits=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_native_and_torch_agree_on_the_real_models(real_model):
    """The same float32 weights through both implementations: float32 rounding apart."""
    name = real_model.name
    fast, _ = load_model(name, weights="f32")
    reference, _ = load_model(name, backend="torch")
    ids = real_model.prompt_ids("Describe a sunrise over the sea.")
    with torch.inference_mode():
        _, want = forward(reference, torch.tensor(ids), torch.arange(len(ids)), reference.new_cache(), all_logits=True)
        _, got = forward(fast, torch.tensor(ids), torch.arange(len(ids)), fast.new_cache(), all_logits=True)
    assert (got - want).abs().max() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bad_visibility_is_refused():
    _, fast = tiny_native("llama", seed=0)
    cache = fast.new_cache()
    with pytest.raises(ValueError, match="ancestors|position"):
        forward(fast, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), cache,
             tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())


# ---------------------------------------------------------------- speculative steps in one call

def _stops():
    from vocabspec.speculation.live_tree import TreeStop

    # Chances halving with depth, alike in every confidence bin: the sums are exact in C and in
    # Python, so where a tree stops depends on its frontiers' sizes, never on a rounding.
    table = torch.tensor([[0.5 ** d] * 10 for d in range(5)], dtype=torch.float64)
    # And a node above the lowest confidence bin (of a random drafter's, a few) eight times as
    # likely, with a price on each node's row: a level then expands only its frontier's first
    # nodes, those whose chance pays, alike too.
    rising = torch.tensor([[1 / 16] + [1 / 2] * 9] * 5, dtype=torch.float64)
    return [None, TreeStop(table, 0.6), TreeStop(table, 1.2), TreeStop(rising, 0.25, node_cost=0.125)]


STOPS = _stops()


@pytest.mark.parametrize("arch,family", [("llama", "eagle"), ("gemma3", "eagle"), ("llama", "eagle3"),
                                         ("gemma3", "eagle3")])
def test_native_draft_trees_are_the_reference_trees(arch, family):
    """vs_eagle_tree against TreeBuilder grown from Python over the same native drafter and head:
    the same tokens, parents, children and value ranks, through several reads of new tokens,
    grown whole and stopped early by the live rule's TreeStop.
    EAGLE-3: a drafter fusing three target layers, whose head is its own (all of it, and a
    subset), normed before the head or at the output, its residual normed or not."""
    from dataclasses import replace

    from vocabspec.speculation.vocab.draft_vocab import FullVocab, StaticSubset
    from vocabspec.speculation.families.eagle import (EagleDrafter, EagleProposer, NativeEagleDrafting,
                                                      TorchEagleDrafting)
    from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter

    _, target = tiny_native(arch, seed=4)
    a = target.args
    g = torch.Generator().manual_seed(0)
    if family == "eagle":
        drafter = EagleDrafter.random(target, seed=1)
        drafter.pack("f32")
        packed = target.packed_head
        setups = [(drafter, FullVocab(packed)),
                  (drafter, StaticSubset(packed, torch.randperm(200, generator=g)[:80], name="fr:80"))]
    else:
        config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                              intermediate_size=a.intermediate_size, n_layers=1, norm_eps=1e-6,
                              rope_base=10000.0, draft_vocab_size=150, aux_layers=(1, 2, a.n_layers - 1),
                              target_dim=a.dim)
        setups = []
        for variant in (config, replace(config, norm_before_residual=True, norm_output=True, n_layers=2)):
            drafter = Eagle3Drafter.random(target, variant, seed=1, dtype=torch.float32)
            drafter.draft_ids.copy_(torch.randperm(200, generator=g)[:150])
            drafter.pack("f32")
            setups += [(drafter, drafter.draft_vocab("full"))]
        keep = torch.randperm(150, generator=g)[:60]     # a subset of its rows, as fr:N and trim:N are
        setups += [(drafter, StaticSubset.of_rows(drafter.runtime.pack_rows(drafter.lm_head.weight[keep]),
                                                  drafter.draft_ids[keep], "fr:60"))]
    stopped_early = narrowed = 0
    for drafter, head in setups:
        width = (len(drafter.taps) + 1) * a.dim      # the target's rows the drafter reads
        proposer = EagleProposer(drafter, draft_vocab=head, depth=4, top_k=5, total_tokens=12)
        assert isinstance(proposer.drafting, NativeEagleDrafting)
        reference_backend = TorchEagleDrafting(proposer)     # the same proposer's state, grown from Python
        context = torch.randint(0, 200, (30,), generator=g).tolist()
        proposer.reset(context, torch.randn(30, width, generator=g), context[-1])
        for step in range(4):
            for (depth, top_k, total), stop in product([(4, 5, 12), (1, 1, 1), (3, 3, 9), (5, 8, 40), (2, 4, 100)],
                                                       STOPS):
                proposer.depth, proposer.top_k, proposer.total_tokens = depth, top_k, total
                shape = (proposer.depth, proposer.total_tokens)
                fast = proposer.drafting.grow(7, *shape, stop)
                fast_drafted = (stop.levels, stop.rows) if stop is not None else None
                reference = reference_backend.grow(7, *shape, stop)
                if stop is not None:
                    # the levels and rows drafted, which price drafting: alike, and never below
                    # the kept depth
                    assert fast_drafted == (stop.levels, stop.rows) and fast.max_depth <= stop.levels <= depth + 1
                    whole = proposer.drafting.grow(7, *shape)
                    stopped_early += fast.max_depth < whole.max_depth
                    narrowed += stop.node_cost > 0 and fast.max_depth == whole.max_depth > 1 and fast.size < whole.size
                assert torch.equal(fast.tokens, reference.tokens), (head.name, step, depth, top_k, total, stop)
                assert torch.equal(fast.parents, reference.parents)
                assert fast.children == reference.children and torch.equal(fast.ranks, reference.ranks)
                # what the live sizing reads (the C log-softmax rounds its own way: not bits)
                assert torch.allclose(fast.values, reference.values, rtol=1e-5, atol=1e-5)
            accepted = torch.randint(0, 200, (1 + step,), generator=g).tolist()
            proposer.observe(accepted, torch.randn(1 + step, width, generator=g), step)
    assert stopped_early        # the live rule's stop cut some trees short, alike in C and Python
    assert narrowed             # and kept some levels narrower than the frontier


def test_one_call_greedy_verification_accepts_what_the_torch_verifier_accepts():
    from vocabspec.speculation.tree import chain, graft
    from vocabspec.runtime.backend import HEAD_ROWS
    from vocabspec.speculation.verify import greedy_verdict

    _, model = tiny_native("llama", seed=5)
    g = torch.Generator().manual_seed(2)
    context = torch.randint(0, 200, (12,), generator=g).tolist()
    cache = model.new_cache()
    with torch.inference_mode():
        _, logits = forward(model, torch.tensor(context), torch.arange(12), cache)
        cache.commit()
        greedy, probe = [], model.new_cache()          # plain decoding's next six tokens
        forward(model, torch.tensor(context), torch.arange(12), probe)
        probe.commit()
        token = int(logits[0].argmax())
        for i in range(6):
            greedy.append(token)
            _, lg = forward(model, torch.tensor([token]), torch.tensor([12 + i]), probe)
            probe.commit()
            token = int(lg[0].argmax())
        greedy.append(token)
        for trial in range(12):
            # The right path for a random number of steps, then a wrong token; random branches.
            right = greedy[1:1 + trial % 6]
            tree = random_tree(200, 1 + trial, seed=trial)
            tree = chain(greedy[0], []) if trial % 4 == 0 else tree
            tree.tokens[0] = greedy[0]
            path = right + [int(torch.randint(0, 200, (1,), generator=g))]
            tree = graft(tree, torch.tensor(path), torch.tensor(len(path))).compact()
            hidden, _ = forward(model, tree.tokens, tree.positions(12), cache, parents=tree.parents, logits_rows=[])
            cache.discard()
            for rows in (1, 2, HEAD_ROWS):
                path, following = model.verify_greedy_trees(hidden, [(tree.tokens, tree.parents)], rows)[0]
                want = greedy_verdict(tree, model.lm_head(hidden))
                assert (path, following) == (want.path, want.next_token)
                accepted = tree.tokens[path].tolist()
                assert accepted[1:] == greedy[1:len(accepted)] and following == greedy[len(accepted)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])    # floats, or halves (GGUF formats)
def test_the_cache_keeps_exactly_the_accepted_slots(dtype):
    from vocabspec.runtime.kv_cache import KVCache

    g = torch.Generator().manual_seed(3)
    for keep in ([0], [0, 1, 2], [0, 2, 5], [1, 3], [4], []):
        cache = KVCache(3, 2, 32, 40, dtype, torch.device("cpu"), layout="native")
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=g))
        cache.values.copy_(torch.randn(cache.values.shape, generator=g))
        keys, values = cache.key_slots(), cache.values.clone()
        cache.length, cache.pending = 10, 6
        cache.commit(torch.tensor(keep, dtype=torch.long))
        assert cache.length == 10 + len(keep) and cache.pending == 0
        src = torch.tensor([10 + k for k in keep], dtype=torch.long)
        assert torch.equal(cache.key_slots()[..., :10], keys[..., :10])
        assert torch.equal(cache.key_slots()[..., 10:10 + len(keep)], keys[..., src])
        assert torch.equal(cache.values[:, :, 10:10 + len(keep)], values[:, :, src])
    cache.length, cache.pending = 10, 3
    with pytest.raises(ValueError, match="increase"):
        cache.commit([2, 1])



# ---------------------------------------------------------------- threads

def two_threads_here() -> bool:
    """Whether the engine can run a team of two (the governor is left in charge after asking)."""
    native.set_threads(2)
    two = native.threads() >= 2
    native.set_threads(0)
    return two

def test_thread_count_changes_no_bits():
    """A tree forward on one thread and on all of them: the same bits, hidden states and logits
    (the team the governor picks on a busy machine must not change an answer)."""
    if not two_threads_here():
        pytest.skip("one thread here")
    model, _ = load_model("smollm2", weights="gguf-a8" if int8() else "gguf")
    tree = random_tree(model.args.vocab_size, 24, seed=5)
    context = torch.arange(2000, 2060)
    results = []
    try:
        for threads in (1, 2, 0):
            native.set_threads(threads)
            assert native.threads() == threads or threads == 0
            cache = model.new_cache(120)
            with torch.inference_mode():
                forward(model, context, torch.arange(60), cache)
                cache.commit()
                results.append(forward(model, tree.tokens, tree.positions(60), cache, tree_mask=tree.attention_mask(),
                                     all_logits=True))
    finally:
        native.set_threads(0)
    for hidden, logits in results[1:]:
        assert torch.equal(hidden, results[0][0]) and torch.equal(logits, results[0][1])


def test_the_governor_shrinks_the_team_on_a_low_share_and_probes_back():
    """Forwards whose threads got 40% of their wall time shrink the team to one; a probe on two
    threads that was hindered leaves it there, one that ran unhindered restores two."""
    lib = native.library()
    if not two_threads_here():
        pytest.skip("one thread here")
    try:
        native.set_threads(0)
        lib.vs_threads_observe(2, 2 * 0.97 * 0.01, 0.01)    # (a probe, if it started on one)
        assert native.threads() == 2
        for share in (0.9, 0.8, 0.6):                        # small losses must persist
            lib.vs_threads_observe(2, 2 * share * 0.01, 0.01)
            assert native.threads() == 2
        lib.vs_threads_observe(2, 2 * 0.4 * 0.01, 0.01)      # half the time lost: at once
        assert native.threads() == 1
        lib.vs_threads_observe(2, 2 * 0.6 * 0.01, 0.01)      # a probe that was hindered
        assert native.threads() == 1
        lib.vs_threads_observe(1, 0.5 * 0.01, 0.01)          # one thread's share decides nothing
        assert native.threads() == 1
        lib.vs_threads_observe(2, 2 * 0.97 * 0.01, 0.01)     # a probe that ran unhindered
        assert native.threads() == 2
        with pytest.raises(ValueError):
            native.set_threads(-1)
    finally:
        native.set_threads(0)
