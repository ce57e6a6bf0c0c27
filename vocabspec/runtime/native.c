/* The native CPU engine: a stack of decoder layers over a KV cache, computed so that each row's
 * bits never depend on how many rows a call holds (see native.py for why and how it is used).
 *
 * Every reduction has one fixed order, chosen per row and never per call:
 *  - a matmul output is 16 lanes of fused multiply-adds over the inputs in ascending order (two
 *    lane sets: the first and second half of each 32-input unit), added, then one fixed
 *    horizontal sum; weights are dequantized to float32 in registers, exactly as gguf-py does;
 *  - an attention score is one fused multiply-add chain over the head dimension; the softmax
 *    runs over the keys a row sees in position order (never over masked columns), and the
 *    weighted sum of values is one chain per output lane over those keys;
 *  - norms, RoPE and activations are per-row vector code with no scalar tails.
 * How the work is split between threads (over output columns, over rows and heads) changes no
 * order. Activations are float32 throughout; weights are float32, bfloat16 or quantized groups.
 *
 * The arithmetic is written once over 16-lane vectors (`vf`, `vi` below): one AVX-512 register,
 * or two AVX2 registers doing the same per-lane operations, with horizontal sums in one order
 * written out here (not left to a compiler's reduce builtins). Each lane sees the same sequence
 * of IEEE operations on either instruction set; integer dot products are exact on both.
 *
 * Built by native.py with the machine's C compiler (-O3 -march=native -fopenmp
 * -ffp-contract=off -fno-fast-math: every fused multiply-add here is written as one). Needs
 * AVX-512 (F, BW) or AVX2 with FMA and F16C.
 */

#include "native_vec.h"
#include "native.h"

/* ------------------------------------------------------------------ elementwise math */

/* exp(x), the same polynomial for every lane: Cody-Waite reduction by ln 2, degree-6 Taylor
   on [-ln2/2, ln2/2], scaled by 2^n. Below -87.3 it is 0; above 88.7 it is +inf. */
ALWAYS vf vexp(vf x) {
    const vf lo = vf_set1(-87.3f), hi = vf_set1(88.7f);
    const vf xc = vf_min(vf_max(x, lo), hi);
    const vf n = vf_round(vf_mul(xc, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(n, vf_set1(0.693359375f), xc);
    r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.0f / 720);
    p = vf_fma(p, r, vf_set1(1.0f / 120));
    p = vf_fma(p, r, vf_set1(1.0f / 24));
    p = vf_fma(p, r, vf_set1(1.0f / 6));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_zero_below(vf_scale2(p, n), x, lo);
}

ALWAYS vf vsilu(vf x) {
    return vf_div(x, vf_add(vf_set1(1.0f), vexp(vf_sub(vf_zero(), x))));
}

/* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1). */
ALWAYS vf vgelu_tanh(vf x) {
    const vf x3 = vf_mul(vf_mul(x, x), x);
    const vf u = vf_mul(vf_set1(0.7978845608028654f), vf_add(x, vf_mul(vf_set1(0.044715f), x3)));
    const vf e = vexp(vf_add(u, u));
    const vf t = vf_sub(vf_set1(1.0f), vf_div(vf_set1(2.0f), vf_add(e, vf_set1(1.0f))));
    return vf_mul(vf_mul(vf_set1(0.5f), x), vf_add(vf_set1(1.0f), t));
}

/* y = x * rsqrt(mean(x^2) + eps) * w over one row of `dim` (a multiple of 16) floats. */
ALWAYS void rmsnorm_row(const float *x, const float *w, float *y, int64_t dim, float eps) {
    vf acc = vf_zero();
    for (int64_t i = 0; i < dim; i += 16) {
        const vf v = vf_load(x + i);
        acc = vf_fma(v, v, acc);
    }
    const float r = 1.0f / sqrtf(vf_sum(acc) / (float)dim + eps);
    const vf rv = vf_set1(r);
    for (int64_t i = 0; i < dim; i += 16) vf_store(y + i, vf_mul(vf_mul(vf_load(x + i), rv), vf_load(w + i)));
}

#include "native_threads.c"

#define RB 16   /* rows a weight block holds, one a vector lane */
#define CHUNK 4 /* blocks per work item */

#include "native_weights.c"

#include <stddef.h>
/* Sizes and offsets of the ABI's structs in one list: native.py compares it with its ctypes
   mirrors when the library loads, so a field added on one side only fails there, not as a
   wrong pointer read deep in a forward. */
int64_t vs_abi(int64_t *out, int64_t cap) {
    const int64_t v[] = {
        sizeof(vs_weight), offsetof(vs_weight, type), offsetof(vs_weight, rows), offsetof(vs_weight, cols),
        offsetof(vs_weight, int8_acts), offsetof(vs_weight, data), offsetof(vs_weight, bias),
        sizeof(vs_layer), offsetof(vs_layer, wq), offsetof(vs_layer, w_down), offsetof(vs_layer, attn_norm),
        offsetof(vs_layer, hidden_norm), offsetof(vs_layer, cos), offsetof(vs_layer, sin),
        offsetof(vs_layer, window), offsetof(vs_layer, norm_residual),
        sizeof(vs_stack), offsetof(vs_stack, eps), offsetof(vs_stack, kv_half), offsetof(vs_stack, layers),
        sizeof(vs_drafter), offsetof(vs_drafter, head), offsetof(vs_drafter, embed), offsetof(vs_drafter, head_ids),
        offsetof(vs_drafter, out_norm), offsetof(vs_drafter, eps), offsetof(vs_drafter, fused),
        sizeof(vs_tree_stop), offsetof(vs_tree_stop, depths), offsetof(vs_tree_stop, bins),
        offsetof(vs_tree_stop, min_gain), offsetof(vs_tree_stop, node_cost), offsetof(vs_tree_stop, levels),
        offsetof(vs_tree_stop, rows),
        sizeof(vs_tree_request), offsetof(vs_tree_request, length), offsetof(vs_tree_request, root),
        offsetof(vs_tree_request, stop), offsetof(vs_tree_request, node_values), offsetof(vs_tree_request, att),
        sizeof(vs_rows), offsetof(vs_rows, ntaps), offsetof(vs_rows, pos), offsetof(vs_rows, taps),
        offsetof(vs_rows, keys), offsetof(vs_rows, values), offsetof(vs_rows, embeds), offsetof(vs_rows, tapped),
        sizeof(vs_verify_request), offsetof(vs_verify_request, head), offsetof(vs_verify_request, offsets),
        offsetof(vs_verify_request, paths), offsetof(vs_verify_request, work), offsetof(vs_verify_request, ntrees),
        offsetof(vs_verify_request, head_rows), offsetof(vs_verify_request, eps),
        sizeof(vs_read_request), offsetof(vs_read_request, stack), offsetof(vs_read_request, keys),
        offsetof(vs_read_request, length), offsetof(vs_read_request, n), offsetof(vs_read_request, tokens),
        offsetof(vs_read_request, state), offsetof(vs_read_request, att),
        sizeof(vs_cache), offsetof(vs_cache, values), offsetof(vs_cache, layers), offsetof(vs_cache, slots),
        offsetof(vs_cache, half),
    };
    const int64_t n = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

/* ys[i] = x ws[i]^T (+ bias) for `count` weights of the same input width, in one work-sharing
   loop over all their blocks (q, k and v; gate and up: one barrier, not `count`). Call inside
   a parallel region. */
static void linear_rows_multi(const vs_weight *const *ws, float *const *ys, int count, const float *x,
                              int64_t M, int64_t ldx) {
    int64_t total = 0;
    acts in = {0}; /* the same for every weight: they share x */
    for (int i = 0; i < count; i++) total += ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < total; item++) {
        int64_t c = item;
        int i = 0;
        while (c >= ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK)
            c -= ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK, i++;
        const int64_t blocks = (ws[i]->rows + RB - 1) / RB;
        const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
        linear_blocks(ws[i], b0, b1, x, M, ldx, ys[i], ws[i]->rows, &in);
    }
}

static void linear_rows(const vs_weight *w, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy) {
    const int64_t blocks = (w->rows + RB - 1) / RB;
    acts in = {0};
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (blocks + CHUNK - 1) / CHUNK; c++) {
        const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
        linear_blocks(w, b0, b1, x, M, ldx, y, ldy, &in);
    }
}

