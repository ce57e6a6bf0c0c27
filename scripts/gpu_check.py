"""The GPU check: exactness, read-backs, CUDA graphs and speed on one CUDA device, in minutes.

1. Exactness: on the Spec-Bench category prompts, greedy EAGLE-2 (full head and FR-Spec 32k,
   and FR 32k with prompt lookup's path grafted on), prompt lookup and plain decoding as graph
   steps captured as CUDA graphs (graph_step.py), against plain decoding, in float32 (TF32
   off; must be 0 mismatches) and bfloat16 (torch's kernels are not row-count invariant
   there: mismatches are counted and reported).
2. Read-backs: every way a tensor reaches the host is counted over a generation: at most one
   a step.
3. Speed: tokens/s of each method, float32 and bfloat16, SmolLM2; plain decoding and EAGLE-2
   (FR 32k) also with capture off (eager graph steps), so the graphs' share is visible.
4. Drafting cost on a random model shaped like Llama-3-8B (128k vocabulary): an EAGLE-2 5x48
   draft with FR-Spec's 32k head against the full head, captured and eager.
5. The tree for this device: EAGLE-2 FR 32k also runs at the (depth, size) that the graph-step
   tuner (autotune.choose_graph_tree) picks on its own calibration prompts, not these; its
   table (step milliseconds and tau by depth and size) is reported, per dtype.
6. Profile: one float32 step of plain decoding and of EAGLE-2 FR 32k under torch.profiler,
   captured and eager; the kernels that take the device's time, and a trace of each.
7. Exact and fast (exact_bf16): bfloat16 plain decoding as torch's captured graph step against
   the row-invariant kernels' captured graph step (--backend triton), and EAGLE-2 FR 32k on the
   kernels at the tree the graph-step tuner picks for them: tok/s, and mismatches against plain
   decoding on the kernels (0 for an exact method) and, for torch's step, how far torch's
   kernels drift from them.
8. The linear kernels (linear): microseconds of cuBLAS (F.linear), the row-invariant multiply-add
   kernel and the tensor-core (tl.dot) kernel at a few decoding shapes (triton.testing.do_bench),
   whether the tensor-core kernel proved row-invariant in each dtype (the decision the kernels
   take), the fused epilogues (rotary and the cache write in QKV's kernel, the argmax in the
   head's) against their unfused launches, attention with multiply-adds and on tensor cores,
   and SmolLM2's launches a layer on the kernels, unfused and fused.

Every graph-step engine is warmed, graphs captured and kernels compiled, on the prompts'
cache sizes before it is timed. Writes report.md and run.json to the folder given.

    python scripts/gpu_check.py --gguf /tmp/smollm2.gguf --prompts prompts.json --out OUT

--device cpu tries the script on a CPU (sections linear and drafting on cut-down shapes, Triton
under its interpreter: TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vocabspec.tuning import autotune  # noqa: E402
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer  # noqa: E402
from vocabspec.speculation.vocab.draft_vocab import FullVocab, StaticSubset  # noqa: E402
from vocabspec.decoding.generate import GenerationConfig  # noqa: E402
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.hybrid import EagleLookupProposer  # noqa: E402
from vocabspec.runtime.kv_cache import DeviceKVCache  # noqa: E402
from vocabspec.runtime.loading import load_model  # noqa: E402
from vocabspec.runtime.model import ModelArgs, Transformer  # noqa: E402
from vocabspec.speculation.families.pld import PromptLookupProposer  # noqa: E402
from vocabspec.runtime.prompts import encode_conversation  # noqa: E402
from vocabspec.decoding.graph_step import count_read_backs  # noqa: E402
from vocabspec.runtime.cuda_graph import capture_graph  # noqa: E402
from vocabspec.speculation.vocab.token_map import load_token_map  # noqa: E402
from vocabspec.runtime.tokenizer import load_tokenizer  # noqa: E402

DRAFTER = Path(__file__).resolve().parents[1] / "vocabspec" / "drafters" / "smollm2"


DEVICE = "cuda"
RUN = time.strftime("%Y%m%dT%H%M%S")     # the tuner's cache key: each run measures afresh


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def drafter_and_heads(model):
    """The shipped drafter, its full head and FR-Spec's 32k, in the drafter's dtype."""
    drafter = EagleDrafter.load(DRAFTER, model)
    full = FullVocab(model.embed.weight.to(drafter.fc.weight.dtype))
    fr = StaticSubset(model.embed.weight, load_token_map(DRAFTER / "token_map_fr.pt")[:32768],
                      name="fr:32k", dtype=drafter.fc.weight.dtype)
    return drafter, full, fr


def methods(model, tuned: tuple[int, int] | None = None) -> dict:
    """The methods checked; with a `tuned` (depth, total_tokens), also EAGLE-2 FR 32k there."""
    drafter, full, fr = drafter_and_heads(model)
    out = {"plain": None, "pld": PromptLookupProposer(device=model.device),
           "eagle2 5x48": EagleProposer(drafter, draft_vocab=full, depth=5, top_k=8, total_tokens=48),
           "eagle2+fr:32k 5x48": EagleProposer(drafter, draft_vocab=fr, depth=5, top_k=8, total_tokens=48),
           "eagle2+fr:32k+pld 5x48": EagleLookupProposer(drafter, draft_vocab=fr, depth=5, top_k=8, total_tokens=48)}
    if tuned is not None:
        depth, total = tuned
        out[f"eagle2+fr:32k {depth}x{total} (tuned)"] = EagleProposer(
            drafter, draft_vocab=fr, depth=depth, top_k=8, total_tokens=total)
    return out


def tune(model, tokenizer) -> dict:
    """The graph-step tuner's choice for EAGLE-2 FR 32k on this device and dtype, measured
    afresh this run (its own key), with its table."""
    drafter, _, fr = drafter_and_heads(model)
    return autotune.graph_tree_choice(model, drafter, fr, tokenizer, depth=6, top_k=8,
                                       key=f"gpu_check {RUN}|fr:32k|{model.weights}")


def warm(engines: dict, ids: list[list[int]], config: GenerationConfig) -> None:
    """Each engine run on the shortest, a middle and the longest prompt with `config`: the graph
    decoders (one per cache size) those prompts need are made, their graphs captured and their
    kernels compiled before anything is timed."""
    by_length = sorted(ids, key=len)
    for prompt in {id(p): p for p in (by_length[0], by_length[len(by_length) // 2], by_length[-1])}.values():
        for engine in engines.values():
            engine.generate(prompt, config)


def graph_rows(engines: dict, rows: dict) -> None:
    """Each timed row's captured graphs, capture failures and replay times, from its engine."""
    for name, row in rows.items():
        decoders = engines[name].decoders.values()
        row["graphs"] = sum(len(d.graphs) for d in decoders)
        row["graph_failures"] = [why for d in decoders for why in d.graph_failures.values()]
        try:                                   # a timing aid: never the section's undoing
            row["replay_ms"] = replay_ms(engines[name])
        except Exception as exc:  # noqa: BLE001
            row["replay_ms"] = {"error": f"{type(exc).__name__}: {exc}"}


