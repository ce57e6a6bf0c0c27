"""The boundary into native.c: every index and size a call hands to C is checked once per call
in native.py, and a wrong one raises ValueError naming it (the call never reaches C, which
would read or write outside a buffer). Bad drafter checkpoints are refused when they load,
naming the field."""

import ctypes
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_native
from vocabspec.runtime import native
from vocabspec.speculation.families.eagle import DrafterMismatch, EagleDrafter, EagleProposer
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter


@pytest.fixture(scope="module")
def target():
    return tiny_native("llama", seed=4, n_layers=6)[1]


def native_drafter(target):
    drafter = EagleDrafter.random(target, seed=1)
    drafter.pack("f32")
    from vocabspec.speculation.vocab.draft_vocab import FullVocab

    proposer = EagleProposer(drafter, draft_vocab=FullVocab(target.packed_head), depth=3, top_k=4, total_tokens=8)
    return proposer.drafting.native, drafter.new_cache(64)


def test_target_calls_refuse_out_of_range_values(target):
    with pytest.raises(ValueError, match="token id 200 is outside"):
        target.embed_tokens(torch.tensor([3, 200]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        target.embed_tokens(torch.tensor([-1]))

    def verify(hidden, tokens, parents):
        return target.verify_greedy_trees(hidden, [(tokens, parents)])[0]

    hidden = torch.randn(3, target.args.dim)
    tokens = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="row 2's parent 2 is not an earlier row"):
        verify(hidden, tokens, torch.tensor([-1, 0, 2]))
    with pytest.raises(ValueError, match="row 1's parent -1"):
        verify(hidden, tokens, torch.tensor([-1, -1, 0]))
    with pytest.raises(ValueError, match="root"):
        verify(hidden, tokens, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="3 tokens, 2 parents"):
        verify(hidden, tokens, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"rows of 64 floats, not \(3, 32\)"):
        verify(hidden[:, :32], tokens, torch.tensor([-1, 0, 1]))
    assert verify(hidden, tokens, torch.tensor([-1, 0, 1]))[0][0] == 0   # the well-formed call runs
    cache = target.new_cache(512)          # more slots than the RoPE tables' 256 positions
    x = torch.randn(2, target.args.dim)
    with pytest.raises(ValueError, match=r"position 300 is outside \[0, 256\)"):
        target.stack.forward(x.clone(), torch.tensor([300, 301]), cache.keys, cache.values, 300, 0)
    with pytest.raises(ValueError, match="committed length must be an integer >= 0, not -3"):
        target.stack.forward(x.clone(), torch.tensor([0, 1]), cache.keys, cache.values, -3, 0)
    with pytest.raises(ValueError, match="host memory, not a tensor on meta"):     # its address is 0
        target.stack.forward(x.to("meta"), torch.tensor([0, 1]), cache.keys, cache.values, 0, 0)
    with pytest.raises(ValueError, match="kept pending slot"):
        native.cache_keep(cache.keys, cache.values, 10, [0, cache.values.shape[-2]])
    with pytest.raises(ValueError, match="must increase"):
        native.cache_keep(cache.keys, cache.values, 10, [3, 1])


def test_drafter_calls_refuse_out_of_range_values(target):
    drafter, cache = native_drafter(target)
    rows = torch.randn(2, drafter.input_width)
    with pytest.raises(ValueError, match="token id 999 is outside"):
        drafter.read(cache.keys, cache.values, 0, [1, 999], rows)
    with pytest.raises(ValueError, match="committed length must be an integer >= 0, not -1"):
        drafter.read(cache.keys, cache.values, -1, [1, 2], rows)
    drafter.read(cache.keys, cache.values, 0, [1, 2], rows)
    with pytest.raises(ValueError, match="root token id 200 is outside"):
        drafter.tree(cache.keys, cache.values, 2, 200, 4, 3, 8)
    with pytest.raises(ValueError, match="tree depth must be an integer >= 0, not -2"):
        drafter.tree(cache.keys, cache.values, 2, 5, 4, -2, 8)
    with pytest.raises(ValueError, match="total_tokens must be an integer >= 1, not 0"):
        drafter.tree(cache.keys, cache.values, 2, 5, 4, 3, 0)
    with pytest.raises(ValueError, match="1 to 64 children"):
        drafter.tree(cache.keys, cache.values, 2, 5, 65, 3, 8)
    tokens, parents, _, _ = drafter.tree(cache.keys, cache.values, 2, 5, 4, 3, 8)
    assert len(tokens) == 9 and parents[0] == -1


def test_a_native_drafter_whose_head_ids_leave_the_embedding_is_refused(target):
    drafter = EagleDrafter.random(target, seed=1)
    drafter.pack("f32")
    fc, stack = drafter.runtime.fc, drafter.runtime.stack
    head = target.packed_head
    bad = torch.arange(head.rows)
    bad[7] = 5000
    with pytest.raises(ValueError, match="target id 5000 is outside"):
        native.NativeDrafter(fc, stack, head, bad, target.embed_weight, None,
                             target.norm.weight, 1e-6)


def eagle3_variants(tmp_path, target):
    a = target.args
    config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          intermediate_size=a.intermediate_size, n_layers=1, norm_eps=1e-6, rope_base=10000.0,
                          draft_vocab_size=150, aux_layers=(1, 3, 5), target_dim=a.dim)
    drafter = Eagle3Drafter.random(target, config, seed=1)
    good = tmp_path / "good"
    drafter.save(good, layout="speculators")
    state = load_file(str(good / "model.safetensors"))
    cfg = json.loads((good / "config.json").read_text())
    layer = cfg["transformer_layer_config"]

    def variant(name, tensors=None, config=None):
        directory = tmp_path / name
        directory.mkdir()
        save_file(tensors if tensors is not None else state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config if config is not None else cfg))
        return directory

    t2d_int = state["t2d"].to(torch.int64)
    t2d_int[3] = 7
    t2d_moved = state["t2d"].clone()
    t2d_moved[int(state["t2d"].nonzero()[0, 0])] = False
    t2d_moved[199] = not bool(t2d_moved[199])
    d2t_far = state["d2t"].clone()
    d2t_far[10] = -100
    return good, {
        "d2t below 0": (variant("d2t-low", {**state, "d2t": d2t_far}), "d2t does not map"),
        "d2t past the vocabulary": (variant("d2t-high", {**state, "d2t": state["d2t"] + 500}), "d2t does not map"),
        "missing tensor": (variant("missing", {k: v for k, v in state.items() if k != "norm.weight"}), "norm.weight"),
        "unknown tensor": (variant("unknown", {**state, "extra.weight": torch.zeros(2)}), "extra.weight"),
        "tensor shape": (variant("shape", {**state, "fc.weight": torch.zeros(64, 64)}), "fc.weight"),
        "d2t 2-D": (variant("d2t-2d", {**state, "d2t": state["d2t"][None]}), "d2t must be one row"),
        "d2t floats": (variant("d2t-float", {**state, "d2t": state["d2t"].float()}), "d2t must be one row"),
        "t2d entry": (variant("t2d-int", {**state, "t2d": t2d_int}), r"t2d\[3\] is 7"),
        "t2d length": (variant("t2d-short", {**state, "t2d": state["t2d"][:100]}), "t2d of shape"),
        "t2d disagrees": (variant("t2d-moved", {**state, "t2d": t2d_moved}), "t2d"),
        "hidden size": (variant("hidden", config={**cfg, "target_hidden_size": 96}), "width 96"),
        "tap past depth": (variant("tap", config={**cfg, "eagle_aux_hidden_state_layer_ids": [1, 3, 7]}),
                           r"layers \[1, 3, 7\]"),
        "tap not a number": (variant("tap-text", config={**cfg, "eagle_aux_hidden_state_layer_ids": [1, "x", 5]}),
                             "malformed"),
        "heads": (variant("heads", config={**cfg, "transformer_layer_config": {**layer, "num_key_value_heads": 3}}),
                  "key-value heads"),
        "layer width": (variant("width", config={**cfg, "transformer_layer_config": {**layer, "hidden_size": 96}}),
                        "hidden_size 96"),
    }