void vs_linear(const vs_weight *w, const float *x, int64_t M, float *y) {
#pragma omp parallel num_threads(team())
    linear_rows(w, x, M, w->cols, y, w->rows);
}

/* out (n x dim) = rows `ids` of w (dequantized) times `scale` (0: none). */
void vs_embed(const vs_weight *w, const int32_t *ids, int64_t n, float scale, float *out) {
    for (int64_t i = 0; i < n; i++) {
        vs_dequant_rows(w, ids[i], ids[i] + 1, out + i * w->cols);
        if (scale != 0.0f)
            for (int64_t k = 0; k < w->cols; k++) out[i * w->cols + k] *= scale;
    }
}

/* logits (M x vocab) = head(rmsnorm(hidden)) for M rows. work: M x dim floats. */
void vs_head(const float *norm, float eps, const vs_weight *w, const float *hidden, int64_t M,
             float *work, float *logits) {
    const int64_t dim = w->cols;
#pragma omp parallel num_threads(team())
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) rmsnorm_row(hidden + i * dim, norm, work + i * dim, dim, eps);
        linear_rows(w, work, M, dim, logits, w->rows);
    }
}

/* ------------------------------------------------------------------ attention */

/* Where dimension d of the key in slot t lies in one kv head's keys (T/16 blocks of D x 16). */
#define KEY_AT(t, d, D) ((((int64_t)(t) >> 4) * (D) + (d)) * 16 + ((t) & 15))

/* A cache holds floats, or IEEE halves (vs_stack's kv_half): a key or value is rounded to its
   half once, when it is stored, and read back exactly, so what a row reads never depends on the
   call. Offsets are in elements; `half` is a constant wherever it matters for speed. */
ALWAYS const void *kv_ptr(const void *base, const int half, int64_t i) {
    return (const char *)base + i * (half ? 2 : 4);
}
ALWAYS vf kv_load(const void *base, const int half, int64_t i) {   /* 16 consecutive */
    return half ? vf_half((const uint16_t *)base + i) : vf_load((const float *)base + i);
}
/* The first `left` of 16 (for halves the block's other lanes are read too: they are in it). */
ALWAYS vf kv_load_part(const void *base, const int half, int64_t i, int64_t left) {
    return half ? vf_half((const uint16_t *)base + i) : vf_load_part((const float *)base + i, left, 0.0f);
}
ALWAYS float kv_at(const void *base, const int half, int64_t i) {
    return half ? _cvtsh_ss(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}
ALWAYS void kv_put(void *base, const int half, int64_t i, float x) {
    if (half) ((uint16_t *)base)[i] = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    else ((float *)base)[i] = x;
}

/* The query heads of one kv group that a work item serves together (at most HEADS_MAX): each key
   and value vector is loaded once for all of them, and their independent fused multiply-add
   chains keep the FMA units busy where one head's chains would wait on each other's latency.
   The keys and values of a long context are read from memory once per group rather than once
   per head. Each head's arithmetic (its chains, their order) is what it is alone. KEY_BLOCKS:
   blocks of 16 keys a pass of the score loop holds in registers. */
#if VS_AVX512
#define HEADS_MAX 4
#define KEY_BLOCKS 4
#else
#define HEADS_MAX 2 /* AVX2: 16 registers, two to a vector */
#define KEY_BLOCKS 2
#endif

/* Scores of `hb` heads for KEY_BLOCKS blocks of 16 keys at kb: o[h][j] = scale * (q_h . key j). */
ALWAYS void scores_pass(const int hb, const int half, const float *const *qv, const void *kb, const int64_t D,
                        float *const *o, const vf scale) {
    vf a[HEADS_MAX][KEY_BLOCKS];
    for (int h = 0; h < hb; h++)
        for (int b = 0; b < KEY_BLOCKS; b++) a[h][b] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        vf k[KEY_BLOCKS];
        for (int b = 0; b < KEY_BLOCKS; b++) k[b] = kv_load(kb, half, (b * D + d) * 16);
        for (int h = 0; h < hb; h++) {
            const vf qd = vf_set1(qv[h][d]);
            for (int b = 0; b < KEY_BLOCKS; b++) a[h][b] = vf_fma(qd, k[b], a[h][b]);
        }
    }
    for (int h = 0; h < hb; h++)
        for (int b = 0; b < KEY_BLOCKS; b++) vf_store(o[h] + 16 * b, vf_mul(a[h][b], scale));
}

/* out[h] = (sum over the row's keys j of p_h[j] * value j) / sums[h] for `hb` heads, one chain
   per output lane and head over the keys in position order; `chunks` = D / 16. */
ALWAYS void values_pass(const int hb, const int half, const int64_t chunks, const void *vv, const int64_t D,
                        float *const *sc, const float *sums, int64_t count, int64_t first, int64_t pre,
                        const int32_t *xs, float *const *out) {
    vf acc[HEADS_MAX][16];
    for (int h = 0; h < hb; h++)
        for (int64_t c = 0; c < chunks; c++) acc[h][c] = vf_zero();
    for (int64_t j = 0; j < count; j++) {
        const int64_t li = first + j;
        const int64_t slot = li < pre ? li : xs[li - pre];
        vf p[HEADS_MAX];
        for (int h = 0; h < hb; h++) p[h] = vf_set1(sc[h][j]);
        for (int64_t c = 0; c < chunks; c++) {
            const vf x = kv_load(vv, half, slot * D + 16 * c);
            for (int h = 0; h < hb; h++) acc[h][c] = vf_fma(p[h], x, acc[h][c]);
        }
    }
    for (int h = 0; h < hb; h++) {
        const vf sum = vf_set1(sums[h]);
        for (int64_t c = 0; c < chunks; c++) vf_store(out[h] + 16 * c, vf_div(acc[h][c], sum));
    }
}

/* Heads per work item for n rows: the largest count up to HEADS_MAX that divides a group's heads
   and still leaves an item for every thread (reading a group's keys once outweighs the odd item
   a thread waits for; a lone row on many threads keeps one head an item). */
static int64_t heads_per_item(const vs_stack *s, int64_t n, int threads) {
    const int64_t hpg = s->n_heads / s->n_kv;
    for (int64_t hb = HEADS_MAX < hpg ? HEADS_MAX : hpg; hb > 1; hb--)
        if (hpg % hb == 0 && n * s->n_heads / hb >= (int64_t)threads) return hb;
    return 1;
}

/* Scores over the prefix's keys from `start` (key i's to from[h] + i - start): KEY_BLOCKS blocks
   of 16 keys a pass while they fit, then 16 keys a vector, each key one fma chain over d. */
ALWAYS void prefix_scores(const int64_t hb, const int half, const float *const *qv, const void *kt, const int64_t D,
                          float *const *from, int64_t start, int64_t pre, const vf scale) {
    int64_t i = start;
    for (; i + 16 * KEY_BLOCKS <= pre; i += 16 * KEY_BLOCKS) {
        float *at[HEADS_MAX];
        for (int64_t h = 0; h < hb; h++) at[h] = from[h] + (i - start);
        switch (hb) {   /* constant head counts: the accumulators stay in registers */
        case 1: scores_pass(1, half, qv, kv_ptr(kt, half, i * D), D, at, scale); break;
#if HEADS_MAX >= 4
        case 3: scores_pass(3, half, qv, kv_ptr(kt, half, i * D), D, at, scale); break;
        case 4: scores_pass(4, half, qv, kv_ptr(kt, half, i * D), D, at, scale); break;
#endif
        default: scores_pass(2, half, qv, kv_ptr(kt, half, i * D), D, at, scale); break;
        }
    }
    for (; i < pre; i += 16) {
        vf a[HEADS_MAX];
        for (int64_t h = 0; h < hb; h++) a[h] = vf_zero();
        for (int64_t d = 0; d < D; d++) {
            const vf k = kv_load_part(kt, half, i * D + d * 16, pre - i);
            for (int64_t h = 0; h < hb; h++) a[h] = vf_fma(vf_set1(qv[h][d]), k, a[h]);
        }
        for (int64_t h = 0; h < hb; h++) vf_store_part(from[h] + (i - start), vf_mul(a[h], scale), pre - i);
    }
}