def make_engines(model, tokenizer, graphs: bool, warmup_ids: list[int], only=None, tuned=None) -> dict:
    """Graph-step engines per method (with the tuner's tree too where `tuned` names one), their
    decoders made (and graphs captured) on `warmup_ids` while CUDA graphs are on or off as asked."""
    os.environ["VOCABSPEC_CUDA_GRAPHS"] = "1" if graphs else "0"
    engines = {name: Engine(model, tokenizer, proposer, allow_inexact=True, graphs=True)
               for name, proposer in methods(model, tuned).items() if only is None or name in only}
    for engine in engines.values():                      # warm-up: decoders, graphs
        engine.generate(warmup_ids, GenerationConfig(max_new_tokens=8))
    os.environ["VOCABSPEC_CUDA_GRAPHS"] = "1"
    return engines


def check_model(path: Path, prompts: list[str], weights: str, new_tokens: int, budget_s: float) -> dict:
    """Every method on each prompt in turn, until the prompts or `budget_s` run out."""
    model, _ = load_model(str(path), weights=weights, device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = [encode_conversation(tokenizer, [("user", p)], answer_open=True) for p in prompts]
    config = GenerationConfig(max_new_tokens=new_tokens)
    record = tune(model, tokenizer)
    tuned = (record["depth"], record["total_tokens"]) if record["total_tokens"] else None
    engines = make_engines(model, tokenizer, graphs=True, warmup_ids=ids[0], tuned=tuned)
    eager = make_engines(model, tokenizer, graphs=False, warmup_ids=ids[0], only=("plain", "eagle2+fr:32k 5x48"))
    engines.update({f"{name} (eager)": engine for name, engine in eager.items()})
    rows = timed_rows(engines, ids, config, budget_s)
    graph_rows(engines, rows)
    rows["tuner"] = {"chosen": f"{record['depth']}x{record['total_tokens']}",
                     "measured_speedup": record["measured_speedup"],
                     "plain_step_ms": round(record["plain_step_s"] * 1e3, 3),
                     "loop_ms": round(record["loop_s"] * 1e3, 3),
                     "step_ms": {k: round(r["step_s"] * 1e3, 3) for k, r in record["table"].items()},
                     "tau": {k: r["tau"] for k, r in record["table"].items()}}
    return rows


def timed_rows(engines: dict, ids: list[list[int]], config: GenerationConfig, budget_s: float) -> dict:
    """Every engine on each prompt in turn until the prompts or `budget_s` run out: tokens,
    seconds, steps and mismatches against the first engine's tokens (plain decoding's), per
    engine, with tok/s, speedup over the first and tau. (The first engine runs first on each
    prompt.)"""
    rows = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "mismatches": 0, "prompts": 0} for name in engines}
    started = time.perf_counter()
    for prompt in ids:
        if time.perf_counter() - started > budget_s:
            break
        reference = None
        for name, engine in engines.items():
            # Decoders are made per cache size as prompts need them: capture stays off for the
            # eager engines' later ones too.
            os.environ["VOCABSPEC_CUDA_GRAPHS"] = "0" if name.endswith("(eager)") else "1"
            sync()
            start = time.perf_counter()
            out = engine.generate(prompt, config)
            sync()
            os.environ["VOCABSPEC_CUDA_GRAPHS"] = "1"
            row = rows[name]
            row["seconds"] += time.perf_counter() - start
            row["tokens"] += out.new_tokens
            row["steps"] += len(out.steps)
            row["prompts"] += 1
            reference = out.tokens if reference is None else reference
            row["mismatches"] += out.tokens != reference
    first = next(iter(rows.values()))
    for row in rows.values():
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1)
        row["speedup"] = round(row["tokens_per_s"] / (first["tokens"] / first["seconds"]), 2)
        row["tau"] = round(row["tokens"] / max(row["steps"], 1), 2)
    return rows