def test_bad_eagle3_checkpoints_are_refused_naming_the_field(tmp_path, target):
    good, cases = eagle3_variants(tmp_path, target)
    Eagle3Drafter.load(good, target)
    for name, (directory, message) in cases.items():
        with pytest.raises(DrafterMismatch, match=message):
            Eagle3Drafter.load(directory, target)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(DrafterMismatch, match="unreadable"):
        Eagle3Drafter.load(tmp_path / "empty", target)
    with pytest.raises(ValueError, match="SpecVocab"):
        Eagle3Drafter.load(good, target).draft_vocab("spec:64")


def test_eagle2_checkpoint_taps_past_the_depth_are_refused(tmp_path, target):
    drafter = EagleDrafter.random(target, seed=1)
    drafter.save(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    for taps, message in (([1, 9], "taps"), ("1,2", "list of layer indices"), ([1, "a"], "integers")):
        config.setdefault("vocabspec", {})["taps"] = taps
        (tmp_path / "d" / "config.json").write_text(json.dumps(config))
        with pytest.raises(DrafterMismatch, match=message):
            EagleDrafter.load(tmp_path / "d", target)


def test_the_attention_scratch_holds_the_largest_team_whatever_torchs_thread_count():
    """The attention's per-thread scratch is sized for the largest team a forward runs, not for
    OpenMP's current maximum, which torch.set_num_threads lowers (the self-written prompts' draw
    runs torch on one thread): a stack sized then and run by a team of two wrote past its
    scratch, a heap corruption that aborted a later allocation. Its size no longer moves with
    torch's threads, and a prefill sized under one thread and run by two has the bits of one
    run by one thread (under the sanitizer pass, with no report)."""
    import ctypes

    threads = torch.get_num_threads()
    native.threads()            # the engine's team fixed at torch's default, as in a long process
    reference = None
    try:
        torch.set_num_threads(1)
        native.set_threads(1)
        _, model = tiny_native("llama", seed=7, n_layers=2)
        ids = torch.randint(6, 200, (40,), generator=torch.Generator().manual_seed(0))
        reference = model.tree_forward(ids, torch.arange(40), model.new_cache(64))[0]
        _, fresh = tiny_native("llama", seed=7, n_layers=2)       # its scratch sized under one thread
        native.set_threads(2)
        hidden = fresh.tree_forward(ids, torch.arange(40), fresh.new_cache(64))[0]
        stack = ctypes.byref(fresh.stack.stack)
        sized_at_one = native.library().vs_attention_scratch(stack)
        torch.set_num_threads(2)
        assert native.library().vs_attention_scratch(stack) == sized_at_one
    finally:
        torch.set_num_threads(threads)
        native.set_threads(0)
    assert torch.equal(hidden, reference)


@pytest.mark.parametrize("name, first, second", [("Weight", "type", "data"), ("Rows", "n", "ntaps"),
                                                 ("VerifyRequest", "norm", "head"), ("ReadRequest", "drafter", "stack"),
                                                 ("Cache", "layers", "n_kv")])
def test_a_struct_mirror_that_disagrees_with_the_header_stops_the_load(monkeypatch, name, first, second):
    """native.py's ctypes mirrors are checked against native.h's layout: a mirror with two
    fields swapped is refused, naming the ABI."""
    lib = native.library()
    native.check_abi(lib)                       # the real mirrors agree
    fields = list(getattr(native, name)._fields_)
    names = [field[0] for field in fields]
    i, j = names.index(first), names.index(second)
    fields[i], fields[j] = fields[j], fields[i]
    monkeypatch.setattr(native, name, type(name, (ctypes.Structure,), {"_fields_": fields}))
    with pytest.raises(RuntimeError, match="disagree on the ABI"):
        native.check_abi(lib)
