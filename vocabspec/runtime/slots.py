"""Many sequences in one forward on torch's kernels: per-slot caches in one device tensor,
batched prefill and decode steps, and greedy answers to thousands of prompts at once.

`Model.forward` runs one sequence (a tree of rows over one cache); this runs rows of many
sequences through each weight once, which is what a GPU needs to be busy: a SmolLM2 step of
one row and of a thousand rows cost about the same time there.

Layout: each layer's keys and values are one tensor (slots, kv heads, window, head dim); slot
s holds one sequence, its position p at index p. Chosen over pages because every sequence here
has a window fixed up front, so a slot wastes at most its unused tail, a step's attention reads
each slot's keys as one strided batched product with no page table, and a finished sequence's
slot is refilled by moving the live ones down (`compact`), never by a gather at every step. The
batch engine's requests step here too, each in a slot of its own (`SlotSequence`), their trees
rows of the same forward (`SlotTree`, `forward_with_trees`).

Rows of different sequences never mix: every product is row-wise and attention reads only the
row's own slot, masked to its own positions. torch's kernels do not promise that a row gets the
same bits whatever the other rows are, so answers from here are the target's greedy answers up
to that rounding (training data, batch jobs with --allow-inexact). On the row-invariant kernels
(kernel_backend.SlotRows) they are exact. Each function takes the backend, whose `block` runs
a layer, `slot_forward` a step over the table and `slot_visibility` what a tree's rows see.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections import deque

import torch
import torch.nn.functional as F

from .cuda_graph import capture_graph
from .kv_cache import KVCache
from .model import CustomAttention, LayerPlan


class SlotCache:
    """Keys and values of `slots` sequences of up to `window` positions, per layer."""

    def __init__(self, model, slots: int, window: int):
        a = model.args
        shape = (slots, a.n_kv_heads, window, a.head_dim)
        kw = {"dtype": model.dtype, "device": model.device}
        self.keys = [torch.zeros(shape, **kw) for _ in range(a.n_layers)]
        self.values = [torch.zeros(shape, **kw) for _ in range(a.n_layers)]
        self.slots, self.window = slots, window
        most = model.slot_elements
        if most is not None and slots * a.n_kv_heads * window * a.head_dim > most:
            raise ValueError(f"{slots} slots of {window} positions pass the {most} "
                             f"elements a layer's keys may hold on {model.runs_on}")

    @staticmethod
    def bytes_per_slot(model, window: int) -> int:
        a = model.args
        return 2 * a.n_layers * a.n_kv_heads * window * a.head_dim * model.dtype.itemsize

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as the row-invariant kernels read and write a cache's
        (kv heads, slots, head dim), in place: the table (slots, kv heads, window, head dim)
        seen from its first slot, a key head's slots a window after the one before's, so that
        slot s's position p is slot `base(s) + p` of every key head (kernels.cache_stride)."""
        kv, dim = self.keys[layer].shape[1], self.keys[layer].shape[3]
        shape = (kv, (self.slots * kv - kv + 1) * self.window, dim)
        stride = (self.window * dim, dim, 1)
        return self.keys[layer].as_strided(shape, stride), self.values[layer].as_strided(shape, stride)

    def base(self, slots: torch.Tensor) -> torch.Tensor:
        """Where slot s's positions begin in `storage`."""
        return slots * (self.keys[0].shape[1] * self.window)

    @classmethod
    def fitting(cls, model, window: int, most: int, memory_share: float = 0.5) -> "SlotCache":
        """As many slots as `memory_share` of the device's free memory holds (at most `most`):
        the rest is for activations. ValueError where not even one fits."""
        per_slot = cls.bytes_per_slot(model, window)
        free = free_memory(model.device)
        slots = min(most, int(free * memory_share) // per_slot)
        if model.slot_elements is not None:
            a = model.args
            slots = min(slots, model.slot_elements // (a.n_kv_heads * window * a.head_dim))
        if slots < 1:
            raise ValueError(f"a slot of {window} positions needs {per_slot / 2**20:.0f} MiB of cache; "
                             f"{memory_share:.0%} of the {free / 2**20:.0f} MiB free on {model.device} "
                             f"holds none: ask for a shorter context")
        return cls(model, slots, window)

    def compact(self, keep: torch.Tensor, upto: int) -> None:
        """Move the slots `keep` (ascending) to the front, their first `upto` positions."""
        for table in (*self.keys, *self.values):
            table[:keep.numel(), :, :upto] = table[keep, :, :upto]


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the CUDA allocator's view there, the kernel's
    available memory (MemAvailable) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _attend_new(q, k, v, scale, window):
    """Prefill attention: each sequence's rows over its own rows, causally (and within the
    sliding window where the layer has one). q (B, H, n, D); k, v (B, KV, n, D)."""
    n = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if not window or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    i = torch.arange(n, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _attend_cached(q, keys, values, positions, scale, window):
    """Decode attention: one row per sequence over its slot's keys up to its position. The
    query heads that share a key head are one matrix against it, so every key is read once.
    q (B, H, 1, D); keys, values (B, KV, T, D) (views of the slot tables); positions (B,)."""
    b, heads, _, dim = q.shape
    kv = keys.shape[1]
    grouped = q.view(b, kv, heads // kv, dim)
    scores = (grouped @ keys.transpose(-1, -2)).float() * scale           # (B, KV, group, T)
    slot = torch.arange(keys.shape[2], device=q.device)
    seen = slot[None, :] <= positions[:, None]
    if window:
        seen &= positions[:, None] - slot[None, :] < window
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1).to(values.dtype) @ values           # (B, KV, group, D)
    return out.view(b, heads, 1, dim)


class SlotSequence(KVCache):
    """Slot `slot` of a SlotCache seen as one request's KVCache (the torch layout's rules), so
    that its prefill runs alone through `Transformer.forward` (its proposer reads the prompt's
    hidden states) and its trees join the batch's steps (`SlotTree`)."""

    def __init__(self, cache: SlotCache, slot: int):
        self.table, self.slot = cache, slot
        self.layout, self.max_len = "torch", cache.window
        self.length = self.pending = 0

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values of `layer` (1, kv heads, window, head dim), in place."""
        where = slice(self.slot, self.slot + 1)
        return self.table.keys[layer][where], self.table.values[layer][where]

    def move(self, source: torch.Tensor, target: slice) -> None:
        for table in (*self.table.keys, *self.table.values):
            table[self.slot, :, target] = table[self.slot, :, source]


class SlotTree:
    """A request's rows in a step over a SlotCache: its tree (or its root alone, with no
    `tree_mask`) written after the keys its `sequence` holds, in row order, at `positions`.
    `seen`: what each row attends to, as a forward of its request alone has it (the backend's
    `slot_visibility`; None on torch's kernels, where `tree_mask` shows it)."""

    def __init__(self, model, sequence: SlotSequence, tokens: torch.Tensor,
                 positions: torch.Tensor, tree_mask: torch.Tensor | None):
        if sequence.pending:
            raise ValueError("a tree goes after committed keys: commit first")
        sequence.check_room(tokens.numel())
        self.sequence, self.slot, self.tokens, self.positions = sequence, sequence.slot, tokens, positions
        self.rows, self.tree_mask = tokens.numel(), tree_mask
        self.seen = model.slot_visibility(sequence, positions, tree_mask)

    def places(self) -> torch.Tensor:
        start = self.sequence.length
        return torch.arange(start, start + self.rows, device=self.tokens.device)


class TreeRowsOnTorch(CustomAttention):
    """`forward_with_trees`' rows on torch's kernels: first one row per slot 0..b-1 (a plain
    row, a tree's root, or an idle slot's row, `live` False, which writes nowhere), then each
    tree's other rows. The slot rows attend as a decode step's rows do (`_attend_cached`), and
    each tree's other rows over a view of their own slot, masked to the committed keys and
    their ancestors: one batched product plus one per branching tree. torch rounds a row
    differently with other rows beside it (--allow-inexact)."""

    def __init__(self, cache: SlotCache, b: int, live: torch.Tensor, positions: torch.Tensor,
                 trees: list[SlotTree], window: int = 0, context: int = 0):
        self.cache, self.b, self.live, self.positions, self.trees = cache, b, live, positions, trees
        self.window, self.context = window, context or cache.window
        device = positions.device
        written = live.nonzero()[:, 0]
        rows, slots, places = [written], [written], [positions[written]]
        self.branches = []     # per tree with rows past its root: (first row, rows, slot, keys, mask)
        first = b
        for tree in trees:
            rest = tree.rows - 1
            if not rest:
                continue
            length = tree.sequence.length
            rows.append(torch.arange(first, first + rest, device=device))
            slots.append(torch.full((rest,), tree.slot, dtype=torch.long, device=device))
            places.append(tree.places()[1:])
            mask = torch.cat([torch.ones(rest, length, dtype=torch.bool, device=device), tree.tree_mask[1:]], 1)
            if window:
                keys_at = torch.cat([torch.arange(length, device=device), tree.positions])
                mask &= tree.positions[1:, None] - keys_at[None, :] < window
            self.branches.append((first, rest, tree.slot, length + tree.rows, mask))
            first += rest
        self.rows, self.slots, self.places = torch.cat(rows), torch.cat(slots), torch.cat(places)

    def visibility(self, window: int) -> "TreeRowsOnTorch":
        if window == self.window:
            return self
        return TreeRowsOnTorch(self.cache, self.b, self.live, self.positions, self.trees, window, self.context)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """The live rows of k, v (1, kv heads, N, head dim) into their slots; the layer's table,
        batched (1, slots, kv heads, window, head dim), which `attend` reads."""
        self.cache.keys[layer][self.slots, :, self.places] = k[0, :, self.rows].transpose(0, 1)
        self.cache.values[layer][self.slots, :, self.places] = v[0, :, self.rows].transpose(0, 1)
        return self.cache.keys[layer][None], self.cache.values[layer][None]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        keys, values, b = keys[0], values[0], self.b
        heads, dim = q.shape[1], q.shape[3]
        rows = q[0].transpose(0, 1)                                                  # (N, H, D)
        out = torch.empty_like(rows)
        context = self.context
        out[:b] = _attend_cached(rows[:b].unsqueeze(2).contiguous(), keys[:b, :, :context], values[:b, :, :context],
                                 self.positions[:b], scale, self.window).view(b, heads, dim)
        gqa = keys.shape[1] != heads
        for first, rest, slot, end, mask in self.branches:
            mine = F.scaled_dot_product_attention(q[:, :, first:first + rest], keys[slot:slot + 1, :, :end],
                                                  values[slot:slot + 1, :, :end], attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa)
            out[first:first + rest] = mine[0].transpose(0, 1)
        return out.transpose(0, 1)[None]


def forward_with_trees_on_torch(model, cache: SlotCache, tokens: torch.Tensor,
                                 positions: torch.Tensor, slots: torch.Tensor, trees: list[SlotTree],
                                 taps: tuple[int, ...]):
    """`forward_with_trees` on torch's kernels (TorchBackend.slot_forward), its rows laid out
    as `TreeRowsOnTorch` takes them and its outputs returned in `forward_with_trees`' order."""
    device = tokens.device
    b = max([int(slots.max()) + 1 if slots.numel() else 0, *(tree.slot + 1 for tree in trees)])
    slot_tokens = torch.zeros(b, dtype=torch.long, device=device)       # an idle slot's row feeds 0 at 0
    slot_positions = torch.zeros(b, dtype=torch.long, device=device)
    live = torch.zeros(b, dtype=torch.bool, device=device)
    slot_tokens[slots], slot_positions[slots], live[slots] = tokens, positions, True
    for tree in trees:
        slot_tokens[tree.slot], slot_positions[tree.slot] = tree.tokens[0], tree.positions[0]
        live[tree.slot] = True
    all_tokens = torch.cat([slot_tokens, *(tree.tokens[1:] for tree in trees)])
    all_positions = torch.cat([slot_positions, *(tree.positions[1:] for tree in trees)])
    context = max([int(positions.max()) + 1 if positions.numel() else 1,
                   *(tree.sequence.length + 1 for tree in trees)])
    rows = TreeRowsOnTorch(cache, b, live, all_positions, trees, context=context)
    out = blocks_over_slots(model, model.embed_tokens(all_tokens), all_positions, rows, taps)
    order, first = [slots], b
    for tree in trees:
        order += [torch.tensor([tree.slot], device=device), torch.arange(first, first + tree.rows - 1, device=device)]
        first += tree.rows - 1
    order = torch.cat(order)
    return (out[0][order], out[1][order]) if taps else out[order]


def blocks_over_slots(model, x: torch.Tensor, positions: torch.Tensor, rows, taps: tuple[int, ...]):
    """The model's layers over flat rows x (N, dim) at `positions` (N,) written and read through
    `rows` (TreeRowsOnTorch, or kernel_backend.SlotRows), each layer the backend's `block`; the
    hidden states (N, dim), and with `taps` those layers' outputs (N, taps * dim)."""
    window = model.args.sliding_window
    plan = LayerPlan()
    plan.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in model.rope.items()}
    plan.masks = {"global": (rows.visibility(0), 0)}
    if window is not None:
        plan.masks["local"] = (rows.visibility(window), 0)
    x, tapped = model.module.run_layers(x, plan, rows, taps, model.block)
    return (x, tapped) if taps else x


def forward_with_trees(model, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, trees: list[SlotTree], taps: tuple[int, ...] = ()):
    """One forward (the backend's `slot_forward`) of plain rows (tokens, positions, slots: (P,))
    and requests' trees (`SlotTree`, left pending in their slots); the hidden states before the
    final norm of all P + sum(tree rows) rows in that order (N, dim), and with `taps` those
    layers' outputs (N, len(taps) * dim)."""
    out = model.slot_forward(cache, tokens, positions, slots, trees, taps)
    for tree in trees:
        tree.sequence.advance(tree.rows)
    return out


def forward_rows(model, tokens: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache | None = None, first_slot: int = 0, context: int = 0,
                 taps: tuple[int, ...] = (), slots: torch.Tensor | None = None):
    """Hidden states before the final norm (B, n, dim) of B sequences' rows (the backend's
    `rows_forward`), and with `taps` those layers' outputs (B, n, len(taps) * dim):
    - prefill (positions 0..n-1 in every row, right-padded): each sequence's rows see its own
      causally; with `cache`, they fill slots first_slot..+B (or those listed in `slots`);
    - decode (n == 1, `cache`): row b at positions[b, 0] in slot b, after its cached positions;
      `context` bounds every row's position + 1 (known on the host: the device is never asked)."""
    return model.rows_forward(tokens, positions, cache, first_slot, context, taps, slots)


def forward_rows_on_torch(model, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache | None,
                          first_slot: int, context: int, taps: tuple[int, ...], slots: torch.Tensor | None):
    """`forward_rows` on torch's kernels (TorchBackend.rows_forward): the model's layers, each
    layer's attention over the slots its own way (B sequences of n rows, flattened for the
    projections and rotary as one sequence's rows are)."""
    b, n = tokens.shape
    decode = cache is not None and n == 1 and context > 0
    flat = positions.reshape(-1)
    plan = LayerPlan()
    plan.rows = {kind: (cos[flat], sin[flat]) for kind, (cos, sin) in model.rope.items()}
    plan.masks = {"global": (0, 0), "local": (model.args.sliding_window, 0)}     # each kind's window

    def layer(block, x, cos, sin, _, window):
        attn, i = block.attn, block.attn.layer
        q, k, v = (t[0].unflatten(1, (b, n)).transpose(0, 1)              # (B, heads, n, D)
                   for t in attn.rotate(attn.wqkv(block.attn_norm(x)).reshape(b * n, -1), cos, sin))
        if decode:
            rows = torch.arange(b, device=x.device)
            where = positions[:, 0]
            cache.keys[i][rows, :, where] = k[:, :, 0]
            cache.values[i][rows, :, where] = v[:, :, 0]
            out = _attend_cached(q, cache.keys[i][:b, :, :context], cache.values[i][:b, :, :context],
                                 where, attn.scale, window)
        else:
            if cache is not None:
                where = slice(first_slot, first_slot + b) if slots is None else slots
                cache.keys[i][where, :, :n] = k
                cache.values[i][where, :, :n] = v
            out = _attend_new(q, k, v, attn.scale, window)
        return block.after_attention(x, attn.wo(out.transpose(1, 2).reshape(b, n, attn.q_size)))

    x, tapped = model.module.run_layers(model.embed_tokens(tokens), plan, cache, taps, layer)
    return (x, tapped) if taps else x


def pad_rows(sequences: list[list[int]], device, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one right-padded (B, max length) tensor, and their lengths (B,)."""
    width = max(map(len, sequences))
    rows = torch.full((len(sequences), width), pad, dtype=torch.long)
    for r, seq in enumerate(sequences):
        rows[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in sequences])
    return rows.to(device), lengths.to(device)


def prefill_slots(model, cache: SlotCache, prompts: list[list[int]],
                  slots: torch.Tensor | None = None, first_slot: int = 0) -> torch.Tensor:
    """Run the prompts into their slots (`slots`, or first_slot onwards) in one padded forward;
    the logits (B, vocab) of each prompt's last row, whose successor is its first new token."""
    device = model.device
    rows, lengths = pad_rows(prompts, device)
    steps = torch.arange(rows.shape[1], device=device).expand_as(rows)
    hidden = forward_rows(model, rows, steps, cache, first_slot=first_slot, slots=slots)
    return model.lm_head(hidden[torch.arange(len(prompts), device=device), lengths - 1])


def prefill_group(lengths: list[int], most_tokens: int) -> int:
    """How many of the prompts, taken in order, the next padded prefill holds: as many as keep
    the longest one so far times their count within `most_tokens` (at least one), which bounds
    a prefill's activations."""
    longest, count = lengths[0], 1
    while count < len(lengths) and max(longest, lengths[count]) * (count + 1) <= most_tokens:
        longest = max(longest, lengths[count])
        count += 1
    return count


class DecodeStep:
    """A step of the first `rows` slots, one row each (each its slot's next token at its
    position): on a GPU every slot steps, captured as a CUDA graph per context length (rounded
    up to `bucket`, so a few graphs serve a whole run; one graph where the backend's attention
    reads each row's slot up to its own position whatever the context, `context_bound` False),
    since a small model's eager step is bound by launching its few hundred kernels, not by the
    device; elsewhere eagerly, the live slots only. Its output: each row's greedy token (`head`),
    or its hidden state (the batch's plain rows, verified by the loop)."""

    def __init__(self, model, cache: SlotCache, bucket: int = 128, head: bool = True):
        self.model, self.cache, self.bucket, self.head = model, cache, bucket, head
        self.graphed = model.device.type == "cuda"
        if self.graphed:
            n = cache.slots
            self.tokens = torch.zeros(n, 1, dtype=torch.long, device=model.device)
            self.positions = torch.zeros(n, 1, dtype=torch.long, device=model.device)
            self.graphs, self.pool = {}, torch.cuda.graph_pool_handle()

    def _step(self, tokens, positions, context):
        hidden = forward_rows(self.model, tokens, positions, self.cache, context=context)[:, 0]
        return self.model.greedy_tokens(hidden) if self.head else hidden

    def rows(self, live: int) -> int:
        return self.cache.slots if self.graphed else live

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
        """tokens, positions: (rows,), the slots' last tokens and their positions; `context`
        bounds every row's position + 1. On a GPU the output is the graph's own, valid until
        the next step."""
        if not self.graphed:
            return self._step(tokens[:, None], positions[:, None], context)
        bucket = self.bucket if self.model.context_bound else self.cache.window
        context = min(self.cache.window, -(-context // bucket) * bucket)
        self.tokens[:, 0].copy_(tokens)
        self.positions[:, 0].copy_(positions)
        if context not in self.graphs:
            try:
                # One warm-up run: it writes the keys and values the step will write, harmless.
                self.graphs[context] = capture_graph(lambda: self._step(self.tokens, self.positions, context),
                                                     warmup=1, pool=self.pool)
            except RuntimeError as exc:     # a build that cannot capture this step: run eagerly
                warnings.warn(f"decode steps run eagerly: capturing one failed ({exc})")
                self.graphed = False
                return self._step(self.tokens, self.positions, context)
        graph, out = self.graphs[context]
        graph.replay()
        return out


@torch.inference_mode()
def greedy_answers(model, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: list[int], slots: int = 1024, prefill_tokens: int = 65536,
                   check_every: int = 16, refill_below: float = 0.75, deadline: float | None = None,
                   progress=None) -> list:
    """The target's greedy answer (new tokens, the end-of-sequence token that ended one kept)
    to each prompt, decoded many at a time: live sequences step together, one row each
    (DecodeStep), and finished ones leave their slots every `check_every` steps (the one
    read-back of those steps), and queued prompts fill them once fewer than `refill_below` of
    the slots are live. Prompts are admitted shortest first, so a prefill pads little.
    `deadline` (time.perf_counter()): admit no prompt after it; prompts not answered are None.
    progress(answers done, new tokens so far) is called after each read-back."""
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("an empty prompt has no next token")
    window = max(map(len, prompts)) + max_new_tokens
    if window > model.args.max_seq_len:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens and {max_new_tokens} new ones "
                         f"pass the model's window of {model.args.max_seq_len}")
    batch = _GreedyBatch(model, prompts, max_new_tokens, eos_ids, window, min(slots, len(prompts)))
    batch.admit(prefill_tokens, deadline)
    steps_taken, done_answers, new_tokens = 0, 0, 0
    while batch.live:
        batch.step()
        steps_taken += 1
        if steps_taken % check_every == 0 or len(batch.live) == 1:
            before = len(batch.live)
            made = batch.harvest()
            if made:
                done_answers += before - len(batch.live)
                new_tokens += made
                if progress is not None:
                    progress(done_answers, new_tokens)
            if len(batch.live) < refill_below * batch.n:
                batch.admit(prefill_tokens, deadline)
    return batch.answers


class _GreedyBatch:
    """greedy_answers' sequences in the slots of one cache. Per slot, live ones first: the
    position of its last token's successor, that token, tokens produced, whether finished (free
    slots count as finished), and its answer so far; the prompts not yet admitted, shortest
    first; the answers done."""

    def __init__(self, model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                 window: int, slots: int):
        device = model.device
        self.model, self.prompts, self.max_new_tokens, self.window = model, prompts, max_new_tokens, window
        self.cache = SlotCache.fitting(model, window, slots)
        self.decode = DecodeStep(model, self.cache)
        self.queue = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
        self.answers: list = [None] * len(prompts)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
        self.n = n = self.cache.slots
        self.live: list[int] = []                          # prompt index per live slot
        self.host_position: list[int] = []                 # live slots' positions (host copy)
        self.position = torch.zeros(n, dtype=torch.long, device=device)
        self.last = torch.zeros(n, dtype=torch.long, device=device)
        self.produced = torch.zeros(n, dtype=torch.long, device=device)
        self.finished = torch.ones(n, dtype=torch.bool, device=device)
        self.out = torch.zeros(n, max_new_tokens, dtype=torch.long, device=device)

    def admit(self, prefill_tokens: int, deadline: float | None) -> None:
        """Queued prompts into the free slots, a prefill of at most `prefill_tokens` at a time,
        until the slots are full, the queue is empty or `deadline` has passed."""
        prompts, n = self.prompts, self.n
        while self.queue and len(self.live) < n and (deadline is None or time.perf_counter() < deadline):
            room = [len(prompts[i]) for i in itertools.islice(self.queue, n - len(self.live))]
            take = [self.queue.popleft() for _ in range(prefill_group(room, prefill_tokens))]
            first_slot, k = len(self.live), len(take)
            first = prefill_slots(self.model, self.cache, [prompts[i] for i in take],
                                  first_slot=first_slot).argmax(-1)
            new = slice(first_slot, first_slot + k)
            lengths = torch.tensor([len(prompts[i]) for i in take], device=self.model.device)
            self.position[new], self.last[new], self.produced[new] = lengths, first, 1
            self.out[new] = 0
            self.out[new, 0] = first
            self.finished[new] = torch.isin(first, self.eos) | (self.max_new_tokens <= 1)
            self.live.extend(take)
            self.host_position.extend(len(prompts[i]) for i in take)

    def step(self) -> None:
        """One token for every live slot (a finished one's answer stays as it is)."""
        window, max_new_tokens = self.window, self.max_new_tokens
        finished, produced = self.finished, self.produced
        context = min(max(self.host_position) + 1, window)
        b = self.decode.rows(len(self.live))
        token = self.decode(self.last[:b], self.position[:b], context).clone()
        rows = torch.arange(b, device=self.model.device)
        col = produced[:b].clamp(max=max_new_tokens - 1)
        self.out[rows, col] = torch.where(finished[:b], self.out[rows, col], token)
        produced[:b] += (~finished[:b]).long()
        finished[:b] |= torch.isin(token, self.eos) | (produced[:b] >= max_new_tokens)
        self.last[:b] = token
        self.position[:b] = (self.position[:b] + 1).clamp(max=window - 1)
        self.host_position = [min(p + 1, window - 1) for p in self.host_position]

    def harvest(self) -> int:
        """Record finished answers and move live slots to the front; returns tokens made."""
        finished = self.finished
        count = len(self.live)
        done_rows = finished[:count].nonzero().flatten().tolist()
        if not done_rows:
            return 0
        counts = self.produced[done_rows].tolist()
        for row, made, toks in zip(done_rows, counts, self.out[done_rows].tolist()):
            self.answers[self.live[row]] = toks[:made]
        keep = (~finished[:count]).nonzero().flatten()
        kept = keep.tolist()
        if kept:
            self.cache.compact(keep, max(self.host_position[r] for r in kept) + 1)
        for state in (self.position, self.last, self.produced, finished, self.out):
            state[:len(kept)] = state[keep]
        finished[len(kept):] = True
        self.live = [self.live[r] for r in kept]
        self.host_position = [self.host_position[r] for r in kept]
        return sum(counts)