/* Softmax of each head's `count` scores in place, in position order, each head's own;
   sums[h]: the sum of head h's exponentials. */
ALWAYS void softmax_heads(const int64_t hb, float *const *sc, int64_t count, float *sums) {
    for (int64_t h = 0; h < hb; h++) {
        vf mx = vf_set1(-INFINITY);
        for (int64_t j = 0; j < count; j += 16)
            mx = vf_max(mx, vf_load_part(sc[h] + j, count - j, -INFINITY));
        const vf top = vf_set1(vf_hmax(mx));
        vf total = vf_zero();
        for (int64_t j = 0; j < count; j += 16) {
            const vf e = vf_keep_part(vexp(vf_sub(vf_load_part(sc[h] + j, count - j, 0.0f), top)), count - j);
            vf_store_part(sc[h] + j, e, count - j);
            total = vf_add(total, e);
        }
        sums[h] = vf_sum(total);
    }
}

/* Weighted values: one chain per output lane and head, keys in position order; heads share a
   value vector's load where their accumulators fit the registers. */
ALWAYS void weighted_values(const int64_t hb, const int half, const int64_t chunks, const void *vv, const int64_t D,
                            float *const *sc, const float *sums, int64_t count, int64_t first, int64_t pre,
                            const int32_t *xs, float *const *o) {
    if (hb * chunks <= 16) {
        switch (hb * 16 + chunks) {
        case 1 * 16 + 4: values_pass(1, half, 4, vv, D, sc, sums, count, first, pre, xs, o); break;
        case 2 * 16 + 4: values_pass(2, half, 4, vv, D, sc, sums, count, first, pre, xs, o); break;
        case 2 * 16 + 8: values_pass(2, half, 8, vv, D, sc, sums, count, first, pre, xs, o); break;
#if HEADS_MAX >= 4
        case 3 * 16 + 4: values_pass(3, half, 4, vv, D, sc, sums, count, first, pre, xs, o); break;
        case 4 * 16 + 4: values_pass(4, half, 4, vv, D, sc, sums, count, first, pre, xs, o); break;
#endif
        default: values_pass(hb, half, chunks, vv, D, sc, sums, count, first, pre, xs, o); break;
        }
    } else {
        for (int64_t h = 0; h < hb; h++)
            values_pass(1, half, chunks, vv, D, sc + h, sums + h, count, first, pre, xs, o + h);
    }
}

/* Visibility of row r: cache slots [0, prefix[r]) hold positions 0 .. prefix[r] - 1, then the
   slots extra[xoff[r] .. xoff[r+1]) hold the next positions, the row's own last. Logical index
   i is position i; a sliding window drops indices below pos - window + 1. Keys are stored in
   blocks of 16 slots (KEY_AT), so a pass's scores read KEY_BLOCKS contiguous runs of memory.
   A work item is one row's `hb` consecutive heads of one kv group (heads_per_item). */
ALWAYS void attention_in(const int half, const vs_stack *s, const vs_layer *L, void *const *keys,
                         void *const *values, int64_t layer, const float *q, int64_t n,
                         const int32_t *pos, const int32_t *prefix, const int32_t *xoff,
                         const int32_t *extra, float *out, float *scratch, int64_t hb) {
    const int64_t H = s->n_heads, D = s->head_dim, hpg = s->n_heads / s->n_kv, T = s->max_len, G = s->n_kv;
    const vf scale = vf_set1(s->attn_scale);
    const int64_t chunks = D / 16, per_row = H / hb;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * per_row; item++) {
        const int64_t r = item % n, h0 = (item / n) * hb, g = h0 / hpg;
        const float *qv[HEADS_MAX];
        float *sc[HEADS_MAX], *from[HEADS_MAX], *o[HEADS_MAX];
        float sums[HEADS_MAX];
        const void *kt = kv_ptr(keys[r], half, (layer * G + g) * D * T);     /* row r's own cache */
        const void *vv = kv_ptr(values[r], half, (layer * G + g) * T * D);
        const int64_t pre = prefix[r], nx = xoff[r + 1] - xoff[r];
        const int32_t *xs = extra + xoff[r];
        int64_t first = 0;
        if (L->window > 0 && pos[r] - L->window + 1 > 0) first = pos[r] - L->window + 1;
        const int64_t count = pre + nx - first;
        /* Scores from the block holding `first` (those before it computed and dropped): sc[h][j]
           is index first + j's for head h0 + h; o[h] its output. */
        const int64_t start = first & ~(int64_t)15;
        for (int64_t h = 0; h < hb; h++) {
            qv[h] = q + (r * H + h0 + h) * D;
            from[h] = scratch + ((int64_t)omp_get_thread_num() * HEADS_MAX + h) * (T + 64);
            sc[h] = from[h] + (first - start);
            o[h] = out + (r * H + h0 + h) * D;
        }
        prefix_scores(hb, half, qv, kt, D, from, start, pre, scale);
        /* The extra slots: the same chain, one key at a time (inline: as a helper of its own
           it changes how the compiler lays out the value passes below). */
        for (int64_t e = first > pre ? first - pre : 0; e < nx; e++) {
            const int64_t kd = KEY_AT(xs[e], 0, D);
            for (int64_t h = 0; h < hb; h++) {
                float a = 0.0f;
                for (int64_t d = 0; d < D; d++) a = fmaf(qv[h][d], kv_at(kt, half, kd + d * 16), a);
                sc[h][pre + e - first] = a * s->attn_scale;
            }
        }
        softmax_heads(hb, sc, count, sums);
        weighted_values(hb, half, chunks, vv, D, sc, sums, count, first, pre, xs, o);
    }
}

/* attention_in specialized for the cache's element type. */
static void attention(const vs_stack *s, const vs_layer *L, void *const *keys, void *const *values,
                      int64_t layer, const float *q, int64_t n, const int32_t *pos, const int32_t *prefix,
                      const int32_t *xoff, const int32_t *extra, float *out, float *scratch, int64_t hb) {
    if (s->kv_half) attention_in(1, s, L, keys, values, layer, q, n, pos, prefix, xoff, extra, out, scratch, hb);
    else attention_in(0, s, L, keys, values, layer, q, n, pos, prefix, xoff, extra, out, scratch, hb);
}

/* ------------------------------------------------------------------ decoder layers */

/* Rotate-half RoPE of one head (D floats) at position p, as x * cos + rotate_half(x) * sin. */
ALWAYS void rope_head(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const vf a = vf_load(x + i), b = vf_load(x + half + i);
        const vf ra = vf_sub(vf_mul(a, vf_load(cos + i)),
                                        vf_mul(b, vf_load(sin + i)));
        const vf rb = vf_add(vf_mul(b, vf_load(cos + half + i)),
                                        vf_mul(a, vf_load(sin + half + i)));
        vf_store(x + i, ra);
        vf_store(x + half + i, rb);
    }
}

/* Workspace floats one forward of n rows needs (besides the attention scratch). */
int64_t vs_stack_work(const vs_stack *s, int64_t n) {
    const int64_t qs = (int64_t)s->n_heads * s->head_dim, kvs = (int64_t)s->n_kv * s->head_dim;
    return n * (3 * (int64_t)s->dim + 2 * qs + 2 * kvs + 3 * (int64_t)s->hidden);
}

/* Per thread of the largest team a forward runs (team_max, fixed at the first call), not
   OpenMP's current maximum: torch.set_num_threads lowers that, and a stack sized after it would
   be run by a larger team writing past its scratch. */