def check_kernels(path: Path, prompts: list[str], weights: str, new_tokens: int, budget_s: float) -> dict:
    """The row-invariant kernels (--backend triton): plain decoding, prompt lookup and EAGLE-2
    (FR 32k, alone and with the lookup path) in the general loop, each exact with no
    --allow-inexact, mismatches counted against plain decoding on the same kernels."""
    model, _ = load_model(str(path), weights=weights, device=DEVICE, backend="triton")
    tokenizer = load_tokenizer(path)
    ids = [encode_conversation(tokenizer, [("user", p)], answer_open=True) for p in prompts]
    drafter, _, fr = drafter_and_heads(model)
    proposers = {"plain": None, "pld": PromptLookupProposer(device=model.device),
                 "eagle2+fr:32k 4x16": EagleProposer(drafter, draft_vocab=fr, depth=4, top_k=8, total_tokens=16),
                 "eagle2+fr:32k+pld 4x16": EagleLookupProposer(drafter, draft_vocab=fr, depth=4, top_k=8, total_tokens=16)}
    engines = {name: Engine(model, tokenizer, proposer, graphs=False) for name, proposer in proposers.items()}
    for engine in engines.values():                                  # warm-up: compiles the kernels
        engine.generate(ids[0], GenerationConfig(max_new_tokens=4))
    return timed_rows(engines, ids, GenerationConfig(max_new_tokens=new_tokens), budget_s)


