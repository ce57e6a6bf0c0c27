"""Row-invariant GPU kernels (Triton): what a decoding step computes across rows, each row in
one fixed order whatever else shares the call.

Speculative decoding is exact only if a tree's row gets the bits one-token decoding gives it.
cuBLAS and torch's attention choose kernels, tiles and split-K by shape, so a row's rounding
changes with the number of rows beside it. Here every shape choice is fixed:

- `linear`: output tiles of BLOCK_M x BLOCK_N, the inputs reduced in BLOCK_K steps in ascending
  order with float32 accumulation, never split. Within a step each output sums its BLOCK_K
  products with the same reduction whatever its place in the tile: not a matrix-multiply
  instruction, whose summation may differ by a row's place in the tile (a BLAS kernel's does:
  a tree's row r and the same row alone, as row 0, came out one unit apart), so a row gets the
  same bits at any place in any call;
- `attention`: one program per (row, head); the keys a row sees are taken in position order
  (slots [0, prefix) then its own list of further slots), BLOCK_T at a time, with an online
  softmax over them: a tree's row and the one-token forward of its path see the same keys in
  the same chunks, never the masked ones;
- `rms_norm`, `argmax`: one program per row, the reduction over the whole row in one block.

They run on a GPU, and on a CPU under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported), where the tests check them on tiny shapes.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:            # the `cuda` extra installs it; without it nothing here runs
    triton = tl = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 16     # one tiling for every call: no per-shape choice
BLOCK_T = 32                               # keys per attention step


def available() -> tuple[bool, str]:
    """(True, "") where the kernels can run here, else (False, why)."""
    if triton is None:
        return False, "Triton is not installed (pip install triton, or the cuda extra)"
    return True, ""


if triton is not None:
    @triton.jit
    def _linear(x, w, b, y, M, N, K, HAS_BIAS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inner = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            ks = k + inner
            xt = tl.load(x + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                         other=0.0)
            wt = tl.load(w + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                         other=0.0)
            products = xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]    # (BM, BN, BK)
            acc += tl.sum(products, axis=2)
        if HAS_BIAS:
            acc += tl.load(b + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rows[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _rms_norm(x, w, y, D, eps, BD: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BD)
        v = tl.load(x + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        g = tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(y + row * D + cols, (v * scale * g).to(y.dtype.element_ty), mask=cols < D)

    @triton.jit
    def _argmax(logits, out, V, BV: tl.constexpr):
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
        tl.store(out + row, at)

    @triton.jit
    def _attention(q, k, v, prefix, xoff, extra, pos, out, H, G, T, D, scale, window,
                   BT: tl.constexpr, BD: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        group = head // (H // G)
        dims = tl.arange(0, BD)
        qv = tl.load(q + (row * H + head) * D + dims, mask=dims < D, other=0.0).to(tl.float32)
        pre = tl.load(prefix + row)
        x0 = tl.load(xoff + row)
        count = pre + tl.load(xoff + row + 1) - x0
        first = 0
        if window > 0:      # a sliding layer sees positions pos - window + 1 .. pos
            first = tl.maximum(tl.load(pos + row) - window + 1, 0)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        steps = tl.arange(0, BT)
        for start in range(first, count, BT):
            index = start + steps                      # logical positions, in order
            live = index < count
            slot = tl.where(index < pre, index,
                            tl.load(extra + x0 + index - pre, mask=live & (index >= pre), other=0))
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


def _need():
    ok, why = available()
    if not ok:
        raise RuntimeError(why)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias), float32 accumulation, in x's dtype."""
    _need()
    x, weight = x.contiguous(), weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear[grid](x, weight, bias if bias is not None else weight, y, M, N, K, bias is not None,
                  BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x (M, D) scaled by 1 / rms and by weight, computed in float32."""
    _need()
    x = x.contiguous()
    y = torch.empty_like(x)
    _rms_norm[(x.shape[0],)](x, weight.contiguous(), y, x.shape[1], eps, BD=triton.next_power_of_2(x.shape[1]))
    return y


def argmax(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Each row's first index of its largest value (as plain decoding picks), int64."""
    _need()
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _argmax[(logits.shape[0],)](logits, out, logits.shape[1], BV=block)
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: torch.Tensor,
              xoff: torch.Tensor, extra: torch.Tensor, scale: float, positions: torch.Tensor | None = None,
              window: int = 0) -> torch.Tensor:
    """Attention of q (n, heads, D) over keys and values (groups, T, D): row r sees slots
    [0, prefix[r]) and then extra[xoff[r]:xoff[r + 1]], in position order (its own last), as
    native.visibility describes a tree's rows; with a `window`, only its last `window`
    positions (`positions`: each row's). Returns (n, heads, D) in q's dtype."""
    _need()
    n, H, D = q.shape
    G, T, _ = keys.shape
    out = torch.empty_like(q)
    pos = (positions if positions is not None else prefix).to(torch.int32).contiguous()
    _attention[(n, H)](q.contiguous(), keys.contiguous(), values.contiguous(), prefix.to(torch.int32).contiguous(),
                       xoff.to(torch.int32).contiguous(), extra.to(torch.int32).contiguous(), pos, out, H, G, T,
                       D, scale, window, BT=BLOCK_T, BD=triton.next_power_of_2(D))
    return out