int64_t vs_attention_scratch(const vs_stack *s) {
    team_init();
    return (int64_t)team_max * HEADS_MAX * (s->max_len + 64);
}

ALWAYS void add_rows(float *x, const float *y, int64_t dim) {
    for (int64_t i = 0; i < dim; i += 16)
        vf_store(x + i, vf_add(vf_load(x + i), vf_load(y + i)));
}

/* A layer's inputs to q, k and v (n rows of `width` at h): each row of x normed, or copied where
   the layer has no norm; with hidden_norm (EAGLE-3's layer) the row's embedding normed, then its
   state (which becomes the residual where norm_residual says so). */
ALWAYS void attention_inputs(const vs_stack *s, const vs_layer *L, float *x, const float *embeds, int64_t n,
                             float *h, int64_t width) {
    const int64_t dim = s->dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *hr = h + r * width, *xr = x + r * dim;
        if (L->hidden_norm) {
            rmsnorm_row(embeds + r * dim, L->attn_norm, hr, dim, s->eps);
            rmsnorm_row(xr, L->hidden_norm, hr + dim, dim, s->eps);
            if (L->norm_residual) memcpy(xr, hr + dim, dim * sizeof(float));
        } else if (L->attn_norm) {
            rmsnorm_row(xr, L->attn_norm, hr, dim, s->eps);
        } else {
            memcpy(hr, xr, dim * sizeof(float));
        }
    }
}

/* Each row's query and key heads normed (where the layer has q_norm, k_norm) and rotated at its
   position, its new key and value stored in its cache at slot[r] of layer l, and its rotated
   queries copied to att. */
ALWAYS void rope_and_store(const vs_stack *s, const vs_layer *L, int64_t l, float *q, float *k, const float *v,
                           float *att, int64_t n, const int32_t *pos, void *const *keys, void *const *values,
                           const int32_t *slot) {
    const int64_t H = s->n_heads, G = s->n_kv, D = s->head_dim, qs = H * D, kvs = G * D, T = s->max_len;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *qr = q + r * qs, *kr = k + r * kvs;
        const float *vr = v + r * kvs;
        const float *cos = L->cos + (int64_t)pos[r] * D, *sin = L->sin + (int64_t)pos[r] * D;
        for (int64_t hh = 0; hh < H; hh++) {
            if (L->q_norm) rmsnorm_row(qr + hh * D, L->q_norm, qr + hh * D, D, s->eps);
            rope_head(qr + hh * D, cos, sin, D);
        }
        for (int64_t g = 0; g < G; g++) {
            if (L->k_norm) rmsnorm_row(kr + g * D, L->k_norm, kr + g * D, D, s->eps);
            rope_head(kr + g * D, cos, sin, D);
            const int64_t kt = (l * G + g) * D * T + KEY_AT(slot[r], 0, D);
            const int64_t vt = ((l * G + g) * T + slot[r]) * D;
            for (int64_t d = 0; d < D; d++) {
                kv_put(keys[r], s->kv_half, kt + d * 16, kr[g * D + d]);
                kv_put(values[r], s->kv_half, vt + d, vr[g * D + d]);
            }
        }
        memcpy(att + r * qs, qr, qs * sizeof(float));
    }
}

/* x += the attention's output o (through post_attn_norm where the layer has one); h: the MLP's
   input, x normed. */
ALWAYS void attention_residual(const vs_stack *s, const vs_layer *L, float *x, float *o, float *h, int64_t n) {
    const int64_t dim = s->dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *orow = o + r * dim, *xr = x + r * dim;
        if (L->post_attn_norm) rmsnorm_row(orow, L->post_attn_norm, orow, dim, s->eps);
        add_rows(xr, orow, dim);
        rmsnorm_row(xr, L->mlp_norm, h + r * dim, dim, s->eps);
    }
}

/* act = the activation (GELU's tanh form or SiLU) of gate, times up, row by row. */
ALWAYS void mlp_activation(const vs_stack *s, const float *gate, const float *up, float *act, int64_t n) {
    const int64_t I = s->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *g = gate + r * I, *u = up + r * I;
        float *ar = act + r * I;
        for (int64_t i = 0; i < I; i += 16) {
            const vf gv = vf_load(g + i);
            const vf a = s->act ? vgelu_tanh(gv) : vsilu(gv);
            vf_store(ar + i, vf_mul(a, vf_load(u + i)));
        }
    }
}

/* x += the MLP's output o (through post_mlp_norm where the layer has one); then each row copied
   to its place in tapped where layer l is one of the taps. */
ALWAYS void mlp_residual(const vs_stack *s, const vs_layer *L, int64_t l, float *x, float *o, int64_t n,
                         const int32_t *taps, int64_t ntaps, float *tapped) {
    const int64_t dim = s->dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *orow = o + r * dim, *xr = x + r * dim;
        if (L->post_mlp_norm) rmsnorm_row(orow, L->post_mlp_norm, orow, dim, s->eps);
        add_rows(xr, orow, dim);
        for (int64_t t = 0; t < ntaps; t++)
            if (taps[t] == l) memcpy(tapped + (r * ntaps + t) * dim, xr, dim * sizeof(float));
    }
}

/* x (n x dim) through every layer, in place, each row over a cache of its own (rows of several
   sequences share a call; each row's arithmetic is the same whatever shares it). A cache holds,
   per layer, keys (n_kv x max_len/16 x head_dim x 16: blocks of 16 keys with each dimension's 16
   values together, so scores read 16 keys a vector, and a block's vectors follow each other) and
   values (n_kv x max_len x head_dim), floats or halves (kv_half). The rows: native.h's vs_rows. */
void vs_stack_forward_rows(const vs_stack *s, float *x, const vs_rows *rows, float *work, float *scratch) {
    const int64_t n = rows->n, ntaps = rows->ntaps;
    const int32_t *pos = rows->pos, *prefix = rows->prefix, *xoff = rows->xoff, *extra = rows->extra;
    const int32_t *slot = rows->slot, *taps = rows->taps;
    void *const *keys = rows->keys, *const *values = rows->values;
    const float *embeds = rows->embeds;
    float *tapped = rows->tapped;
    const int64_t dim = s->dim, H = s->n_heads, G = s->n_kv, D = s->head_dim, I = s->hidden;
    const int64_t qs = H * D, kvs = G * D;
    float *h = work;              /* n x dim (2 dim with hidden_norm): normed input of a sub-block */
    float *q = h + 2 * n * dim;   /* n x qs: queries, then the attention output */
    float *k = q + n * qs;        /* n x kvs */
    float *v = k + n * kvs;       /* n x kvs */
    float *att = v + n * kvs;     /* n x qs: rotated queries */
    float *gate = att + n * qs;   /* n x I */
    float *up = gate + n * I;     /* n x I */
    float *act = up + n * I;      /* n x I */
    float *o = act + n * I;       /* n x dim: a sub-block's output */
    const int threads = forward_team();
    const int64_t hb = heads_per_item(s, n, threads);
    const double started = wall_now();
    double cpu = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : cpu)
    {
    const double cpu_started = thread_cpu_now();
    for (int64_t l = 0; l < s->n_layers; l++) {
        const vs_layer *L = s->layers + l;
        const int64_t width = L->hidden_norm ? 2 * dim : dim;   /* q, k and v's inputs */
        attention_inputs(s, L, x, embeds, n, h, width);
        {
            const vs_weight *ws[3] = {&L->wq, &L->wk, &L->wv};
            float *ys[3] = {q, k, v};
            linear_rows_multi(ws, ys, 3, h, n, width);
        }
        rope_and_store(s, L, l, q, k, v, att, n, pos, keys, values, slot);
        attention(s, L, keys, values, l, att, n, pos, prefix, xoff, extra, q, scratch, hb);
        linear_rows(&L->wo, q, n, qs, o, dim);
        attention_residual(s, L, x, o, h, n);
        {
            const vs_weight *ws[2] = {&L->w_gate, &L->w_up};
            float *ys[2] = {gate, up};
            linear_rows_multi(ws, ys, 2, h, n, dim);
        }
        mlp_activation(s, gate, up, act, n);
        linear_rows(&L->w_down, act, n, I, o, dim);
        mlp_residual(s, L, l, x, o, n, taps, ntaps, tapped);
    }
    cpu += thread_cpu_now() - cpu_started;
    }
    vs_threads_observe(threads, cpu, wall_now() - started);
}

