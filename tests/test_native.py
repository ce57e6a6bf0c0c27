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
"""

import numpy as np
import pytest
import torch

from vocabspec import formats, native
from vocabspec.loading import bundled_gguf, load_model
from vocabspec.model import Transformer
from vocabspec.tree import TreeBuilder

from conftest import tiny_args

pytestmark = pytest.mark.skipif(not native.available()[0], reason=native.available()[1])

FORMATS = ["gguf", "gguf-a8", "bf16", "f32"]
TREE_SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64]


def vnni() -> bool:
    return bool(native.library().vs_has_vnni())


def formats_here():
    return [f for f in FORMATS if f != "gguf-a8" or vnni()]


# ---------------------------------------------------------------- weights and matmuls

@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_gguf_blocks_dequantize_to_gguf_values(name):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(bundled_gguf(name)))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16") or (kind, tensor.shape[0]) in seen:
            continue
        seen.add((kind, tensor.shape[0]))
        raw = np.asarray(tensor.data)[:64]                 # 64 rows of each type and width
        rows, cols = raw.shape[0], int(tensor.shape[0])
        want = torch.from_numpy(np.ascontiguousarray(dequantize(raw, tensor.tensor_type), dtype=np.float32))
        for int8 in (False, True):
            packed = formats.from_gguf_blocks(kind, raw, rows, cols, int8_activations=int8)
            assert packed is not None, f"{tensor.name}: {kind} has no quantized kind"
            assert torch.equal(packed.dequantize(), want), f"{tensor.name} ({kind}, int8={int8})"
            sub = torch.tensor([5, 0, 63, 17, 16])
            assert torch.equal(packed.take_rows(sub).dequantize(), want[sub]), tensor.name
    assert {"Q8_0", "Q4_1"} <= {k for k, _ in seen} if name == "smollm2" else \
        {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= {k for k, _ in seen}


def random_packed(kind: str, rows: int, cols: int, seed: int) -> formats.PackedWeight:
    g = torch.Generator().manual_seed(seed)
    if kind in ("f32", "bf16"):
        return formats.pack_float(torch.randn(rows, cols, generator=g), kind, bias=torch.randn(rows, generator=g))
    base = kind[:2]
    high = {"q4": 16, "q5": 32, "q8": 128}[base]
    low = -128 if base == "q8" else 0
    codes = torch.randint(low, high, (rows, cols), generator=g)
    group = 16 if base == "q8" and seed % 2 else 32
    scale = (torch.rand(rows, cols // group, generator=g) * 0.02).to(torch.float32 if group == 16 else torch.float16)
    minimum = None if base == "q8" else -(torch.rand(rows, cols // 32, generator=g) * 0.1).half()
    return formats.pack_codes(kind, codes, scale, minimum, group=group)


@pytest.mark.parametrize("kind", ["f32", "bf16", "q4", "q5", "q8", "q4i", "q5i", "q8i"])
def test_matmul_rows_do_not_depend_on_the_row_count(kind):
    if kind.endswith("i") and not vnni():
        pytest.skip("8-bit activations need AVX-512 VNNI")
    for seed, (rows, cols) in enumerate([(100, 64), (257, 96), (48, 640)]):
        weight = random_packed(kind, rows, cols, seed)
        x = torch.randn(40, cols, generator=torch.Generator().manual_seed(seed)) * 3
        alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(40)])
        for m in (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40):
            assert torch.equal(weight.matmul(x[:m]), alone[:m]), (kind, rows, cols, m)
        reference = x.double() @ weight.dequantize().double().T
        if weight.bias is not None:
            reference += weight.bias.double()
        error = (alone.double() - reference).abs().max() / reference.abs().max()
        # Float activations: float32 rounding; 8-bit ones: their quantization (1/254 of a unit's max).
        assert error < (2e-2 if kind.endswith("i") else 1e-5), (kind, float(error))


def test_fused_head_topk_matches_the_logits():
    weight = random_packed("q8", 300, 64, 4)
    x = torch.randn(5, 64)
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


def assert_trees_match_one_token_forwards(model, context: list[int], sizes, vocab: int, seed: int = 0):
    """Every node of each tree: its hidden state and logits from the tree forward are the bits of
    decoding its path one token at a time after `context`."""
    cache = model.new_cache(len(context) + 80)
    with torch.inference_mode():
        model(torch.tensor(context), torch.arange(len(context)), cache)
        cache.commit()
        base = cache.length
        for size in sizes:
            tree = random_tree(vocab, size, seed + size)
            hidden, logits = model(tree.tokens, tree.positions(base), cache,
                                   tree_mask=tree.attention_mask(), all_logits=True)
            cache.discard()
            checked = set()
            for path in tree.leaf_paths().tolist():
                path = [i for i in path if i >= 0]
                for step, node in enumerate(path):
                    h, lg = model(tree.tokens[node:node + 1], torch.tensor([base + step]), cache,
                                  all_logits=True)
                    cache.commit()
                    if node not in checked:
                        assert torch.equal(h[0], hidden[node]), f"tree of {size}: hidden of node {node}"
                        assert torch.equal(lg[0], logits[node]), f"tree of {size}: logits of node {node}"
                        checked.add(node)
                cache.rollback(base)
            assert checked == set(range(tree.tokens.numel()))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_name(request):
    return request.param


@pytest.mark.parametrize("weights", FORMATS)
def test_tree_rows_are_bit_identical_to_one_token_decoding(model_name, weights):
    if weights == "gguf-a8" and not vnni():
        pytest.skip("gguf-a8 needs AVX-512 VNNI")
    model, _ = load_model(model_name, weights=weights)
    assert model.exact and model.weights == weights
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

def tiny_native(arch: str, seed: int, weights: str = "f32"):
    """A random model whose shapes the native engine takes (widths multiples of 32), on torch
    (the reference) and on the native engine."""
    args = tiny_args(arch, vocab_size=200, dim=64, n_heads=4, n_kv_heads=2, head_dim=32,
                     intermediate_size=96)
    torch.manual_seed(seed)
    reference = Transformer(args)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if name.endswith("norm.weight")
                    else torch.randn_like(p) * 0.3)
    reference.eval().requires_grad_(False)
    fast = Transformer(args)
    fast.load_state_dict(reference.state_dict())
    fast.eval().requires_grad_(False)
    fast.use_native(formats.pack_model(fast, weights), weights)
    return reference, fast


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
            _, want = reference(ids, torch.arange(20), reference.new_cache(), all_logits=True)
            _, got = fast(ids, torch.arange(20), fast.new_cache(), all_logits=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_native_and_torch_agree_on_the_real_models(real_model):
    """The same float32 weights through both implementations: float32 rounding apart."""
    name = real_model.name
    fast, _ = load_model(name, weights="f32")
    reference, _ = load_model(name, backend="torch")
    ids = real_model.prompt_ids("Describe a sunrise over the sea.")
    with torch.inference_mode():
        _, want = reference(torch.tensor(ids), torch.arange(len(ids)), reference.new_cache(), all_logits=True)
        _, got = fast(torch.tensor(ids), torch.arange(len(ids)), fast.new_cache(), all_logits=True)
    assert (got - want).abs().max() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bad_visibility_is_refused():
    _, fast = tiny_native("llama", seed=0)
    cache = fast.new_cache()
    with pytest.raises(ValueError, match="ancestors|position"):
        fast(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), cache,
             tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())