def check_exact(path: Path, prompts: list[str], new_tokens: int, budget_s: float) -> dict:
    """bfloat16 graph steps, captured: plain decoding and EAGLE-2 FR 32k at the tuner's tree on
    the row-invariant kernels (mismatches against the first: exact means 0), and plain decoding
    on torch's kernels (its mismatches: where torch's rounding leads elsewhere)."""
    exact, _ = load_model(str(path), weights="bf16", device=DEVICE, backend="triton")
    fast, _ = load_model(str(path), weights="bf16", device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = [encode_conversation(tokenizer, [("user", p)], answer_open=True) for p in prompts]
    drafter, _, fr = drafter_and_heads(exact)
    record = tune(exact, tokenizer)
    # The tuner's tree; where no tree beat plain decoding there, the best it measured.
    chosen = record if record["total_tokens"] else autotune.pick(record["table"])
    depth, total = chosen["depth"], chosen["total_tokens"]
    tuned = EagleProposer(drafter, draft_vocab=fr, depth=depth, top_k=8, total_tokens=total)
    label = "tuned" if record["total_tokens"] else "the tuner's best, slower than plain there"
    engines = {"exact plain": Engine(exact, tokenizer, None, graphs=True),
               f"exact eagle2+fr:32k {depth}x{total} ({label})": Engine(exact, tokenizer, tuned, graphs=True),
               "torch plain": Engine(fast, tokenizer, None, graphs=True, allow_inexact=True)}
    config = GenerationConfig(max_new_tokens=new_tokens)
    warm(engines, ids, config)
    rows = timed_rows(engines, ids, config, budget_s)
    graph_rows(engines, rows)
    rows["tuner"] = {"chosen": f"{record['depth']}x{record['total_tokens']}",
                     "measured_speedup": record["measured_speedup"]}
    return rows


# (rows, K, N) of the products timed: SmolLM2's MLP up projection for one token, Gemma 3 270M's
# for a 64-row tree, and a Llama-3-8B-sized one for one and 64 rows.
LINEAR_SHAPES = ((1, 576, 1536), (64, 640, 2048), (1, 4096, 14336), (64, 4096, 14336))


def bench_ms(fn) -> float:
    """Milliseconds a call of `fn` takes: triton.testing.do_bench on a GPU, one timed call
    after one warm-up elsewhere (the CPU's try of the script)."""
    if DEVICE == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def linear_kernels(path: Path | None) -> dict:
    """The tensor-core kernel's row-invariance decision per dtype (and how long it took), each
    linear kernel's microseconds at LINEAR_SHAPES in bfloat16, and (with SmolLM2's GGUF) its
    launches a layer on the kernels, unfused and fused. On a CPU the shapes are cut 64-fold."""
    import torch.nn.functional as F

    from vocabspec.runtime import kernels
    from vocabspec.runtime.launches import layer_launches

    result = {"decision": {}, "us": {}}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        start = time.perf_counter()
        result["decision"][str(dtype).removeprefix("torch.")] = {
            "tensor_cores_row_invariant": kernels.dot_is_row_invariant(DEVICE, dtype),
            "check_s": round(time.perf_counter() - start, 2)}
    cut = 1 if DEVICE == "cuda" else 64
    generator = torch.Generator().manual_seed(0)
    for rows, k, n in LINEAR_SHAPES:
        k, n = max(k // cut, 16), max(n // cut, 16)
        x = torch.randn(rows, k, generator=generator).to(DEVICE, torch.bfloat16)
        weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(DEVICE, torch.bfloat16)
        result["us"][f"{rows}x{k}x{n}"] = {
            "cublas": round(bench_ms(lambda: F.linear(x, weight)) * 1e3, 1),
            "multiply_add": round(bench_ms(lambda: kernels.linear(x, weight, use_dot=False)) * 1e3, 1),
            "tensor_cores": round(bench_ms(lambda: kernels.linear(x, weight, use_dot=True)) * 1e3, 1)}
    result["epilogues_us"] = epilogue_us(cut)
    result["attention_us"] = attention_us(cut)
    if path is not None:
        model, _ = load_model(str(path), weights="bf16", device=DEVICE, backend="triton")
        token, position = torch.tensor([1], device=DEVICE), torch.tensor([0], device=DEVICE)
        for fused in (False, True):
            model.use_kernels(fused=fused)
            result[f"launches a layer, {'fused' if fused else 'unfused'}"] = layer_launches(
                model, token, position, model.new_cache(8))
    return result


def epilogue_us(cut: int) -> dict:
    """Microseconds of each fused epilogue beside its unfused launches, bfloat16, SmolLM2's
    shapes (its head dimension and vocabulary cut `cut`-fold, K 64-fold, on a CPU), per row
    count: the QKV projection with rotary and the cache write (kernels.qkv_rope_cache) against
    the projection, model.apply_rope and index_copy_; the LM head's argmax
    (kernels.linear_argmax) against the head's logits and torch's argmax."""
    from vocabspec.runtime import kernels
    from vocabspec.runtime.model import apply_rope, rope_tables

    heads, groups, dim, k, vocab = 9, 3, max(64 // cut, 8), max(576 // cut, 16), max(49152 // cut, 64)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn((heads + 2 * groups) * dim, k, generator=generator) / k ** 0.5).to(DEVICE, torch.bfloat16)
    head = (torch.randn(vocab, k, generator=generator) / k ** 0.5).to(DEVICE, torch.bfloat16)
    keys = torch.zeros(groups, 256, dim, dtype=torch.bfloat16, device=DEVICE)
    values = torch.zeros_like(keys)
    cos, sin = (t.to(DEVICE) for t in rope_tables(dim, 10000.0, 256))
    out = {}
    for rows in (1, 16):
        x = torch.randn(rows, k, generator=generator).to(DEVICE, torch.bfloat16)
        slots = torch.arange(100, 100 + rows, device=DEVICE)
        c, s = cos[slots], sin[slots]

        def unfused_qkv():
            qkv = kernels.linear(x, weight)
            qk = qkv[:, :(heads + groups) * dim].view(rows, heads + groups, dim).transpose(0, 1).unsqueeze(0)
            qk = apply_rope(qk, c, s)
            keys.index_copy_(1, slots, qk[0, heads:])
            values.index_copy_(1, slots, qkv[:, (heads + groups) * dim:].view(rows, groups, dim).transpose(0, 1))
            return qk[0, :heads]
        out[f"{rows} rows"] = {
            "qkv_rope_cache": round(bench_ms(
                lambda: kernels.qkv_rope_cache(x, weight, None, c, s, slots, keys, values, heads)) * 1e3, 1),
            "qkv_then_rope_then_cache": round(bench_ms(unfused_qkv) * 1e3, 1),
            "head_argmax": round(bench_ms(lambda: kernels.linear_argmax(x, head)) * 1e3, 1),
            "head_then_argmax": round(bench_ms(lambda: kernels.linear(x, head).float().argmax(-1)) * 1e3, 1)}
    return out


def attention_us(cut: int) -> dict:
    """Microseconds of the attention kernel, one head at a time with multiply-adds against a key
    group's heads on tensor cores, bfloat16, SmolLM2's heads over 512 cached keys (its head
    dimension and the keys cut `cut`-fold on a CPU), causal rows after them, per row count."""
    from vocabspec.runtime import kernels

    heads, groups, dim, keys_seen = 9, 3, max(64 // cut, 8), max(512 // cut, 8)
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(groups, keys_seen + 16, dim, generator=generator).to(DEVICE, torch.bfloat16)
                    for _ in range(2))
    out = {}
    for rows in (1, 16):
        q = torch.randn(rows, heads, dim, generator=generator).to(DEVICE, torch.bfloat16)
        prefix = torch.full((rows,), keys_seen, dtype=torch.int32, device=DEVICE)
        xoff = torch.arange(rows + 1, dtype=torch.int32, device=DEVICE) * rows
        extra = (keys_seen + torch.arange(rows, device=DEVICE)).repeat(rows).to(torch.int32)
        xend = xoff[:-1] + torch.arange(1, rows + 1, dtype=torch.int32, device=DEVICE)
        seen = (q, keys, values, prefix, xoff, extra, dim ** -0.5)
        out[f"{rows} rows"] = {
            name: round(bench_ms(lambda: kernels.attention(*seen, xend=xend, use_dot=dot)) * 1e3, 1)
            for name, dot in (("multiply_add", False), ("tensor_cores", True))}
    return out


@torch.inference_mode()                      # the step's buffers are inference tensors
def replay_ms(engine, replays: int = 8) -> dict:
    """Milliseconds of each captured step replayed alone (the device's share of a step), its
    state restored after each replay so that the cache never fills."""
    times = {}
    for decoder in engine.decoders.values():
        for key, (graph, _) in decoder.graphs.items():
            total = 0.0
            for _ in range(replays):
                with decoder.rewound():
                    sync()
                    start = time.perf_counter()
                    graph.replay()
                    sync()
                    total += time.perf_counter() - start
            times[f"{decoder.max_len} slots, {key[1]} rows"] = round(total / replays * 1e3, 3)
    return times


def profile_steps(path: Path, prompt: str, out: Path, steps: int = 3) -> dict:
    """Plain decoding's and EAGLE-2 FR 32k's float32 step under torch.profiler, `steps` runs
    each in place (rewound), captured and eager: per run, the top kernels (on the CPU: operations)
    by their own time, in microseconds a step; each profile's trace goes to OUT."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = load_model(str(path), weights="f32", device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = encode_conversation(tokenizer, [("user", prompt)], answer_open=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    own_time = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    result = {}
    for graphs in (True, False):
        only = ("plain", "eagle2+fr:32k 5x48")
        for name, engine in make_engines(model, tokenizer, graphs, ids, only=only).items():
            os.environ["VOCABSPEC_CUDA_GRAPHS"] = "1" if graphs else "0"
            generation = engine.stream(ids, GenerationConfig(max_new_tokens=16, stop_on_eos=False))
            for _ in generation:
                pass
            decoder, draft = generation.decoder, engine.proposer is not None
            with torch.inference_mode():
                with decoder.rewound():
                    decoder.step(draft)           # capture (or warm up) outside the profile
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        with decoder.rewound():
                            decoder.step(draft)
                        sync()
            os.environ["VOCABSPEC_CUDA_GRAPHS"] = "1"
            label = f"{name} {'graph' if graphs else 'eager'}"
            prof.export_chrome_trace(str(out / f"trace {label}.json".replace(" ", "_")))
            events = [e for e in prof.key_averages() if getattr(e, own_time, 0) > 0]
            events.sort(key=lambda e: -getattr(e, own_time))
            result[label] = {"us_per_step": round(sum(getattr(e, own_time) for e in events) / steps, 1),
                             "top": [[e.key[:90], e.count // steps, round(getattr(e, own_time) / steps, 1)]
                                     for e in events[:15]]}
    return result


def read_backs(path: Path, prompt: str) -> dict:
    model, _ = load_model(str(path), weights="f32", device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = encode_conversation(tokenizer, [("user", prompt)], answer_open=True)
    out = {}
    for name, proposer in methods(model).items():
        engine = Engine(model, tokenizer, proposer, graphs=True, allow_inexact=True)
        config = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
        engine.generate(ids, config)
        with count_read_backs() as counts:
            result = engine.generate(ids, config)
        out[name] = {"read_backs": counts["n"], "steps": len(result.steps)}
    return out


def drafting_cost(layers: int, steps: int = 20) -> dict:
    """Milliseconds per EAGLE-2 5x48 draft on a random Llama-3-8B-shaped model, bfloat16, with
    the full head and FR-Spec's 32k: eager, and (on CUDA) replayed as a captured graph."""
    args = ModelArgs(arch="llama", vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=14336, norm_eps=1e-5, rope_base=500000.0,
                     max_seq_len=1024)
    with torch.device(DEVICE):
        model = Transformer(args).to(torch.bfloat16).eval().requires_grad_(False)
    drafter = EagleDrafter.random(model, dtype=torch.bfloat16)
    heads = {"full": FullVocab(model.embed.weight),
             "fr:32k": StaticSubset(model.embed.weight, torch.arange(32768), name="fr:32k")}
    result = {}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return round((time.perf_counter() - start) / steps * 1e3, 2)

    for name, head in heads.items():
        proposer = EagleProposer(drafter, draft_vocab=head, depth=5, top_k=8, total_tokens=48)
        form = proposer.graph_form(512)
        with torch.inference_mode():
            cache = DeviceKVCache(args.n_layers, args.n_kv_heads, args.head_dim, 512, model.dtype, model.device)
            hidden, _ = model.tree_forward(torch.arange(100, device=DEVICE), torch.arange(100, device=DEVICE), cache)
            cache.commit()
            proposer.reset(list(range(100)), hidden, 7)
            root = torch.tensor([7], device=DEVICE)
            result[f"{name} eager"] = timed(lambda: form.propose(root))
            if DEVICE == "cuda":
                graph, _ = capture_graph(lambda: form.propose(root).tokens, form.buffers(), [form.cache])
                result[f"{name} graph"] = timed(graph.replay)
    kind = "graph" if DEVICE == "cuda" else "eager"
    result["fr_over_full"] = round(result[f"fr:32k {kind}"] / result[f"full {kind}"], 2)
    return result


SECTIONS = ("read_backs", "f32", "drafting", "bf16", "profile", "triton_f32", "triton_bf16", "exact_bf16", "linear")


def report(run: dict, prompts: int, new_tokens: int) -> str:
    lines = [f"# GPU check: {run['device']}, torch {run['torch']}, {run['date']}", "",
             f"SmolLM2-135M-Instruct, up to {prompts} Spec-Bench prompts (column 'prompts': how many ran in the time given), {new_tokens} new tokens, greedy, "
             "graph steps (one read-back each) replayed as CUDA graphs unless marked eager; "
             "mismatches against plain decoding in the same dtype.", "",
             "| dtype | method | prompts | tok/s | speedup | tau | mismatches | graphs | capture failures |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    replays = []
    for weights in ("f32", "bf16"):
        for name, row in run.get(weights, {}).items():
            if name == "tuner":
                continue
            replays.append(f"{weights} {name}: {json.dumps(row.get('replay_ms', {}))}")
            lines.append(f"| {weights} | {name} | {row['prompts']} | {row['tokens_per_s']} | {row['speedup']}x | {row['tau']} | "
                         f"{row['mismatches'] if name != 'plain' else '-'} | {row['graphs']} | "
                         f"{'; '.join(row['graph_failures']) or '-'} |")
    if replays:
        lines += ["", "Captured steps replayed alone (ms, by cache slots and tree rows):", ""]
        lines += [f"- {r}" for r in replays]
    for section in ("triton_f32", "triton_bf16"):
        if section in run:
            lines += ["", f"Row-invariant kernels (--backend triton), {section[7:]}, general loop, no "
                      "--allow-inexact; mismatches against plain decoding on the same kernels:", "",
                      "| method | prompts | tok/s | speedup | tau | mismatches |", "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {name} | {row['prompts']} | {row['tokens_per_s']} | {row['speedup']}x | {row['tau']} | "
                      f"{row['mismatches'] if name != 'plain' else '-'} |" for name, row in run[section].items()]
    if "exact_bf16" in run:
        lines += ["", "Exact and fast, bfloat16, graph steps captured as CUDA graphs: the row-invariant kernels "
                  "(exact: mismatches against their plain decoding must be 0) and torch's kernels (their "
                  f"mismatches: where torch's rounding leads elsewhere); tuner: {json.dumps(run['exact_bf16'].get('tuner'))}", "",
                  "| method | prompts | tok/s | speedup | tau | mismatches | graphs | capture failures |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {row['prompts']} | {row['tokens_per_s']} | {row['speedup']}x | {row['tau']} | "
                  f"{row['mismatches'] if name != 'exact plain' else '-'} | {row['graphs']} | "
                  f"{'; '.join(row['graph_failures']) or '-'} |"
                  for name, row in run["exact_bf16"].items() if name != "tuner"]
    if "linear" in run:
        lines += ["", "Linear kernels, bfloat16, microseconds (rows x K x N): "
                  + json.dumps(run["linear"]["us"]), "",
                  "Tensor cores row-invariant (the kernels' decision): " + json.dumps(run["linear"]["decision"]),
                  "", "Fused epilogues against their unfused launches, bfloat16, microseconds: "
                  + json.dumps(run["linear"].get("epilogues_us")),
                  "", "Attention, bfloat16, microseconds: " + json.dumps(run["linear"].get("attention_us"))]
        lines += [f"{key}: {json.dumps(value)}" for key, value in run["linear"].items() if key.startswith("launches")]
    for weights in ("f32", "bf16"):
        if "tuner" in run.get(weights, {}):
            lines += ["", *tuner_lines(weights, run[weights]["tuner"])]
    for label, prof in run.get("profile", {}).items():
        lines += ["", f"Profile, {label}: {prof['us_per_step']} us of own time a step; top: " +
                  "; ".join(f"{k} x{n} {us} us" for k, n, us in prof["top"][:8])]
    if "read_backs" in run:
        lines += ["", "Read-backs over a 32-token generation (float32): " +
                  ", ".join(f"{n} {r['read_backs']} in {r['steps']} steps" for n, r in run["read_backs"].items())]
    if "drafting" in run:
        lines += ["", "Drafting per step, random Llama-3-8B-shaped model (bfloat16, tree 5x48): "
                  + json.dumps(run["drafting"]) + " ms"]
    for section, error in run.get("errors", {}).items():
        lines += ["", f"Section {section} failed: {error}"]
    lines += ["", f"Whole check: {run['seconds']} s."]
    return "\n".join(lines) + "\n"


def tuner_lines(weights: str, tuner: dict) -> list[str]:
    """The graph-step tuner's table as markdown: step ms (tau) by depth and tree size."""
    keys = [k.split("/") for k in tuner["step_ms"]]
    depths = sorted({int(d) for d, _ in keys})
    sizes = sorted({int(m) for _, m in keys})
    lines = [f"Graph-step tuner, {weights}, EAGLE-2 FR 32k, top_k 8 (its own calibration prompts): "
             f"chose {tuner['chosen']}, measured {tuner['measured_speedup']}x plain decoding; plain "
             f"step {tuner['plain_step_ms']} ms, loop {tuner['loop_ms']} ms a step. Step ms (tau):", "",
             "| depth | " + " | ".join(str(m) for m in sizes) + " |",
             "| --- |" + " --- |" * len(sizes)]
    for d in depths:
        cells = [f"{tuner['step_ms'][f'{d}/{m}']} ({tuner['tau'][f'{d}/{m}']})" if f"{d}/{m}" in tuner["step_ms"]
                 else "-" for m in sizes]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def project_prompts() -> list[str]:
    """The first prompt of each category in the project's own prompts (Spec-Bench's format)."""
    first = {}
    for line in (Path(__file__).resolve().parents[1] / "vocabspec" / "data" / "prompts.jsonl").read_text().splitlines():
        question = json.loads(line)
        first.setdefault(question["category"], question["turns"][0])
    return [first[c] for c in sorted(first)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="SmolLM2's GGUF file (every section but drafting and linear, "
                                       "which with it also counts SmolLM2's launches a layer)")
    parser.add_argument("--prompts", help="JSON list of prompts (default: the first of each category of "
                                          "the project's own prompts, vocabspec/data/prompts.jsonl)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per answer")
    parser.add_argument("--budget-s", type=float, default=120,
                        help="seconds per timed section (a dtype's, exact_bf16's) after which no "
                             "further prompt is started")
    parser.add_argument("--out", required=True, help="folder for report.md and run.json")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu to try the script")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--target-layers", type=int, default=32,
                        help="layers of the Llama-3-8B-shaped model (drafting reads none of them)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if set(sections) - {"drafting", "linear"} and not args.gguf:
        parser.error("every section but drafting and linear needs --gguf")
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else project_prompts()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    run = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "errors": {}}
    started = time.perf_counter()
    jobs = {"read_backs": lambda: read_backs(Path(args.gguf), prompts[0]),
            "f32": lambda: check_model(Path(args.gguf), prompts, "f32", args.new_tokens, args.budget_s),
            "bf16": lambda: check_model(Path(args.gguf), prompts, "bf16", args.new_tokens, args.budget_s),
            "drafting": lambda: drafting_cost(args.target_layers),
            "profile": lambda: profile_steps(Path(args.gguf), prompts[0], out),
            "triton_f32": lambda: check_kernels(Path(args.gguf), prompts, "f32", args.new_tokens, args.budget_s),
            "triton_bf16": lambda: check_kernels(Path(args.gguf), prompts, "bf16", args.new_tokens, args.budget_s),
            "exact_bf16": lambda: check_exact(Path(args.gguf), prompts, args.new_tokens, args.budget_s),
            "linear": lambda: linear_kernels(Path(args.gguf) if args.gguf else None)}
    for section in SECTIONS:
        if section not in sections:
            continue
        # A failing section is reported and the others still run: a GPU is lent for minutes.
        try:
            run[section] = jobs[section]()
            print(section, json.dumps(run[section]), flush=True)
        except Exception as exc:  # noqa: BLE001
            run["errors"][section] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        run["seconds"] = round(time.perf_counter() - started, 1)
        (out / "run.json").write_text(json.dumps(run, indent=1))
        (out / "report.md").write_text(report(run, len(prompts), args.new_tokens))
    print(report(run, len(prompts), args.new_tokens))


if __name__ == "__main__":
    main()