/* vs_stack_forward_rows for n rows of one sequence, no taps: one cache, new slots start ..
   start + n - 1 (the drafter's reads and tree levels). */
static void forward_one_cache(const vs_stack *s, float *x, const float *embeds, int64_t n, const int32_t *pos,
                              const int32_t *prefix, const int32_t *xoff, const int32_t *extra, void *keys,
                              void *values, int64_t start, float *work, float *scratch) {
    void **caches = malloc(2 * (size_t)n * sizeof(void *));
    int32_t *slot = malloc((size_t)n * sizeof(int32_t));
    for (int64_t r = 0; r < n; r++) caches[r] = keys, caches[n + r] = values, slot[r] = (int32_t)(start + r);
    const vs_rows rows = {.n = n, .pos = pos, .prefix = prefix, .xoff = xoff, .extra = extra, .slot = slot,
                          .keys = caches, .values = caches + n, .embeds = embeds};
    vs_stack_forward_rows(s, x, &rows, work, scratch);
    free(caches);
    free(slot);
}

/* ------------------------------------------------------------------ draft heads */

/* For each of M rows (N logits each): the k largest entries (ties: the lower index first) as
   ids and log-probabilities under the softmax over all of them. Call inside a parallel region. */
static void topk_rows(const float *logits, int64_t M, int64_t N, int64_t k, int64_t *ids, float *logprobs) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; i++) {
        const float *row = logits + i * N;
        vf mx = vf_set1(-INFINITY);
        for (int64_t j = 0; j < N; j += 16)
            mx = vf_max(mx, vf_load_part(row + j, N - j, -INFINITY));
        const float top = vf_hmax(mx);
        vf total = vf_zero();
        for (int64_t j = 0; j < N; j += 16)
            total = vf_add(total, vf_keep_part(vexp(vf_sub(vf_load_part(row + j, N - j, 0.0f), vf_set1(top))), N - j));
        const float lse = top + logf(vf_sum(total));
        /* k best, kept sorted (best first); a candidate must beat the k-th */
        float best[64];
        int64_t at[64];
        int64_t have = 0;
        const int64_t kk = k < 64 ? k : 64;
        for (int64_t j = 0; j < N; j++) {
            const float v = row[j];
            if (have == kk && !(v > best[kk - 1])) continue;
            int64_t pos = have < kk ? have++ : kk - 1;
            while (pos > 0 && v > best[pos - 1]) {
                best[pos] = best[pos - 1];
                at[pos] = at[pos - 1];
                pos--;
            }
            best[pos] = v;
            at[pos] = j;
        }
        for (int64_t t = 0; t < kk; t++) {
            ids[i * k + t] = t < have ? at[t] : 0;
            logprobs[i * k + t] = t < have ? best[t] - lse : -INFINITY;
        }
    }
}

/* For each of M rows of x: the k largest entries of x w^T (ties: the lower index first) as ids
   and log-probabilities under the softmax over all of them. logits: M x rows scratch. */
void vs_linear_topk(const vs_weight *w, const float *x, int64_t M, int64_t k, float *logits,
                    int64_t *ids, float *logprobs) {
#pragma omp parallel num_threads(team())
    {
        linear_rows(w, x, M, w->cols, logits, w->rows);
        topk_rows(logits, M, w->rows, k, ids, logprobs);
    }
}

/* ------------------------------------------------------------------ speculative steps

   A draft tree or a verification in one call each, so that a step costs the arithmetic and
   not the host's bookkeeping between small kernels. Tree nodes are numbered as flattened for
   the target: the root (the last committed token) first, then depth by depth; node i's
   parent is smaller than i. */

/* Keep the pending slots keep[0..nkeep) of every layer (native.h). */
void vs_cache_keep(const vs_cache *c, int64_t length, const int64_t *keep, int64_t nkeep) {
    const int64_t size = c->half ? 2 : 4;    /* bytes an element */
    const int64_t head_dim = c->head_dim, T = c->slots;
    for (int64_t g = 0; g < c->layers * c->n_kv; g++) {
        char *k = (char *)c->keys + g * head_dim * T * size, *v = (char *)c->values + g * T * head_dim * size;
        for (int64_t j = 0; j < nkeep; j++) {
            const int64_t src = length + keep[j], dst = length + j;
            if (src == dst) continue;
            for (int64_t d = 0; d < head_dim; d++)
                memcpy(k + KEY_AT(dst, d, head_dim) * size, k + KEY_AT(src, d, head_dim) * size, size);
            memcpy(v + dst * head_dim * size, v + src * head_dim * size, head_dim * size);
        }
    }
}

/* The head's argmax (the first index on ties, as plain decoding picks) of m rows of hidden:
   norm, then one pass over the head's weights. Each work item's logits (CHUNK blocks of RB
   vocabulary rows) go to a small tile of the thread's own and are scanned while in cache, so the
   vocabulary's logits are never written out; a logit has the bits vs_head gives it. The items
   of `omp for schedule(static)` are contiguous and in thread order, so keeping a strictly
   greater value, first within each thread and then over the threads in order, keeps the first
   maximum. */
static void head_argmax(const float *norm, float eps, const vs_weight *w, const float *hidden, const int64_t *rows,
                        int64_t m, int64_t *best, float *work) {
    const int64_t dim = w->cols, V = w->rows, blocks = (V + RB - 1) / RB, items = (blocks + CHUNK - 1) / CHUNK;
    const int64_t W = CHUNK * RB;                  /* a tile's columns */
    const int threads = team();
    float *tiles = malloc((size_t)threads * m * W * sizeof(float));
    float *top = malloc((size_t)threads * m * sizeof(float));
    int64_t *at = malloc((size_t)threads * m * sizeof(int64_t));
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *tile = tiles + (int64_t)t * m * W, *mine = top + (int64_t)t * m;
        int64_t *where = at + (int64_t)t * m;
        for (int64_t i = 0; i < m; i++) mine[i] = -INFINITY, where[i] = -1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) rmsnorm_row(hidden + rows[i] * dim, norm, work + i * dim, dim, eps);
        acts in = {0};
#pragma omp for schedule(static)
        for (int64_t c = 0; c < items; c++) {
            const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
            /* column n of the item at tile[i * W + n - b0 * RB] */
            linear_blocks(w, b0, b1, work, m, dim, tile - b0 * RB, W, &in);
            const int64_t n0 = b0 * RB, count = (b1 * RB < V ? b1 * RB : V) - n0;
            for (int64_t i = 0; i < m; i++) {
                const float *row = tile + i * W;
                vf hi = vf_set1(-INFINITY);
                for (int64_t j = 0; j < count; j += 16) hi = vf_max(hi, vf_load_part(row + j, count - j, -INFINITY));
                if (!(vf_hmax(hi) > mine[i])) continue;
                for (int64_t j = 0; j < count; j++)
                    if (row[j] > mine[i]) mine[i] = row[j], where[i] = n0 + j;
            }
        }
    }
    for (int64_t i = 0; i < m; i++) {
        int64_t pick = -1;
        float value = -INFINITY;
        for (int t = 0; t < threads; t++)
            if (at[t * m + i] >= 0 && (pick < 0 || top[t * m + i] > value)) pick = at[t * m + i], value = top[t * m + i];
        best[i] = pick < 0 ? 0 : pick;
    }
    free(tiles);
    free(top);
    free(at);
}

/* Greedy verification (native.h's vs_verify_request): from each root, follow the child carrying
   the target's argmax while there is one. The LM head scores rows as they are reached, in
   batches along the likeliest path (a node, its first child, that child's first child, up to
   head_rows rows: about one row's pass over the head's weights; a first batch is filled up with
   the tree's other rows), every tree's first batch in one pass. */
