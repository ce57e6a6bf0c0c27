"""Row-invariant GPU kernels (Triton): what a decoding step computes across rows, each row in
one fixed order whatever else shares the call.

Speculative decoding is exact only if a tree's row gets the bits one-token decoding gives it.
cuBLAS and torch's attention choose kernels, tiles and split-K by shape, so a row's rounding
changes with the number of rows beside it. Here every shape choice is fixed:

- `linear`: output tiles of fixed size, the inputs reduced in fixed K steps in ascending order
  with float32 accumulation, never split. Two kernels share that loop. The multiply-add one
  (BLOCK_M x BLOCK_N x BLOCK_K) sums each step's products with the same reduction whatever a
  row's place in the tile: row-invariant by construction, on any device. The tensor-core one
  (tl.dot, DOT_M x DOT_N x DOT_K) is a matrix-multiply instruction, whose summation may in
  principle differ by a row's place in the tile (a BLAS kernel's did: a tree's row r and the
  same row alone, as row 0, came out one unit apart); it serves only where
  `dot_is_row_invariant` has run it and found every row's bits the same at every place and
  row count, once per device and dtype;
- `attention`: one program per (row, head); the keys a row sees are taken in position order
  (slots [0, prefix) then its own list of further slots, counted from a base slot of its own
  where many sequences share one table), BLOCK_T at a time, with an online softmax over
  them: a tree's row and the one-token forward of its path see the same keys in the same
  chunks, never the masked ones. Where the tensor-core linear serves, attention takes
  tensor cores too: one program per (row, key group), the group's heads at fixed places of a
  tl.dot over the same chunks (a program's shapes and inputs are one row's alone);
- `rms_norm`, `argmax`: one program per row, the reduction over the whole row in one block.

Fewer kernels a layer (a small model's step is bound by launches): `linear` can RMS-norm its
input rows first (each row's scale computed in the same program, from that row alone) and add
a residual to its output, `gated_linear` is an MLP's gated up projection with its SiLU or GELU
in one kernel, and `qkv_rope_cache` is attention's QKV projection with rotary applied to its
queries and keys and the keys and values stored at each row's cache slot (a tile's columns
are the pairs rotary mixes, so each output element is still `linear`'s, rounded, then
rotated); where query and key norms come between (Gemma 3), they, rotary and the cache write
are one kernel after the projection, `head_norm_rope_cache`. `linear_argmax` is an LM head
that keeps each row's argmax, not its logits (greedy steps need no more). launches.py counts
what a layer launches.

No kernel is compiled per row count (M is never specialized on), so a CUDA graph per tree size
replays kernels compiled once (graph_step.py). They run on a GPU, and on a CPU under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), where the tests check them on
tiny shapes.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:            # the `cuda` extra installs it; without it nothing here runs
    triton = tl = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 16     # the multiply-add linear's tiling, for every call
DOT_M, DOT_N, DOT_K = 16, 32, 64           # the tensor-core linear's, for every call (N of 32:
                                           # twice the programs of 64 for a one-row product)
BLOCK_T = 32                               # keys per attention step
SILU, GELU = 0, 1                          # gated_linear's activations


def available() -> tuple[bool, str]:
    """(True, "") where the kernels can run here, else (False, why)."""
    if triton is None:
        return False, "Triton is not installed (pip install triton, or the cuda extra)"
    return True, ""


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_launched = [0]


def launches() -> int:
    """Kernels launched by this module since the process started (what a step costs in
    launches: take the difference around it)."""
    return _launched[0]


if triton is not None:
    # M, the rows of a call, is never specialized on: one compiled kernel serves every tree
    # size, so no request compiles one (and a CUDA graph captures what was warmed).
    @triton.jit
    def _row_scales(x, rows, M, K, eps, BM: tl.constexpr, BK: tl.constexpr):
        """Each row's RMS norm scale, 1 / sqrt(mean(x^2) + eps), its squares summed BK at a time."""
        inner = tl.arange(0, BK)
        total = tl.zeros((BM,), dtype=tl.float32)
        for k in range(0, K, BK):
            ks = k + inner
            v = tl.load(x + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0).to(tl.float32)
            total += tl.sum(v * v, axis=1)
        return 1.0 / tl.sqrt(total / K + eps)

    @triton.jit
    def _tile_and_scales(x, M, K, eps, NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """A program's output tile (rows, cols) and each of its rows' norm scale (ones without
        NORM): the prologue every linear kernel opens with."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if NORM:
            scale = _row_scales(x, rows, M, K, eps, BM, BK)
        else:
            scale = tl.full((BM,), 1.0, tl.float32)
        return rows, cols, scale

    @triton.jit
    def _tile(x, w, rows, cols, M, N, K, scale, nw, NORM: tl.constexpr, USE_DOT: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
        """(BM, BN) of x @ w^T in float32, K reduced BK at a time in ascending order, never split;
        with NORM each x row is first RMS-normed (`scale`, then weight `nw`) and rounded to x's
        dtype, as rms_norm would have stored it."""
        inner = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            ks = k + inner
            xt = tl.load(x + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                         other=0.0)
            if NORM:
                g = tl.load(nw + ks, mask=ks < K, other=0.0).to(tl.float32)
                xt = (xt.to(tl.float32) * scale[:, None] * g[None, :]).to(xt.dtype)
            wt = tl.load(w + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                         other=0.0)
            if USE_DOT:
                if UPCAST:        # the interpreter multiplies bfloat16 operands of tl.dot wrongly
                    xt, wt = xt.to(tl.float32), wt.to(tl.float32)
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
            else:
                products = xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]    # (BM, BN, BK)
                acc += tl.sum(products, axis=2)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _linear(x, w, b, r, nw, y, M, N, K, eps, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                NORM: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows, cols, scale = _tile_and_scales(x, M, K, eps, NORM, BM, BN, BK)
        acc = _tile(x, w, rows, cols, M, N, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        if HAS_BIAS:
            acc += tl.load(b + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y.dtype.element_ty)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        if HAS_RESIDUAL:
            # The projection rounded as it would be stored, then added as torch adds two tensors
            # of the dtype (in float32, rounded once): the unfused result's bits.
            res = tl.load(r + rows[:, None] * N + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + res).to(y.dtype.element_ty)
        tl.store(y + rows[:, None] * N + cols[None, :], out, mask=inside)

    @triton.jit(do_not_specialize=["M"])
    def _gated_linear(x, w, nw, y, M, H, K, eps, NORM: tl.constexpr, ACTIVATION: tl.constexpr,
                      USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows, cols, scale = _tile_and_scales(x, M, K, eps, NORM, BM, BN, BK)
        # The gate's rows of w are [0, H), the up projection's [H, 2H); each rounded to the dtype
        # as the unfused projection stores it, the activation and the product rounded likewise.
        gate = _tile(x, w, rows, cols, M, H, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        up = _tile(x, w + H * K, rows, cols, M, H, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        g = gate.to(y.dtype.element_ty).to(tl.float32)
        u = up.to(y.dtype.element_ty).to(tl.float32)
        # exp of minus a magnitude only: it never overflows.
        if ACTIVATION == 1:      # GELU, tanh form: tanh(z) = sign(z) (1 - e) / (1 + e), e = exp(-2|z|)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            e = tl.exp(-2.0 * tl.abs(z))
            t = (1.0 - e) / (1.0 + e)
            a = 0.5 * g * (1.0 + tl.where(z < 0, -t, t))
        else:                    # SiLU: g sigmoid(g), sigmoid(g) = 1 / (1 + e) or e / (1 + e), e = exp(-|g|)
            e = tl.exp(-tl.abs(g))
            a = g * tl.where(g < 0, e, 1.0) / (1.0 + e)
        out = (a.to(y.dtype.element_ty).to(tl.float32) * u).to(y.dtype.element_ty)
        tl.store(y + rows[:, None] * H + cols[None, :], out, mask=(rows[:, None] < M) & (cols[None, :] < H))

    @triton.jit(do_not_specialize=["M"])
    def _qkv_rope_cache(x, w, b, nw, cos, sin, slots, q, kc, vc, M, K, H, G, D, T, eps,
                        HAS_BIAS: tl.constexpr, NORM: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # The tile's columns are pairs (j, j + D/2) of one head, which rotary mixes: heads [0, H)
        # are queries, [H, H + G) keys, [H + G, H + 2G) values (paired alike, not rotated).
        rows, pairs, scale = _tile_and_scales(x, M, K, eps, NORM, BM, BN, BK)
        half = D // 2
        N = (H + 2 * G) * D
        head = pairs // half
        j = pairs % half
        first = head * D + j
        second = first + half               # at or past N exactly where `first` is
        a = _tile(x, w, rows, first, M, N, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        c = _tile(x, w, rows, second, M, N, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        if HAS_BIAS:
            a += tl.load(b + first, mask=first < N, other=0.0).to(tl.float32)[None, :]
            c += tl.load(b + second, mask=second < N, other=0.0).to(tl.float32)[None, :]
        # The projection rounded as it would be stored, then rotated as model.apply_rope does it
        # (x cos + rotate_half(x) sin in float32, rounded once).
        dtype = q.dtype.element_ty
        a = a.to(dtype).to(tl.float32)
        c = c.to(dtype).to(tl.float32)
        live = rows < M
        angle = rows[:, None] * D + j[None, :]
        ca = tl.load(cos + angle, mask=live[:, None], other=0.0)
        sa = tl.load(sin + angle, mask=live[:, None], other=0.0)
        cc = tl.load(cos + angle + half, mask=live[:, None], other=0.0)
        sc = tl.load(sin + angle + half, mask=live[:, None], other=0.0)
        rotated = (head < H + G)[None, :]
        a_out = tl.where(rotated, a * ca + (-c) * sa, a).to(dtype)
        c_out = tl.where(rotated, c * cc + a * sc, c).to(dtype)
        # Queries to q (M, H*D); keys and values into the cache at each row's slot.
        is_q = live[:, None] & (head < H)[None, :]
        tl.store(q + rows[:, None] * (H * D) + first[None, :], a_out, mask=is_q)
        tl.store(q + rows[:, None] * (H * D) + second[None, :], c_out, mask=is_q)
        slot = tl.load(slots + rows, mask=live, other=0)
        is_k = live[:, None] & ((head >= H) & (head < H + G))[None, :]
        at_k = kc + ((head - H)[None, :] * T + slot[:, None]) * D + j[None, :]
        tl.store(at_k, a_out, mask=is_k)
        tl.store(at_k + half, c_out, mask=is_k)
        is_v = live[:, None] & ((head >= H + G) & (head < H + 2 * G))[None, :]
        at_v = vc + ((head - H - G)[None, :] * T + slot[:, None]) * D + j[None, :]
        tl.store(at_v, a_out, mask=is_v)
        tl.store(at_v + half, c_out, mask=is_v)

    @triton.jit
    def _head_norm_rope_cache(qkv, qn, kn, cos, sin, slots, q, kc, vc, H, G, D, T, eps, BD: tl.constexpr):
        # One program per (row, head of qkv's): queries [0, H), keys [H, H + G), values after.
        # A query or key head is RMS-normed as `_rms_norm` norms it (the same one-block sum),
        # rounded, then rotated as model.apply_rope rotates it; its rotation partner (dims
        # shifted by D/2) is normed alike from the same sum.
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, BD)
        half = D // 2
        inside = dims < D
        partner = (dims + half) % D
        at = qkv + (row * (H + 2 * G) + head) * D
        v = tl.load(at + dims, mask=inside, other=0.0)
        dtype = v.dtype
        slot = tl.load(slots + row)
        if head < H + G:
            x = v.to(tl.float32)
            y = tl.load(at + partner, mask=inside, other=0.0).to(tl.float32)
            scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            is_q = head < H
            gx = tl.where(is_q, tl.load(qn + dims, mask=inside, other=0.0), tl.load(kn + dims, mask=inside, other=0.0))
            gy = tl.where(is_q, tl.load(qn + partner, mask=inside, other=0.0),
                          tl.load(kn + partner, mask=inside, other=0.0))
            x = (x * scale * gx.to(tl.float32)).to(dtype).to(tl.float32)
            y = (y * scale * gy.to(tl.float32)).to(dtype).to(tl.float32)
            rotated = tl.where(dims < half, -y, y)
            c = tl.load(cos + row * D + dims, mask=inside, other=0.0)
            s = tl.load(sin + row * D + dims, mask=inside, other=0.0)
            out = (x * c + rotated * s).to(dtype)
            if head < H:
                tl.store(q + (row * H + head) * D + dims, out, mask=inside)
            else:
                tl.store(kc + ((head - H) * T + slot) * D + dims, out, mask=inside)
        else:
            tl.store(vc + ((head - H - G) * T + slot) * D + dims, v, mask=inside)

    @triton.jit
    def _rms_norm(x, w, y, D, eps, BD: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BD)
        v = tl.load(x + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        g = tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(y + row * D + cols, (v * scale * g).to(y.dtype.element_ty), mask=cols < D)

    @triton.jit(do_not_specialize=["M"])
    def _linear_tile_argmax(x, w, nw, top, at, M, N, K, eps, NORM: tl.constexpr, USE_DOT: tl.constexpr,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr):
        # Each row's largest value in this program's columns of x @ w^T, rounded to x's dtype as
        # `linear` stores it, and the first column holding it; _argmax then reduces the tiles.
        rows, cols, scale = _tile_and_scales(x, M, K, eps, NORM, BM, BN, BK)
        acc = _tile(x, w, rows, cols, M, N, K, scale, nw, NORM, USE_DOT, UPCAST, PRECISION, BM, BN, BK)
        value = tl.where(cols[None, :] < N, acc.to(x.dtype.element_ty).to(tl.float32), float("-inf"))
        best = tl.max(value, axis=1)
        first = tl.min(tl.where(value == best[:, None], cols[None, :], N), axis=1)
        tiles = tl.num_programs(1)
        tile = tl.program_id(1)
        tl.store(top + rows * tiles + tile, best, mask=rows < M)
        tl.store(at + rows * tiles + tile, first, mask=rows < M)

    @triton.jit
    def _argmax(logits, index, out, V, HAS_INDEX: tl.constexpr, BV: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BV)
        best = tl.full((), float("-inf"), tl.float32)
        at = tl.full((), 0, tl.int64)
        for start in range(0, V, BV):
            v = tl.load(logits + row * V + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            top = tl.max(v, axis=0)
            # the first index holding the chunk's maximum; a later chunk wins only if larger
            first = tl.min(tl.where(v == top, start + cols, V), axis=0).to(tl.int64)
            take = top > best
            at = tl.where(take, first, at)
            best = tl.where(take, top, best)
        if HAS_INDEX:       # logits are tiles' maxima: the first tile holding the largest, its column
            at = tl.load(index + row * V + at).to(tl.int64)
        tl.store(out + row, at)

    @triton.jit
    def _row_keys(prefix, xoff, xend, pos, base, row, window, HAS_BASE: tl.constexpr):
        # The keys a query row sees, in position order: its `pre` prefix positions, then its own
        # entries extra[x0 : x0 + count - pre] (a tree's ancestors); a sliding layer starts at
        # `first` (positions pos - window + 1 .. pos). Slots count from the row's `start_slot`
        # (its slot table's row, slots.SlotRows).
        pre = tl.load(prefix + row)
        x0 = tl.load(xoff + row)
        count = pre + tl.load(xend + row) - x0
        start_slot = 0
        if HAS_BASE:
            start_slot = tl.load(base + row)
        first = 0
        if window > 0:
            first = tl.maximum(tl.load(pos + row) - window + 1, 0)
        return pre, x0, count, start_slot, first

    @triton.jit
    def _key_slots(extra, pre, x0, count, start_slot, index):
        # The cache slots of logical key positions `index` (a chunk), and which of them exist.
        live = index < count
        slot = start_slot + tl.where(index < pre, index,
                                     tl.load(extra + x0 + index - pre, mask=live & (index >= pre), other=0))
        return live, slot

    @triton.jit(do_not_specialize=["T"])     # one kernel for every cache size
    def _attention(q, k, v, prefix, xoff, xend, extra, pos, base, out, H, G, T, D, scale, window,
                   HAS_BASE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        group = head // (H // G)
        dims = tl.arange(0, BD)
        qv = tl.load(q + (row * H + head) * D + dims, mask=dims < D, other=0.0).to(tl.float32)
        pre, x0, count, start_slot, first = _row_keys(prefix, xoff, xend, pos, base, row, window, HAS_BASE)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        steps = tl.arange(0, BT)
        for start in range(first, count, BT):
            index = start + steps                      # logical positions, in order
            live, slot = _key_slots(extra, pre, x0, count, start_slot, index)
            kt = tl.load(k + (group * T + slot[:, None]) * D + dims[None, :],
                         mask=live[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
            s = tl.where(live, tl.sum(kt * qv[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.where(live, tl.exp(s - m_new), 0.0)
            correction = tl.exp(m - m_new)
            vt = tl.load(v + (group * T + slot[:, None]) * D + dims[None, :],
                         mask=live[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
            total = total * correction + tl.sum(p, axis=0)
            acc = acc * correction + tl.sum(p[:, None] * vt, axis=0)
            m = m_new
        tl.store(out + (row * H + head) * D + dims, (acc / total).to(out.dtype.element_ty), mask=dims < D)

    @triton.jit(do_not_specialize=["T"])
    def _attention_dot(q, k, v, prefix, xoff, xend, extra, pos, base, out, H, G, T, D, scale, window,
                       HAS_BASE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BH: tl.constexpr,
                       BT: tl.constexpr, BD: tl.constexpr):
        # `_attention` on tensor cores: one program per (row, key group), the group's query heads
        # (BH places, the same head always at the same place) scored and summed against BT keys
        # at a time by tl.dot. A program's shapes and inputs are a row's alone, its keys taken in
        # position order in the same chunks as `_attention`'s: a tree's row and its path's
        # one-token row run the same instructions on the same values.
        row = tl.program_id(0)
        group = tl.program_id(1)
        per_group = H // G
        places = tl.arange(0, BH)
        heads = group * per_group + places
        dims = tl.arange(0, BD)
        live_heads = places < per_group
        qv = tl.load(q + (row * H + heads[:, None]) * D + dims[None, :],
                     mask=live_heads[:, None] & (dims[None, :] < D), other=0.0)
        if UPCAST:
            qv = qv.to(tl.float32)
        pre, x0, count, start_slot, first = _row_keys(prefix, xoff, xend, pos, base, row, window, HAS_BASE)
        m = tl.full((BH,), float("-inf"), tl.float32)
        total = tl.zeros((BH,), dtype=tl.float32)
        acc = tl.zeros((BH, BD), dtype=tl.float32)
        steps = tl.arange(0, BT)
        for start in range(first, count, BT):
            index = start + steps
            live, slot = _key_slots(extra, pre, x0, count, start_slot, index)
            kt = tl.load(k + (group * T + slot[:, None]) * D + dims[None, :],
                         mask=live[:, None] & (dims[None, :] < D), other=0.0)
            vt = tl.load(v + (group * T + slot[:, None]) * D + dims[None, :],
                         mask=live[:, None] & (dims[None, :] < D), other=0.0)
            if UPCAST:
                kt, vt = kt.to(tl.float32), vt.to(tl.float32)
            s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * scale            # (BH, BT)
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.where(live[None, :], tl.exp(s - m_new[:, None]), 0.0)
            correction = tl.exp(m - m_new)
            total = total * correction + tl.sum(p, axis=1)
            # The weights go in at the values' dtype, as a flash attention kernel's do.
            acc = tl.dot(p.to(vt.dtype), vt, acc * correction[:, None], input_precision=PRECISION)
            m = m_new
        result = acc / total[:, None]
        tl.store(out + (row * H + heads[:, None]) * D + dims[None, :], result.to(out.dtype.element_ty),
                 mask=live_heads[:, None] & (dims[None, :] < D))


def _need():
    ok, why = available()
    if not ok:
        raise RuntimeError(why)


def _launch(kernel, grid, *args, **meta):
    _launched[0] += 1
    kernel[grid](*args, **meta)


def _use_dot(x: torch.Tensor) -> bool:
    """Whether x's products take the tensor-core kernel: on a GPU where it proved row-invariant
    (`dot_is_row_invariant`). Never under the interpreter, which runs tl.dot as a numpy matrix
    product: numpy (its BLAS) sums in an order of its choosing, which may change with the rows."""
    return x.is_cuda and not interpreted() and dot_is_row_invariant(x.device, x.dtype)


def _tiling(x: torch.Tensor, use_dot: bool) -> dict:
    """The kernel's fixed tiling; whether tl.dot's operands go up to float32 (the interpreter's
    tl.dot mishandles bfloat16; a GPU's never needs it); tl.dot's precision: float32 operands
    in full ("ieee": TF32 would round them), a 16-bit type's being exact in any."""
    upcast = use_dot and interpreted() and x.dtype == torch.bfloat16
    tiles = dict(BM=DOT_M, BN=DOT_N, BK=DOT_K) if use_dot else dict(BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return dict(UPCAST=upcast, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **tiles)


def _product(x: torch.Tensor, weight: torch.Tensor, use_dot: bool | None, columns: int | None = None):
    """What a launch of a product kernel over x (M, K) and weight needs: (x and weight
    contiguous, whether it takes the tensor-core kernel (None: `_use_dot`), its tiling, its
    grid over x's rows and `columns` (weight's rows by default))."""
    x, weight = x.contiguous(), weight.contiguous()
    use_dot = _use_dot(x) if use_dot is None else use_dot
    tiles = _tiling(x, use_dot)
    columns = weight.shape[0] if columns is None else columns
    return x, weight, use_dot, tiles, (triton.cdiv(x.shape[0], tiles["BM"]), triton.cdiv(columns, tiles["BN"]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
           use_dot: bool | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias), float32 accumulation, in x's dtype. With `norm` (K,),
    each row of x is RMS-normed first (weight `norm`, `eps`) in the same program; with `residual`
    (M, N), it is added to the result. use_dot: the tensor-core kernel or not (None: where it
    proved row-invariant)."""
    _need()
    x, weight, use_dot, tiles, grid = _product(x, weight, use_dot)
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(_linear, grid, x, weight, bias if bias is not None else weight,
            residual.contiguous() if residual is not None else y, norm if norm is not None else weight, y,
            M, N, K, eps, bias is not None, residual is not None, norm is not None, use_dot, **tiles)
    return y


def gated_linear(x: torch.Tensor, weight: torch.Tensor, activation: int, *, norm: torch.Tensor | None = None,
                 eps: float = 0.0, use_dot: bool | None = None) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) for weight = [gate; up] (2H, K), an MLP's gated up
    projection in one kernel: activation SILU or GELU (tanh form); `norm`: as in `linear`.
    Returns (M, H) in x's dtype."""
    _need()
    (M, K), H = x.shape, weight.shape[0] // 2
    x, weight, use_dot, tiles, grid = _product(x, weight, use_dot, H)
    y = torch.empty(M, H, dtype=x.dtype, device=x.device)
    _launch(_gated_linear, grid, x, weight, norm if norm is not None else weight, y, M, H, K, eps,
            norm is not None, activation, use_dot, **tiles)
    return y


def cache_stride(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Slots between one key group's slot 0 and the next's in a cache's keys and values
    (groups, slots, D) that the kernels write in place: each slot's D values contiguous, slots
    side by side, the groups any whole number of slots apart, the same for keys and values
    (a KVCache's layer, or a SlotCache's table, whose group stride is a window while its slots
    run on through every sequence's: slots.SlotCache.storage). ValueError otherwise."""
    G, T, D = keys.shape
    if values.shape != keys.shape or keys.stride()[1:] != (D, 1) or values.stride()[1:] != (D, 1) \
            or (G > 1 and (values.stride(0) != keys.stride(0) or keys.stride(0) % D)):
        raise ValueError("the cache's keys and values are written in place: each slot's values "
                         "contiguous, slots side by side, keys and values alike")
    return keys.stride(0) // D if G > 1 else T


def cache_rows(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """keys and values (groups, slots, D) as the attention kernels read them, with their group
    stride in slots (`cache_stride`): in place where they are laid out so, else copies."""
    try:
        return keys, values, cache_stride(keys, values)
    except ValueError:
        keys, values = keys.contiguous(), values.contiguous()
        return keys, values, keys.shape[1]


def qkv_rope_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   heads: int, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                   use_dot: bool | None = None) -> torch.Tensor:
    """An attention layer's QKV projection, its rotary and its cache write in one kernel:
    x (M, K) @ weight^T (+ bias), weight (heads + 2 groups) * D rows of queries, keys, values;
    queries and keys rotated by row r's `cos[r]`, `sin[r]` (M, D; float32, rotate-half as
    model.apply_rope), keys and values stored at slot `slots[r]` of a layer's `keys` and
    `values` (groups, slots, D), in place. `norm`: as in `linear`. Returns the rotated queries
    (M, heads, D) in x's dtype. Each output element is `linear`'s, rounded as the unfused
    projection stores it, then rotated: row-invariant as `linear` is."""
    _need()
    M, K = x.shape
    G, _, D = keys.shape
    if weight.shape[0] != (heads + 2 * G) * D or D % 2:
        raise ValueError(f"a QKV weight of {weight.shape[0]} rows for {heads} heads and {G} groups of {D}")
    T = cache_stride(keys, values)
    x, weight, use_dot, tiles, grid = _product(x, weight, use_dot, (heads + 2 * G) * D // 2)
    q = torch.empty(M, heads, D, dtype=x.dtype, device=x.device)
    _launch(_qkv_rope_cache, grid, x, weight, bias if bias is not None else weight,
            norm if norm is not None else weight, cos.contiguous(), sin.contiguous(), slots.contiguous(), q,
            keys, values, M, K, heads, G, D, T, eps, bias is not None, norm is not None, use_dot, **tiles)
    return q


def head_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, heads: int) -> torch.Tensor:
    """What follows a QKV projection (M, (heads + 2 groups) * D) with query and key norms
    (Gemma 3's), in one kernel: each query head RMS-normed by `q_norm` (D,), each key head by
    `k_norm`, as `rms_norm` norms them, then rotated as in `qkv_rope_cache`; keys and values
    stored at slot `slots[r]` of a layer's `keys` and `values` (groups, slots, D), in place.
    Returns the queries (M, heads, D). One program a row and head: row-invariant."""
    _need()
    qkv = qkv.contiguous()
    M = qkv.shape[0]
    G, _, D = keys.shape
    if qkv.shape[1] != (heads + 2 * G) * D or D % 2:
        raise ValueError(f"QKV rows of {qkv.shape[1]} for {heads} heads and {G} groups of {D}")
    T = cache_stride(keys, values)
    q = torch.empty(M, heads, D, dtype=qkv.dtype, device=qkv.device)
    _launch(_head_norm_rope_cache, (M, heads + 2 * G), qkv, q_norm.contiguous(), k_norm.contiguous(),
            cos.contiguous(), sin.contiguous(), slots.contiguous(), q, keys, values, heads, G, D, T, eps,
            BD=triton.next_power_of_2(D))
    return q


# Where the tensor-core kernel was checked, per (device, dtype): whether every row kept its bits.
_dot_checked: dict[tuple[str, torch.dtype], bool] = {}
# (N, K) of the products the check runs: SmolLM2's and Gemma 3 270M's MLP up projections.
DOT_CHECK_SHAPES = ((1536, 576), (2048, 640))
DOT_CHECK_ROWS = 64


def dot_is_row_invariant(device, dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernel gives every row the same bits at every place in a call of
    any row count from 1 to DOT_CHECK_ROWS, on `device` in `dtype`: checked by running it (on
    DOT_CHECK_SHAPES) the first time a (device, dtype) is asked, the answer kept for the process.
    False off a GPU and under the interpreter (see `_use_dot`): the multiply-add kernel then
    serves. Ask before capturing a CUDA graph (KernelBackend does, when it is built): a check cannot
    run inside one."""
    device = torch.device(device)
    if triton is None or interpreted() or device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype)
    if key not in _dot_checked:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the tensor-core kernel's check for {key} cannot run inside a CUDA "
                               "graph capture: call kernels.dot_is_row_invariant before capturing")
        _dot_checked[key] = all(rows_keep_their_bits(device, dtype, n, k, DOT_CHECK_ROWS)
                                for n, k in DOT_CHECK_SHAPES)
    return _dot_checked[key]


def rows_keep_their_bits(device, dtype: torch.dtype, n: int, k: int, rows: int, use_dot: bool = True) -> bool:
    """Whether `linear` (the tensor-core kernel or not) gives each of `rows` random rows, at every
    place in a call of every row count from 1 to `rows`, the bits it gets alone. One read-back."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(device, dtype)
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    alone = torch.cat([linear(x[i:i + 1], weight, use_dot=use_dot) for i in range(rows)]).view(bits)
    same = torch.ones((), dtype=torch.bool, device=device)
    places = torch.arange(rows, device=device)
    for count in range(1, rows + 1):
        for shift in range(rows):          # row (p + shift) % rows at place p: each row at each place
            picked = (places[:count] + shift) % rows
            same &= (linear(x[picked], weight, use_dot=use_dot).view(bits) == alone[picked]).all()
    return bool(same)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x (M, D) scaled by 1 / rms and by weight, computed in float32."""
    _need()
    x = x.contiguous()
    y = torch.empty_like(x)
    _launch(_rms_norm, (x.shape[0],), x, weight.contiguous(), y, x.shape[1], eps,
            BD=triton.next_power_of_2(x.shape[1]))
    return y


def argmax(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Each row's first index of its largest value (as plain decoding picks), int64."""
    _need()
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch(_argmax, (logits.shape[0],), logits, out, out, logits.shape[1], False, BV=block)
    return out


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                  use_dot: bool | None = None, block: int = 1024) -> torch.Tensor:
    """Each row's argmax of `linear(x, weight, norm=norm, eps=eps)` (int64, the first index on
    ties, as torch.argmax), without storing the products: an LM head's greedy tokens. Each
    program keeps its tile's maximum per row and the first column holding it; `argmax`'s
    kernel then takes, per row, the first tile holding the largest of them, tiles in column
    order. Two launches, whatever the vocabulary."""
    _need()
    x, weight, use_dot, tiles, grid = _product(x, weight, use_dot)
    (M, K), N = x.shape, weight.shape[0]
    top = torch.empty(M, grid[1], dtype=torch.float32, device=x.device)
    at = torch.empty(M, grid[1], dtype=torch.int32, device=x.device)
    _launch(_linear_tile_argmax, grid, x, weight, norm if norm is not None else weight, top, at, M, N, K, eps,
            norm is not None, use_dot, **tiles)
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    _launch(_argmax, (M,), top, at, out, grid[1], True, BV=min(block, triton.next_power_of_2(grid[1])))
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: torch.Tensor,
              xoff: torch.Tensor, extra: torch.Tensor, scale: float, positions: torch.Tensor | None = None,
              window: int = 0, xend: torch.Tensor | None = None, use_dot: bool | None = None,
              base: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (n, heads, D) over keys and values (groups, T, D): row r sees slots
    [0, prefix[r]) and then extra[xoff[r]:xend[r]] (xend: xoff[1:] unless given), in position
    order (its own last), as native.visibility describes a tree's rows; with a `window`, only
    its last `window` positions (`positions`: each row's). `base` (n,): each row's slots counted
    from base[r] on (the slot table of many sequences, slots.SlotRows; None: from 0). keys and
    values are read in place wherever each slot's D values are contiguous (`cache_rows`).
    Returns (n, heads, D) in q's dtype. use_dot: a key group's heads scored and summed on
    tensor cores (`_attention_dot`), or one head at a time with multiply-adds (None: where
    `linear`'s tensor-core kernel serves)."""
    _need()
    n, H, D = q.shape
    keys, values, T = cache_rows(keys, values)
    G = keys.shape[0]
    out = torch.empty_like(q)
    xoff = xoff.to(torch.int32).contiguous()
    xend = xoff[1:] if xend is None else xend.to(torch.int32).contiguous()
    pos = (positions if positions is not None else prefix).to(torch.int32).contiguous()
    use_dot = _use_dot(q) if use_dot is None else use_dot
    prefix = prefix.to(torch.int32).contiguous()
    tensors = (q.contiguous(), keys, values, prefix, xoff, xend, extra.to(torch.int32).contiguous(), pos,
               base.to(torch.int32).contiguous() if base is not None else prefix, out, H, G, T, D, scale, window)
    if use_dot:        # tl.dot's smallest tile is 16 a side: a group's heads padded to 16 places
        tiling = _tiling(q, True)
        _launch(_attention_dot, (n, G), *tensors, HAS_BASE=base is not None, UPCAST=tiling["UPCAST"],
                PRECISION=tiling["PRECISION"], BH=max(16, triton.next_power_of_2(H // G)), BT=BLOCK_T,
                BD=max(16, triton.next_power_of_2(D)))
    else:
        _launch(_attention, (n, H), *tensors, HAS_BASE=base is not None, BT=BLOCK_T, BD=triton.next_power_of_2(D))
    return out
