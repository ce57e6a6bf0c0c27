"""Row-invariant GPU kernels (kernels.py), run by Triton's interpreter on the CPU (on a GPU where
one is present): each row's bits do not depend on how many rows share the call or what they
hold, a tree's attention rows equal the one-token rows of their paths bit for bit, and every
kernel agrees with torch to float rounding. Tiny shapes: the interpreter is slow."""

import pytest
import torch

from vocabspec.runtime import kernels, native     # (conftest.py chooses Triton's interpreter on a CPU)
from vocabspec.runtime.kernel_backend import KernelBackend

pytestmark = pytest.mark.skipif(not kernels.available()[0], reason=kernels.available()[1])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_rows_beside_them(dtype):
    weight, bias, x = rand(70, 64, dtype=dtype, seed=1), rand(70, dtype=dtype, seed=2), rand(40, 64, dtype=dtype)
    full = kernels.linear(x, weight, bias)
    assert torch.equal(kernels.linear(x[:17], weight, bias), full[:17])
    for i in (0, 6, 13, 39):            # alone, as row 0 (as one-token decoding computes it)
        assert torch.equal(kernels.linear(x[i:i + 1], weight, bias)[0], full[i]), f"row {i}"
    others = torch.cat([rand(9, 64, dtype=dtype, seed=3), x[5:6], rand(11, 64, dtype=dtype, seed=4)])
    assert torch.equal(kernels.linear(others, weight, bias)[9], full[5])   # elsewhere in a tile
    want = (x.float() @ weight.float().T + bias.float()).to(dtype)
    torch.testing.assert_close(full, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


def test_rms_norm_and_argmax():
    x, weight = rand(9, 48), rand(48, seed=4)
    normed = kernels.rms_norm(x, weight, 1e-6)
    assert torch.equal(kernels.rms_norm(x[3:4], weight, 1e-6)[0], normed[3])
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
    logits = rand(5, 300, seed=5)
    logits[2, 7] = logits[2, 250] = logits[2].max() + 1        # a tie: the first index wins
    assert torch.equal(kernels.argmax(logits, block=128).cpu(), logits.argmax(-1).cpu())
    assert int(kernels.argmax(logits, block=128)[2]) == 7


@pytest.mark.parametrize("use_dot", [False, True], ids=["multiply_add", "tensor_cores"])
def test_tree_attention_rows_are_the_one_token_rows_of_their_paths(use_dot):
    """On either kernel (one head at a time with multiply-adds, or a key group's heads on
    tensor cores), each tree row has the bits of its path's one-token row and agrees with
    torch's attention; the two kernels agree with each other to rounding, in a sliding window
    too."""
    heads, groups, dim, slots, start = 4, 2, 16, 96, 40
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 6])          # a tree of 9 rows after 40 slots
    n = parents.numel()
    positions, ends, listed = native.tree_visibility(parents.tolist(), start, start)
    positions, extra = torch.tensor(positions), torch.tensor(listed, dtype=torch.int32)
    prefix, xoff = torch.full((n,), start, dtype=torch.int32), torch.tensor([0] + ends, dtype=torch.int32)
    keys, values, q = rand(groups, slots, dim, seed=6), rand(groups, slots, dim, seed=7), rand(n, heads, dim, seed=8)
    tree = kernels.attention(q, keys, values, prefix.to(DEVICE), xoff.to(DEVICE), extra.to(DEVICE), 0.25,
                             use_dot=use_dot)
    for r in range(n):
        seen = extra[int(xoff[r]):int(xoff[r + 1])].long()          # its ancestors' slots, then its own
        path_keys, path_values = keys.clone(), values.clone()       # the path laid out contiguously
        path_keys[:, start:start + seen.numel()] = keys[:, seen]
        path_values[:, start:start + seen.numel()] = values[:, seen]
        alone = kernels.attention(q[r:r + 1], path_keys, path_values,
                                  torch.tensor([start + seen.numel()], device=DEVICE),
                                  torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                  torch.zeros(1, dtype=torch.int32, device=DEVICE), 0.25, use_dot=use_dot)
        assert torch.equal(alone[0], tree[r]), f"tree row {r}"
        visible = torch.cat([torch.arange(start, device=DEVICE), seen.to(DEVICE)])
        kv = keys[:, visible].repeat_interleave(heads // groups, 0)
        vv = values[:, visible].repeat_interleave(heads // groups, 0)
        scores = torch.einsum("hd,htd->ht", q[r], kv) * 0.25
        want = torch.einsum("ht,htd->hd", scores.softmax(-1), vv)
        torch.testing.assert_close(tree[r], want, rtol=1e-5, atol=1e-5)
    if use_dot:
        seen = (q, keys, values, prefix.to(DEVICE), xoff.to(DEVICE), extra.to(DEVICE), 0.25, positions.to(DEVICE))
        for window in (0, 6):
            torch.testing.assert_close(kernels.attention(*seen, window=window, use_dot=True),
                                       kernels.attention(*seen, window=window, use_dot=False), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- a model on the kernels

def test_a_model_on_the_kernels_is_exact():
    """A tiny Gemma 3 (query and key norms, post-norms, a sliding window of 6) with every
    matmul, norm and attention on the kernels: each row of a tree forward has the bits of the
    one-token forwards of its path, the engine calls it exact, and greedy EAGLE-2 decoding gives
    plain decoding's tokens with no --allow-inexact."""
    from test_native import assert_trees_match_one_token_forwards

    from conftest import tiny_native
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.decoding.batch import Engine

    reference, _ = tiny_native("gemma3", seed=2, n_layers=2)   # a sliding layer and a global one
    model = KernelBackend(reference.module.to(DEVICE))
    assert model.exact
    context = torch.randint(0, 200, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_trees_match_one_token_forwards(model, context, [5], 200)
    plain = Engine(model).generate(context, GenerationConfig(max_new_tokens=5))
    drafted = Engine(model, proposer=EagleProposer(EagleDrafter.random(model, seed=1), depth=2, top_k=2,
                                                   total_tokens=4)).generate(context, GenerationConfig(max_new_tokens=5))
    assert drafted.tokens == plain.tokens


# ---------------------------------------------------------------- tensor cores, fusion, launches

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_core_linear_agrees_with_float64(dtype):
    """The tl.dot kernel (run by the interpreter as a numpy product: its bits are not checked
    here, only on a GPU by dot_is_row_invariant) against a float64 product, K and N not whole
    tiles; with a bias, a norm before it and a residual after it too."""
    x, weight, bias = rand(19, 70, dtype=dtype), rand(45, 70, dtype=dtype, seed=1), rand(45, dtype=dtype, seed=2)
    want = x.double() @ weight.double().T + bias.double()
    tol = dict(rtol=1e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, weight, bias, use_dot=True).double(), want, **tol)
    residual, gain = rand(19, 45, dtype=dtype, seed=3), rand(70, seed=4)
    fused = kernels.linear(x, weight, norm=gain, eps=1e-6, residual=residual, use_dot=True)
    normed = kernels.rms_norm(x, gain, 1e-6).double()
    torch.testing.assert_close(fused.double(), normed @ weight.double().T + residual.double(), **tol)


def test_the_tensor_core_kernel_serves_only_where_its_rows_keep_their_bits(monkeypatch):
    """Off a GPU and under the interpreter the decision is the multiply-add kernel's; the check
    itself passes a row-invariant product and fails one whose rows change with the row count."""
    assert not kernels.dot_is_row_invariant("cpu", torch.float32)
    assert not kernels._use_dot(rand(2, 8))
    if kernels.interpreted():
        assert not kernels.dot_is_row_invariant("cuda", torch.bfloat16)
    assert kernels.rows_keep_their_bits(DEVICE, torch.float32, 20, 24, rows=4, use_dot=False)
    drifting = lambda x, w, use_dot: (x @ w.T) * (1 + 1e-6 * (x.shape[0] > 2))     # noqa: E731
    monkeypatch.setattr(kernels, "linear", drifting)
    assert not kernels.rows_keep_their_bits(DEVICE, torch.float32, 20, 24, rows=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_against_the_unfused(dtype):
    """A residual in the linear's epilogue: the bits of the product then torch's add (in
    bfloat16 within a unit: the interpreter's casts to it truncate, a GPU's round to nearest as
    torch's do). A norm inside the linear sums each row's squares BK at a time, not in
    rms_norm's one block, and the gated up projection's exp is Triton's, not torch's: within a
    unit of the dtype's rounding. Each fused row as it is alone."""
    x, weight = rand(9, 40, dtype=dtype), rand(2 * 24, 40, dtype=dtype, seed=1)
    residual, gain = rand(9, 48, dtype=dtype, seed=2), rand(40, seed=3)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    summed = kernels.linear(x, weight, residual=residual)
    if dtype == torch.float32:
        assert torch.equal(summed, kernels.linear(x, weight) + residual)
    torch.testing.assert_close(summed, kernels.linear(x, weight) + residual, **tol)
    torch.testing.assert_close(kernels.linear(x, weight, norm=gain, eps=1e-6),
                               kernels.linear(kernels.rms_norm(x, gain, 1e-6), weight), **tol)
    gate, up = kernels.linear(kernels.rms_norm(x, gain, 1e-6), weight).split(24, dim=-1)
    for activation, act in ((kernels.SILU, torch.nn.functional.silu),
                            (kernels.GELU, lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        fused = kernels.gated_linear(x, weight, activation, norm=gain, eps=1e-6)
        torch.testing.assert_close(fused, act(gate) * up, **tol)
        assert torch.equal(kernels.gated_linear(x[4:5], weight, activation, norm=gain, eps=1e-6)[0], fused[4])


def test_fusion_launches_fewer_kernels_a_layer():
    """Launches in a one-token forward's layer, unfused and fused (printed: pytest -s shows them):
    Llama's layer drops its two norms, the activation, the product, both residual adds, rotary
    and the cache writes: 5 kernels, from 18 (12 before rotary and the cache write joined the
    QKV projection); Gemma's 10, from 27 (23)."""
    from conftest import tiny_module
    from vocabspec.runtime.launches import layer_launches

    counts = {}
    for arch in ("llama", "gemma3"):
        module = tiny_module(arch, seed=2, n_layers=1).to(DEVICE)
        for fused in (False, True):
            model = KernelBackend(module, fused=fused)
            counts[arch, fused] = layer_launches(model, torch.tensor([3], device=DEVICE),
                                                 torch.tensor([0], device=DEVICE), model.new_cache(8))
            print(f"{arch} layer, {'fused' if fused else 'unfused'}: {counts[arch, fused]}")
    assert counts["llama", False] == {"triton": 7, "torch": 11}
    assert counts["llama", True] == {"triton": 5, "torch": 0}
    # Gemma's norms after attention and the MLP keep its two residual adds out of the epilogues;
    # its query/key norms, rotary and the cache write take one kernel after the projection.
    assert counts["gemma3", False] == {"triton": 11, "torch": 16}
    assert counts["gemma3", True] == {"triton": 8, "torch": 2}


def test_graph_steps_on_the_kernels_are_plain_decoding():
    """Graph steps (graph_step.py, a device cache: CUDA graphs on a GPU, eager here) on the
    kernels: a tree forward over the device cache gives each row the bits of its path's one-token
    forwards, the head's argmax taken in its kernel is the logits' argmax, and greedy EAGLE-2's
    graph steps (rotary and the cache write in QKV's kernel, the argmax in the head's) emit the
    tokens of the general loop and of plain decoding, with no --allow-inexact."""
    from test_native import assert_trees_match_one_token_forwards

    from conftest import tiny_module
    from vocabspec.runtime.kv_cache import DeviceKVCache
    from vocabspec.decoding.batch import Engine
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.decoding.generate import GenerationConfig

    model = KernelBackend(tiny_module("llama", seed=2, n_layers=1).to(DEVICE))
    args = model.args
    cache = DeviceKVCache(args.n_layers, args.n_kv_heads, args.head_dim, 64, model.dtype, model.device)
    context = torch.randint(0, args.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_trees_match_one_token_forwards(model, context, [5], args.vocab_size, cache=cache)
    hidden = torch.randn(3, args.dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, model.dtype)
    assert torch.equal(model.greedy_tokens(hidden), model.lm_head(hidden).argmax(-1))   # the steps' head
    config = GenerationConfig(max_new_tokens=6)
    plain = Engine(model, graphs=False).generate(context, config).tokens
    assert len(set(plain)) > 2                   # the answer is no repeated token
    proposer = EagleProposer(EagleDrafter.random(model, seed=1), depth=2, top_k=2, total_tokens=4)
    loop = Engine(model, proposer=proposer, graphs=False).generate(context, config).tokens
    engine = Engine(model, proposer=proposer, graphs=True)
    static = engine.generate(context, config).tokens
    assert engine.graphs and engine.model.decoders
    assert static == loop == plain


def test_graph_steps_on_the_kernels_keep_accepted_drafts():
    """Prompt lookup's graph steps on the kernels where its drafts are accepted (a one-layer
    Gemma with a sliding window of 6 whose answer repeats a token): the accepted path is moved
    in the device cache and the answer is still plain decoding's, in fewer steps."""
    from conftest import tiny_module
    from vocabspec.decoding.batch import Engine
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.speculation.families.pld import PromptLookupProposer

    model = KernelBackend(tiny_module("gemma3", seed=2, n_layers=1).to(DEVICE))
    context = torch.randint(0, 90, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    config = GenerationConfig(max_new_tokens=7)
    plain = Engine(model, graphs=False).generate(context, config)
    static = Engine(model, proposer=PromptLookupProposer(num_draft=3), graphs=True).generate(context, config)
    assert static.tokens == plain.tokens
    assert len(static.steps) < len(plain.steps)


# ---------------------------------------------------------------- QKV, rotary and the cache write

def qkv_case(dtype, heads=4, groups=2, dim=16, k=24, rows=6):
    """A QKV projection's inputs: rows, weight, bias, norm gain, RoPE tables and each row's
    position and cache slot (a tree's: positions repeat, slots do not)."""
    from vocabspec.runtime.model import rope_tables

    x, weight = rand(rows, k, dtype=dtype), rand((heads + 2 * groups) * dim, k, dtype=dtype, seed=1)
    bias, gain = rand(weight.shape[0], dtype=dtype, seed=2), rand(k, seed=3)
    cos, sin = (t.to(DEVICE) for t in rope_tables(dim, 10000.0, 64))
    positions = torch.tensor([5, 9, 9, 10, 11, 30][:rows], device=DEVICE)
    slots = torch.tensor([5, 9, 10, 11, 12, 13][:rows], device=DEVICE)
    return x, weight, bias, gain, cos[positions], sin[positions], slots


def fused_qkv(x, weight, bias, gain, cos, sin, slots, heads=4, groups=2, dim=16, length=20, use_dot=None):
    keys = torch.zeros(groups, length, dim, dtype=x.dtype, device=DEVICE)
    values = torch.zeros_like(keys)
    q = kernels.qkv_rope_cache(x, weight, bias, cos, sin, slots, keys, values, heads, norm=gain, eps=1e-6,
                               use_dot=use_dot)
    return q, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_and_cache_write_in_one_kernel_against_the_unfused(dtype):
    """The fused kernel's queries and cache against `linear` then model.apply_rope then the
    cache's write: the same bits in float32 (in bfloat16 within a unit: the interpreter's casts
    to it truncate, torch's round to nearest); slots not written stay as they were. Its
    tensor-core tiling agrees to rounding."""
    from vocabspec.runtime.model import apply_rope

    heads, groups, dim = 4, 2, 16
    x, weight, bias, gain, cos, sin, slots = qkv_case(dtype)
    q, keys, values = fused_qkv(x, weight, bias, gain, cos, sin, slots)
    qkv = kernels.linear(x, weight, bias, norm=gain, eps=1e-6)
    n = x.shape[0]
    qk = qkv[:, :(heads + groups) * dim].view(n, heads + groups, dim).transpose(0, 1).unsqueeze(0)
    qk = apply_rope(qk, cos, sin)[0].transpose(0, 1)
    want_keys, want_values = torch.zeros_like(keys), torch.zeros_like(values)
    want_keys[:, slots] = qk[:, heads:].transpose(0, 1)
    want_values[:, slots] = qkv[:, (heads + groups) * dim:].view(n, groups, dim).transpose(0, 1)
    if dtype == torch.float32:
        assert torch.equal(q, qk[:, :heads]) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(q, qk[:, :heads], **tol)
    torch.testing.assert_close(keys, want_keys, **tol)
    assert torch.equal(values, want_values)        # values are not rotated: the projection's bits
    dot = fused_qkv(x, weight, bias, gain, cos, sin, slots, use_dot=True)      # tensor cores' tiling
    for got, want in zip(dot, (q, keys, values)):
        torch.testing.assert_close(got, want, **(tol if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_cache_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """Each row's queries, keys and values have the same bits at every place in a call of any
    row count (1 to 6), as alone (one-token decoding)."""
    x, weight, bias, gain, cos, sin, slots = qkv_case(dtype)
    n = x.shape[0]
    alone = [fused_qkv(x[i:i + 1], weight, bias, gain, cos[i:i + 1], sin[i:i + 1], slots[i:i + 1]) for i in range(n)]
    for count in (1, 2, 5, 6):
        for shift in (0, 3):
            picked = (torch.arange(count) + shift) % n
            q, keys, values = fused_qkv(x[picked], weight, bias, gain, cos[picked], sin[picked], slots[picked])
            for place, i in enumerate(picked.tolist()):
                slot = int(slots[i])
                assert torch.equal(q[place], alone[i][0][0]), (count, shift, i)
                assert torch.equal(keys[:, slot], alone[i][1][:, slot])
                assert torch.equal(values[:, slot], alone[i][2][:, slot])


# ---------------------------------------------------------------- argmax in the head's kernel

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_argmax_is_torch_argmax_of_the_linear_ties_included(dtype):
    """The head's argmax without its logits: torch.argmax of `linear`'s (normed) products, the
    first index on ties, ties within a tile (37, 40) and across tiles (70) alike; every row as
    alone, in calls of any row count."""
    k, vocab = 24, 90                                # three tiles of 32 columns, the last partial
    x = rand(6, k, dtype=dtype).abs() + 0.5
    x[3:] = -x[3:]                                   # rows 3..5: the tied columns are their smallest
    weight = rand(vocab, k, dtype=dtype, seed=1) / k ** 0.5
    weight[[37, 40, 70]] = 1.0                       # identical columns: exact ties
    gain = rand(k, seed=3).abs() + 0.5
    want = kernels.linear(x, weight, norm=gain, eps=1e-6).float().argmax(-1)
    got = kernels.linear_argmax(x, weight, norm=gain, eps=1e-6)
    assert torch.equal(got, want)
    assert got[:3].tolist() == [37, 37, 37]
    assert torch.equal(kernels.linear_argmax(x, weight, norm=gain, eps=1e-6, block=2), want)   # tiles in chunks
    for count in (1, 4):
        for shift in (0, 3):
            picked = (torch.arange(count) + shift) % 6
            assert torch.equal(kernels.linear_argmax(x[picked], weight, norm=gain, eps=1e-6), want[picked])
    rounded = kernels.linear(x, weight).float()      # without a norm too, and on tensor cores' tiling
    assert torch.equal(kernels.linear_argmax(x, weight), rounded.argmax(-1))
    # (The interpreter's tl.dot is numpy's product, which need not give identical columns the
    # same bits: compared with `linear` on the same tiling.)
    dot = kernels.linear(x, weight, use_dot=True).float().argmax(-1)
    assert torch.equal(kernels.linear_argmax(x, weight, use_dot=True), dot)


def test_the_graph_tuner_times_the_graph_steps_on_the_kernels(monkeypatch):
    """Where the model runs on the kernels (--backend triton) the graph tuner
    (autotune.calibrate_graph, what choose_graph_tree picks from) times the steps a GPU would
    replay: graph steps on the kernels over a device cache (kernel_backend.KernelPlan), trees and
    plain decoding alike, never torch's attention."""
    import vocabspec.runtime.model as model_module
    import vocabspec.tuning.autotune as autotune
    from conftest import tiny_module
    from vocabspec.speculation.families.eagle import EagleDrafter

    model = KernelBackend(tiny_module("llama", seed=2, n_layers=1).to(DEVICE))
    monkeypatch.setattr(autotune, "STEP_REPEATS", 1)

    def torch_attention(*_):
        raise AssertionError("a step on torch's attention")
    monkeypatch.setattr(model_module.AttentionPlan, "__init__", torch_attention)
    timed, step_seconds = [], autotune.step_seconds

    def counted(decoder, draft, repeats=None):
        before = kernels.launches()
        seconds = step_seconds(decoder, draft, repeats)
        timed.append((draft, kernels.launches() - before))
        return seconds
    monkeypatch.setattr(autotune, "step_seconds", counted)
    context = torch.randint(0, 90, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    table = autotune.calibrate_graph(model, EagleDrafter.random(model, seed=1), None, [context], depth=1,
                                      top_k=2, sizes=(2,), new_tokens=2)
    assert set(table["table"]) == {"1/2"} and table["plain_step_s"] > 0
    # Two runs each (a warm-up, one timed), each a layer's 5 kernels and the head's 2 at least.
    assert [draft for draft, _ in timed] == [True, False]
    assert all(launches >= 2 * (5 + 2) for _, launches in timed), timed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_key_norms_rotary_and_cache_write_in_one_kernel(dtype):
    """Gemma's query and key norms, rotary and the cache write after its QKV projection, in one
    kernel: the bits of `rms_norm` per head, then model.apply_rope, then the cache's write (in
    bfloat16 within a unit: the interpreter's casts truncate, torch's round); each row as alone."""
    from vocabspec.runtime.model import apply_rope

    heads, groups, dim = 4, 2, 16
    x, weight, bias, gain, cos, sin, slots = qkv_case(dtype)
    qkv = kernels.linear(x, weight, bias)
    q_norm, k_norm = rand(dim, seed=4), rand(dim, seed=5)
    n = x.shape[0]

    def fused(rows):
        keys = torch.zeros(groups, 20, dim, dtype=dtype, device=DEVICE)
        values = torch.zeros_like(keys)
        q = kernels.head_norm_rope_cache(qkv[rows], q_norm, k_norm, 1e-6, cos[rows], sin[rows], slots[rows],
                                         keys, values, heads)
        return q, keys, values
    q, keys, values = fused(torch.arange(n))
    normed_q = kernels.rms_norm(qkv[:, :heads * dim].reshape(-1, dim), q_norm, 1e-6).view(n, heads, dim)
    normed_k = kernels.rms_norm(qkv[:, heads * dim:(heads + groups) * dim].reshape(-1, dim), k_norm, 1e-6)
    want_q = apply_rope(normed_q.transpose(0, 1).unsqueeze(0), cos, sin)[0].transpose(0, 1)
    want_k = apply_rope(normed_k.view(n, groups, dim).transpose(0, 1).unsqueeze(0), cos, sin)[0]
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(keys[:, slots], want_k, **tol)
    assert torch.equal(values[:, slots], qkv[:, (heads + groups) * dim:].view(n, groups, dim).transpose(0, 1))
    assert keys[:, [0, 1, 19]].abs().sum() == 0 and values[:, [0, 1, 19]].abs().sum() == 0
    for i in (0, 4):
        alone = fused(torch.tensor([i]))
        assert torch.equal(alone[0][0], q[i]) and torch.equal(alone[1][:, slots[i]], keys[:, slots[i]])