void vs_verify_greedy(const vs_verify_request *r) {
    const float *norm = r->norm, *hidden = r->hidden;
    const float eps = r->eps;
    const vs_weight *w = r->head;
    const int64_t ntrees = r->ntrees, *offsets = r->offsets, *tokens = r->tokens, *parents = r->parents;
    int64_t head_rows = r->head_rows, *paths = r->paths, *counts = r->counts, *next = r->next;
    float *work = r->work;
    const int64_t n = offsets[ntrees];
    int64_t *best = malloc((size_t)n * sizeof(int64_t)), *first = malloc((size_t)n * sizeof(int64_t));
    int64_t *rows = malloc((size_t)(ntrees * 64 > 64 ? ntrees * 64 : 64) * sizeof(int64_t));
    int64_t *found = malloc((size_t)(ntrees * 64 > 64 ? ntrees * 64 : 64) * sizeof(int64_t));
    if (head_rows > 64) head_rows = 64;
    if (head_rows < 1) head_rows = 1;
    for (int64_t i = 0; i < n; i++) best[i] = -1, first[i] = -1;
    for (int64_t t = 0; t < ntrees; t++)
        for (int64_t i = offsets[t + 1] - 1; i > offsets[t]; i--) first[offsets[t] + parents[i]] = i;
    /* Every tree's first batch: its root and the first children below it (the likeliest path),
       then its other rows in order while the batch has room: a pass over the head costs about
       the same for any rows up to head_rows, and a second pass costs a whole one. */
    int64_t m = 0;
    char *taken_row = calloc((size_t)n + 1, 1);
    for (int64_t t = 0; t < ntrees; t++) {
        int64_t taken = 0;
        for (int64_t b = offsets[t]; b >= 0 && taken < head_rows; b = first[b], taken++)
            rows[m++] = b, taken_row[b] = 1;
        for (int64_t b = offsets[t] + 1; b < offsets[t + 1] && taken < head_rows; b++)
            if (!taken_row[b]) rows[m++] = b, taken_row[b] = 1, taken++;
    }
    free(taken_row);
    head_argmax(norm, eps, w, hidden, rows, m, found, work);
    for (int64_t i = 0; i < m; i++) best[rows[i]] = found[i];
    for (int64_t t = 0; t < ntrees; t++) {
        const int64_t base = offsets[t], end = offsets[t + 1];
        int64_t node = base, count = 0;
        for (;;) {
            paths[base + count++] = node - base;
            if (best[node] < 0) {      /* off the first batch: score this node's own batch */
                int64_t k = 0;
                for (int64_t b = node; b >= 0 && k < head_rows && best[b] < 0; b = first[b]) rows[k++] = b;
                head_argmax(norm, eps, w, hidden, rows, k, found, work);
                for (int64_t i = 0; i < k; i++) best[rows[i]] = found[i];
            }
            int64_t match = -1;
            for (int64_t c = node + 1; c < end; c++)
                if (base + parents[c] == node && tokens[c] == best[node]) {
                    match = c;
                    break;
                }
            if (match < 0) break;
            node = match;
        }
        counts[t] = count;
        next[t] = best[node];
    }
    free(best);
    free(first);
    free(rows);
    free(found);
}


/* Rows of the embedding (scaled by embed_scale unless 0) of n tokens, `stride` floats apart. */
static void drafter_embed(const vs_drafter *d, const int64_t *tokens, int64_t n, float *out, int64_t stride) {
    const int64_t dim = d->fc.rows;
    for (int64_t i = 0; i < n; i++) {
        vs_dequant_rows(&d->embed, tokens[i], tokens[i] + 1, out + i * stride);
        if (d->embed_scale != 0.0f)
            for (int64_t j = 0; j < dim; j++) out[i * stride + j] *= d->embed_scale;
    }
}

/* EAGLE-2: x (n x dim) = fc(embedding(tokens), features) for n rows; features: n x dim (normed
   if `normed`, else the target's hidden states, normed here). pair: n x 2 dim scratch. */
static void drafter_input(const vs_drafter *d, const int64_t *tokens, const float *features, int normed,
                          int64_t n, float *pair, float *x) {
    const int64_t dim = d->fc.rows;
    drafter_embed(d, tokens, n, pair, 2 * dim);
    for (int64_t i = 0; i < n; i++) {
        if (normed) memcpy(pair + i * 2 * dim + dim, features + i * dim, dim * sizeof(float));
        else rmsnorm_row(features + i * dim, d->norm, pair + i * 2 * dim + dim, dim, d->eps);
    }
#pragma omp parallel num_threads(team())
    linear_rows(&d->fc, pair, n, 2 * dim, x, dim);
}

/* The drafter's outputs (n x dim, in place) as states: through out_norm where it has one. */
static void drafter_states(const vs_drafter *d, const vs_stack *s, float *x, int64_t n) {
    if (d->out_norm)
        for (int64_t i = 0; i < n; i++) rmsnorm_row(x + i * s->dim, d->out_norm, x + i * s->dim, s->dim, s->eps);
}

/* The drafter reads n committed rows (native.h's vs_read_request). */
void vs_drafter_read(const vs_read_request *r) {
    const vs_drafter *d = r->drafter;
    const vs_stack *s = r->stack;
    const int64_t n = r->n, length = r->length, *tokens = r->tokens;
    const float *hidden = r->hidden;
    float *scratch = r->scratch, *work = r->work, *att = r->att;
    const int64_t dim = d->fc.rows;
    float *pair = scratch, *x = pair + n * 2 * dim;
    int32_t *pos = (int32_t *)(x + n * dim), *prefix = pos + n, *xoff = prefix + n, *extra = xoff + n + 1;
    if (d->fused) {
        drafter_embed(d, tokens, n, pair, dim);
#pragma omp parallel num_threads(team())
        linear_rows(&d->fc, hidden, n, d->fc.cols, x, dim);
    } else {
        drafter_input(d, tokens, hidden, 0, n, pair, x);
    }
    for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(length + i), prefix[i] = (int32_t)(length + i + 1), xoff[i] = 0;
    xoff[n] = 0;
    extra[0] = 0;
    forward_one_cache(s, x, d->fused ? pair : NULL, n, pos, prefix, xoff, extra, r->keys, r->values, length, work,
                      att);
    drafter_states(d, s, x + (n - 1) * dim, 1);
    memcpy(r->state, x + (n - 1) * dim, dim * sizeof(float));
}

/* Floats of scratch vs_drafter_read needs for n rows. */
int64_t vs_drafter_read_scratch(const vs_drafter *d, int64_t n) { return n * (3 * (int64_t)d->fc.rows + 4) + 2; }

/* ---- EAGLE-2's dynamic tree (tree.TreeBuilder is the reference; the same nodes, the same
   order). Node values are summed log-probabilities (double). The root's top_k children form
   depth 1; each level expands the top_k newest nodes by value (ties: drafted earlier), less
   those that cannot reach the final tree; finally the best total_tokens nodes are kept (ties:
   shallower, then drafted earlier) and flattened depth by depth, siblings in their parent's
   order, most valuable first. */
typedef struct {
    const double *value;
    const int32_t *depth, *parent, *flat;
} tree_keys;

static __thread const tree_keys *sort_keys;

static int by_value(const void *a, const void *b) { /* -value, then id */
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const double vi = sort_keys->value[i], vj = sort_keys->value[j];
    return vi > vj ? -1 : vi < vj ? 1 : (i > j) - (i < j);
}

static int by_rank(const void *a, const void *b) { /* -value, depth, id */
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const double vi = sort_keys->value[i], vj = sort_keys->value[j];
    if (vi != vj) return vi > vj ? -1 : 1;
    if (sort_keys->depth[i] != sort_keys->depth[j]) return sort_keys->depth[i] - sort_keys->depth[j];
    return (i > j) - (i < j);
}

static int by_place(const void *a, const void *b) { /* depth, parent's place, -value, id */
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (sort_keys->depth[i] != sort_keys->depth[j]) return sort_keys->depth[i] - sort_keys->depth[j];
    const int32_t pi = sort_keys->flat[sort_keys->parent[i]], pj = sort_keys->flat[sort_keys->parent[j]];
    if (pi != pj) return pi - pj;
    const double vi = sort_keys->value[i], vj = sort_keys->value[j];
    if (vi != vj) return vi > vj ? -1 : 1;
    return (i > j) - (i < j);
}

static int by_double_desc(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : x < y;
}

/* A drafted child's log-probability as its value adds it (tree.tree_log_prob is the reference):
   NaN (a head with NaN weights, as a checkpoint saved before its head was filled) counts as
   -inf and a rounding above 0 as 0. Every value is then a number no greater than its parent's,
   which the sorts' orders and the kept tree's closure (every kept node's parent kept) rest on. */
static double tree_log_prob(float lp) {
    return lp <= 0.0f ? (double)lp : lp > 0.0f ? 0.0 : -INFINITY;
}

/* Most nodes a tree of these settings drafts (the root included). */
int64_t vs_tree_capacity(int64_t top_k, int64_t depth) { return 1 + top_k + depth * top_k * top_k; }

/* vs_eagle_tree's working state: per node (the root first, then as drafted) its token, parent,
   depth, drafter cache slot (-1 while not expanded), row among the frontier's states (then its
   value rank), value and flattened place; the frontier (nodes expanded next) and the drafter's
   rows for it; scratch for the head's top-k and the sorts. */
typedef struct {
    int64_t *tok, *ids;
    int32_t *par, *dep, *slot, *row_of, *order, *flat;
    double *val, *sorted;
    float *lp, *states, *pair, *normed;
    int64_t *front_tok;
    int32_t *pos, *prefix, *xoff, *extra;
    float *cur, *next_states;   /* the frontier's states, and the next frontier's */
    int32_t front[64];
    int64_t count, pending, n_front;
} eagle_tree;

static void eagle_tree_alloc(eagle_tree *t, const vs_drafter *d, int64_t top_k, int64_t depth) {
    const int64_t dim = d->fc.rows, cap = vs_tree_capacity(top_k, depth);
    t->tok = malloc(cap * sizeof(int64_t)), t->ids = malloc(top_k * top_k * sizeof(int64_t));
    t->par = malloc(cap * sizeof(int32_t)), t->dep = malloc(cap * sizeof(int32_t));
    t->slot = malloc(cap * sizeof(int32_t)), t->row_of = malloc(cap * sizeof(int32_t));
    t->order = malloc(2 * cap * sizeof(int32_t)), t->flat = malloc(cap * sizeof(int32_t));
    t->val = malloc(cap * sizeof(double)), t->sorted = malloc(cap * sizeof(double));
    t->lp = malloc(top_k * top_k * sizeof(float));
    t->states = malloc(2 * top_k * dim * sizeof(float)), t->pair = malloc(top_k * 2 * dim * sizeof(float));
    t->normed = d->head_norm ? malloc(top_k * dim * sizeof(float)) : NULL;
    t->front_tok = malloc(top_k * sizeof(int64_t));
    t->pos = malloc(top_k * sizeof(int32_t)), t->prefix = malloc(top_k * sizeof(int32_t));
    t->xoff = malloc((top_k + 1) * sizeof(int32_t)), t->extra = malloc(top_k * (depth + 1) * sizeof(int32_t));
}

static void eagle_tree_free(eagle_tree *t) {
    free(t->tok), free(t->ids), free(t->par), free(t->dep), free(t->slot), free(t->row_of), free(t->order);
    free(t->flat), free(t->val), free(t->sorted), free(t->lp), free(t->states), free(t->pair), free(t->front_tok);
    free(t->pos), free(t->prefix), free(t->xoff), free(t->extra), free(t->normed);
}

/* The frontier's rows (states in cur) through the head: top_k children each (fewer where the
   head has fewer rows), appended as the newest nodes. */
static void eagle_tree_children(const vs_drafter *d, const vs_stack *s, eagle_tree *t, int64_t top_k,
                                float *head_logits) {
    const int64_t dim = d->fc.rows, n_front = t->n_front;
    const int64_t k = top_k < d->head.rows ? top_k : d->head.rows;
    const float *head_in = t->cur;
    if (d->head_norm) {
        for (int64_t r = 0; r < n_front; r++)
            rmsnorm_row(t->cur + r * dim, d->head_norm, t->normed + r * dim, dim, s->eps);
        head_in = t->normed;
    }
#pragma omp parallel num_threads(team())
    {
        linear_rows(&d->head, head_in, n_front, dim, head_logits, d->head.rows);
        topk_rows(head_logits, n_front, d->head.rows, k, t->ids, t->lp);
    }
    for (int64_t r = 0; r < n_front; r++) {
        const int32_t p = t->front[r];
        for (int64_t c = 0; c < k; c++) {
            const int64_t count = t->count;
            t->tok[count] = d->head_ids ? d->head_ids[t->ids[r * k + c]] : t->ids[r * k + c];
            t->par[count] = p;
            t->dep[count] = t->dep[p] + 1;
            t->val[count] = t->val[p] + tree_log_prob(t->lp[r * k + c]);
            t->slot[count] = -1;
            t->count++;
        }
    }
}

/* The next frontier (its size returned): of the newest nodes [newest_lo, count), the top_k by
   value, less nodes valued at most the total_tokens-th value overall (their descendants could
   not be kept). */
static int64_t eagle_tree_next_front(eagle_tree *t, int64_t top_k, int64_t total_tokens, int32_t newest_lo) {
    const int64_t count = t->count;
    int32_t cand = (int32_t)count - newest_lo;
    for (int32_t i = 0; i < cand; i++) t->order[i] = newest_lo + i;
    qsort(t->order, cand, sizeof(int32_t), by_value);
    if (cand > top_k) cand = (int32_t)top_k;
    int64_t m = 0;
    if (count - 1 < total_tokens) {
        for (int32_t i = 0; i < cand; i++) t->front[m++] = t->order[i];
    } else {
        memcpy(t->sorted, t->val + 1, (count - 1) * sizeof(double));
        qsort(t->sorted, count - 1, sizeof(double), by_double_desc);
        const double cutoff = t->sorted[total_tokens - 1];
        for (int32_t i = 0; i < cand; i++)
            if (t->val[t->order[i]] > cutoff) t->front[m++] = t->order[i];
    }
    return m;
}

/* The m frontier nodes through the drafter: each row its token and its parent's state, seeing
   its expanded ancestors' pending slots and its own; their states become the frontier's. */
static void eagle_tree_expand(const vs_drafter *d, const vs_stack *s, eagle_tree *t, int64_t m, void *keys,
                              void *values, int64_t length, float *work, float *att) {
    const int64_t dim = d->fc.rows;
    for (int64_t r = 0; r < m; r++) {
        const int32_t node = t->front[r];
        t->front_tok[r] = t->tok[node];
        memcpy(t->next_states + r * dim, t->cur + t->row_of[t->par[node]] * dim, dim * sizeof(float));
    }
    if (d->fused) drafter_embed(d, t->front_tok, m, t->pair, dim);    /* the parents' states as they are */
    else drafter_input(d, t->front_tok, t->next_states, 1, m, t->pair, t->next_states);
    t->xoff[0] = 0;
    for (int64_t r = 0; r < m; r++) {
        const int32_t node = t->front[r];
        t->pos[r] = (int32_t)(length - 1 + t->dep[node]);
        t->prefix[r] = (int32_t)length;
        int64_t at = t->xoff[r] + t->dep[node];  /* ancestors below the root, then itself */
        t->extra[--at] = (int32_t)(length + t->pending + r);
        for (int32_t a = t->par[node]; a > 0; a = t->par[a]) t->extra[--at] = (int32_t)(length + t->slot[a]);
        t->xoff[r + 1] = t->xoff[r] + t->dep[node];
    }
    forward_one_cache(s, t->next_states, d->fused ? t->pair : NULL, m, t->pos, t->prefix, t->xoff, t->extra, keys,
                      values, length + t->pending, work, att);
    drafter_states(d, s, t->next_states, m);
    for (int64_t r = 0; r < m; r++) t->slot[t->front[r]] = (int32_t)(t->pending + r), t->row_of[t->front[r]] = (int32_t)r;
    t->pending += m;
    t->n_front = m;
    float *swap = t->cur;
    t->cur = t->next_states;
    t->next_states = swap;
}

/* Every drafted node into t->order, in by_rank's order (the kept tree's ranking). */
static void eagle_tree_rank(eagle_tree *t) {
    for (int32_t i = 0; i < t->count - 1; i++) t->order[i] = i + 1;
    qsort(t->order, t->count - 1, sizeof(int32_t), by_rank);
}

/* Keep the best total_tokens (their count returned; row_of: each one's value rank) and place them
   depth by depth (flat: each node's place; order + kept: the kept nodes in place order). */
static int64_t eagle_tree_place(eagle_tree *t, int64_t depth, int64_t total_tokens) {
    const int64_t count = t->count;
    int64_t kept = count - 1 < total_tokens ? count - 1 : total_tokens;
    eagle_tree_rank(t);
    for (int64_t i = 0; i < count; i++) t->flat[i] = -1;
    for (int64_t r = 0; r < kept; r++) t->row_of[t->order[r]] = (int32_t)r;   /* value rank */
    t->flat[0] = 0;
    /* Parents are kept with their children and are shallower: placing level by level in
       depth order sees each parent's place before its children are sorted. */
    int32_t *place = t->order + kept, placed = 0;
    memcpy(place, t->order, kept * sizeof(int32_t));
    int64_t lo = 0;
    for (int32_t dd = 1; lo < kept && dd <= depth + 1; dd++) {
        int64_t hi = lo;
        for (int64_t i = lo; i < kept; i++)
            if (t->dep[place[i]] == dd) {
                const int32_t swap = place[hi];
                place[hi++] = place[i];
                place[i] = swap;
            }
        qsort(place + lo, hi - lo, sizeof(int32_t), by_place);
        for (int64_t i = lo; i < hi; i++) t->flat[place[i]] = (int32_t)(++placed);
        lo = hi;
    }
    return kept;
}

/* The placed tree, flattened, into the caller's arrays; its rows, or -1 where it is not a tree. */
static int64_t eagle_tree_write(const eagle_tree *t, int64_t kept, int64_t root, int64_t *tokens, int64_t *parents,
                                int64_t *ranks, double *node_values) {
    const int32_t *place = t->order + kept;
    tokens[0] = root, parents[0] = -1, ranks[0] = -1, node_values[0] = 0.0;
    int64_t rows = kept + 1;
    for (int64_t i = 0; i < kept; i++) {
        const int32_t node = place[i];
        tokens[i + 1] = t->tok[node];
        parents[i + 1] = t->flat[t->par[node]];
        ranks[i + 1] = t->row_of[node];
        node_values[i + 1] = t->val[node];
        /* Kept without its parent, or placed after none: a broken tree must not reach
           verification, which indexes by parent. */
        if (node < 1 || parents[i + 1] < 0 || parents[i + 1] > i) rows = -1;
    }
    return rows;
}

/* A node's calibrated chance to be on the accepted path (live_tree.Calibration's bin). */
static double stop_chance(const vs_tree_stop *stop, int32_t node_depth, double value) {
    const int64_t depth = node_depth < stop->depths ? node_depth : stop->depths - 1;
    int64_t bin = (int64_t)(exp(value) * (double)stop->bins);
    if (bin > stop->bins - 1) bin = stop->bins - 1;
    return stop->chance[depth * stop->bins + bin];
}

/* Of a tree holding more than total_tokens nodes, the one ranked total_tokens-th (by_rank's
   order, as eagle_tree_place keeps them), which a new node kept would push out. Sorts into
   t->order, free once eagle_tree_next_front has chosen the frontier. */
static int32_t eagle_tree_cut_node(eagle_tree *t, int64_t total_tokens) {
    eagle_tree_rank(t);
    return t->order[total_tokens - 1];
}

/* How many of the m frontier nodes the next level expands (vs_tree_stop; NULL: all of them).
   A child's chance is never above its parent's, and siblings' chances sum to at most their
   parent's (one of them at most is on the path): a frontier node's chance bounds what its
   children can add. Where the tree already holds total_tokens nodes, a child kept pushes out
   the node ranked last, so each can add at most its chance less that node's. The first w nodes
   (frontier order), w the best sum of what they add less node_cost each, where that sum
   reaches min_gain; else 0. Summed in frontier order, as live_tree.TreeStop sums them. */
static int64_t eagle_tree_level_width(const vs_tree_stop *stop, eagle_tree *t, int64_t m, int64_t total_tokens) {
    if (stop == NULL) return m;
    double displaced = 0.0;
    if (t->count - 1 >= total_tokens) {
        const int32_t cut = eagle_tree_cut_node(t, total_tokens);
        displaced = stop_chance(stop, t->dep[cut], t->val[cut]);
    }
    double gain = 0.0, best = 0.0;
    int64_t width = 0;
    for (int64_t r = 0; r < m; r++) {
        const int32_t node = t->front[r];
        const double more = stop_chance(stop, t->dep[node], t->val[node]) - displaced;
        gain += (more > 0.0 ? more : 0.0) - stop->node_cost;
        if (gain > best) best = gain, width = r + 1;
    }
    return width > 0 && best >= stop->min_gain ? width : 0;
}

/* Grow the tree of request `r` (native.h's vs_tree_request) from its `state` over the drafter's
   cache of `length` committed slots; its expansions are left pending (forgotten: the next read
   overwrites them). Writes the kept tree, flattened, to tokens/parents (parents[0] = -1) and
   each node's value rank to ranks (-1 for the root) and its value (the log of the product of
   confidences along its path; 0 for the root) to node_values; returns its rows (-1: a tree that
   is not one, which the caller raises on). stop: where the tree may stop growing before
   `depth` (NULL: never). */
int64_t vs_eagle_tree(const vs_tree_request *r) {
    const vs_drafter *d = r->drafter;
    const vs_stack *s = r->stack;
    const int64_t top_k = r->top_k, depth = r->depth, total_tokens = r->total_tokens;
    vs_tree_stop *stop = r->stop;
    float *head_logits = r->head_logits;
    const int64_t dim = d->fc.rows;
    eagle_tree t;
    eagle_tree_alloc(&t, d, top_k, depth);
    tree_keys keys_ = {t.val, t.dep, t.par, t.flat};
    sort_keys = &keys_;
    t.count = 1, t.pending = 0;
    t.tok[0] = r->root, t.par[0] = -1, t.dep[0] = 0, t.val[0] = 0.0, t.slot[0] = -1;

    /* Depth 1: the root's children, from `state`. */
    t.cur = t.states, t.next_states = t.states + top_k * dim;
    memcpy(t.cur, r->state, dim * sizeof(float));
    t.n_front = 1;
    t.front[0] = 0;
    t.row_of[0] = 0;
    if (stop) stop->rows = 0;
    for (int64_t level = 0; level <= depth; level++) {
        const int32_t newest_lo = (int32_t)t.count;
        eagle_tree_children(d, s, &t, top_k, head_logits);
        if (stop) stop->levels = level + 1, stop->rows += t.n_front;
        if (level == depth) break;
        const int64_t m = eagle_tree_level_width(stop, &t, eagle_tree_next_front(&t, top_k, total_tokens, newest_lo),
                                                 total_tokens);
        if (m == 0) break;
        eagle_tree_expand(d, s, &t, m, r->keys, r->values, r->length, r->work, r->att);
    }
    const int64_t kept = eagle_tree_place(&t, depth, total_tokens);
    const int64_t rows = eagle_tree_write(&t, kept, r->root, r->tokens, r->parents, r->ranks, r->node_values);
    eagle_tree_free(&t);
    return rows;
}
