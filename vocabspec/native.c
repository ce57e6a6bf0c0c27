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
 * Built by native.py with the machine's C compiler (-O3 -march=native -fopenmp
 * -ffp-contract=off: every fused multiply-add here is written as one). Needs AVX-512F.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "the vocabspec native engine needs AVX-512F and AVX-512BW"
#endif

#define VS_F32 0
#define VS_BF16 1
#define VS_Q4 2 /* 4-bit codes, per group: w = code * scale + min */
#define VS_Q5 3 /* as Q4 with a fifth bit per code in one 32-bit word per group */
#define VS_Q8 4 /* signed 8-bit codes, per group: w = code * scale (+ min) */
/* The same three for products with 8-bit activations (x quantized per 32 inputs, as llama.cpp
   does), in the layout AVX-512 VNNI reads: four consecutive inputs' codes per 32-bit lane. */
#define VS_Q4I 5
#define VS_Q5I 6
#define VS_Q8I 7

#define ALWAYS static inline __attribute__((always_inline))

typedef struct {
    int32_t kind, rows, cols, group, scale_f16, pad;
    const void *data;      /* F32/BF16: rows x cols; Q4/Q5: rows x cols/2 bytes; Q8: rows x cols */
    const uint16_t *high;  /* Q5: fifth bits of a block, one 16-bit word (a bit per row) per input */
    const void *scale;     /* rows x cols/group, float or half */
    const void *min;       /* same shape and type, or NULL */
    const float *bias;     /* rows, or NULL */
} vs_weight;

typedef struct {
    vs_weight wq, wk, wv, wo, w_gate, w_up, w_down;
    const float *attn_norm, *mlp_norm, *post_attn_norm, *post_mlp_norm, *q_norm, *k_norm;
    const float *cos, *sin;  /* RoPE tables, max_len x head_dim */
    int32_t window, pad;     /* sliding window in positions, 0: global attention */
} vs_layer;

typedef struct {
    int32_t dim, n_heads, n_kv, head_dim, hidden, max_len, n_layers, act; /* act 0 SiLU, 1 GELU-tanh */
    float eps, attn_scale;
    vs_layer *layers;
} vs_stack;

/* ------------------------------------------------------------------ elementwise math */

/* exp(x), the same polynomial for every lane: Cody-Waite reduction by ln 2, degree-6 Taylor
   on [-ln2/2, ln2/2], scaled by 2^n. Below -87.3 it is 0; above 88.7 it is +inf. */
ALWAYS __m512 vexp(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

ALWAYS __m512 vsilu(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1). */
ALWAYS __m512 vgelu_tanh(__m512 x) {
    __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), x3)));
    __m512 e = vexp(_mm512_add_ps(u, u));
    __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                             _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), t));
}

ALWAYS __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* y = x * rsqrt(mean(x^2) + eps) * w over one row of `dim` (a multiple of 16) floats. */
ALWAYS void rmsnorm_row(const float *x, const float *w, float *y, int64_t dim, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float r = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps);
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < dim; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), _mm512_loadu_ps(w + i)));
}

/* ------------------------------------------------------------------ matmul */

/* Weights are stored in blocks of RB = 16 output rows, one per vector lane (the last block
   padded with zero rows). For each 32-input unit a block holds the codes of its 16 rows input
   by input, then the unit's scales (and mins) as one vector each: a product streams one
   sequence per block and needs no horizontal sums.

   Output n of row x: for each unit (group of 32 inputs, or two of 16), a partial sum
   p = sum of x_k * code_k (one fused multiply-add chain, inputs ascending), then
   acc = fma(p, scale, acc) and, with mins, acc = fma(sum of the unit's x_k, min, acc); float
   weights add p to acc. The bias comes last. Every output follows this one sequence whatever
   the rows or the tiling, so a row's bits never depend on the rest of the call. */
#define RB 16

ALWAYS int64_t unit_bytes(const int kind) {
    return kind == VS_F32 ? 2048 : kind == VS_BF16 ? 1024 : kind == VS_Q8 ? 512 : 256;
}

ALWAYS const uint8_t *payload(const int kind, const vs_weight *w, int64_t b, int64_t u) {
    return (const uint8_t *)w->data + (b * (w->cols / 32) + u) * unit_bytes(kind);
}

ALWAYS __m512 vec_at(const void *p, const int f16, int64_t i) { /* 16 floats or halves */
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + 16 * i)));
    return _mm512_loadu_ps((const float *)p + 16 * i);
}

/* The codes (float weights for f32/bf16) of inputs 2t and 2t + 1 of a unit, 16 rows each. */
ALWAYS void codes_pair(const int kind, const uint8_t *p, const uint16_t *high, int t, __m512 *w0, __m512 *w1) {
    if (kind == VS_F32) {
        *w0 = _mm512_loadu_ps(p + (2 * t) * 64);
        *w1 = _mm512_loadu_ps(p + (2 * t + 1) * 64);
    } else if (kind == VS_BF16) {
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + (2 * t) * 32))), 16));
        *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + (2 * t + 1) * 32))), 16));
    } else if (kind == VS_Q8) {
        *w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + (2 * t) * 16))));
        *w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + (2 * t + 1) * 16))));
    } else {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + t * 16)));
        __m512i a = _mm512_and_si512(v, _mm512_set1_epi32(15)), b = _mm512_srli_epi32(v, 4);
        if (kind == VS_Q5) {
            a = _mm512_mask_or_epi32(a, (__mmask16)high[2 * t], a, _mm512_set1_epi32(16));
            b = _mm512_mask_or_epi32(b, (__mmask16)high[2 * t + 1], b, _mm512_set1_epi32(16));
        }
        *w0 = _mm512_cvtepi32_ps(a);
        *w1 = _mm512_cvtepi32_ps(b);
    }
}

/* y[i, 16 (b0 + v) + lane] for MR rows of x and NR consecutive blocks from b0. xs: the rows'
   unit sums of x (kinds with mins), MR x units. */
ALWAYS void tile(const int kind, const int f16, const int g16, const int MR, const int NR,
                 const vs_weight *w, int64_t b0, const float *x, int64_t ldx, const float *xs,
                 float *y, int64_t ldy) {
    const int64_t units = w->cols / 32;
    const int has_min = kind == VS_Q4 || kind == VS_Q5;
    __m512 acc[4][8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *pv[8];
        const uint16_t *hv[8];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            pv[v] = payload(kind, w, b0 + v, u);
            hv[v] = kind == VS_Q5 ? w->high + ((b0 + v) * units + u) * 32 : NULL;
        }
        __m512 p[4][8];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) p[i][v] = _mm512_setzero_ps();
        const float *xu = x + u * 32;
#pragma GCC unroll 2
        for (int t = 0; t < 16; t++) {
            __m512 w0[8], w1[8];
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) codes_pair(kind, pv[v], hv[v], t, &w0[v], &w1[v]);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const __m512 x0 = _mm512_set1_ps(xu[i * ldx + 2 * t]);
                const __m512 x1 = _mm512_set1_ps(xu[i * ldx + 2 * t + 1]);
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) {
                    p[i][v] = _mm512_fmadd_ps(x0, w0[v], p[i][v]);
                    p[i][v] = _mm512_fmadd_ps(x1, w1[v], p[i][v]);
                }
            }
            if (g16 && t == 7) { /* the first 16 inputs are a group of their own */
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) {
                    const __m512 sv = vec_at(w->scale, f16, 2 * ((b0 + v) * units + u));
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        acc[i][v] = _mm512_fmadd_ps(p[i][v], sv, acc[i][v]);
                        p[i][v] = _mm512_setzero_ps();
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            const int64_t g = (b0 + v) * units + u;
            if (kind == VS_F32 || kind == VS_BF16) {
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) acc[i][v] = _mm512_add_ps(acc[i][v], p[i][v]);
                continue;
            }
            const __m512 sv = vec_at(w->scale, f16, g16 ? 2 * g + 1 : g);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) acc[i][v] = _mm512_fmadd_ps(p[i][v], sv, acc[i][v]);
            if (has_min) {
                const __m512 mv = vec_at(w->min, f16, g);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++)
                    acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * units + u]), mv, acc[i][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) {
        const int64_t n0 = (b0 + v) * RB;
        const __mmask16 k = tail_mask(w->rows - n0);
        const __m512 bias = w->bias ? _mm512_maskz_loadu_ps(k, w->bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            _mm512_mask_storeu_ps(y + i * ldy + n0, k, w->bias ? _mm512_add_ps(acc[i][v], bias) : acc[i][v]);
    }
}

/* Blocks [b0, b1) for all M rows. */
ALWAYS void blocks_rows(const int kind, const int f16, const int g16, const vs_weight *w, int64_t b0,
                        int64_t b1, const float *x, int64_t M, int64_t ldx, const float *xs, float *y,
                        int64_t ldy) {
    const int64_t units = w->cols / 32;
    int64_t m = 0;
#define TILES(MR, NR)                                                                                \
    {                                                                                                \
        int64_t b = b0;                                                                              \
        for (; b + NR <= b1; b += NR)                                                                \
            tile(kind, f16, g16, MR, NR, w, b, x + m * ldx, ldx, xs + m * units, y + m * ldy, ldy); \
        for (; b < b1; b++) tile(kind, f16, g16, MR, 1, w, b, x + m * ldx, ldx, xs + m * units, y + m * ldy, ldy); \
    }
    for (; m + 4 <= M; m += 4) TILES(4, 4)
    switch (M - m) {
    case 3: TILES(3, 4) break;
    case 2: TILES(2, 4) break;
    case 1: TILES(1, 4) break;
    default: break;
    }
#undef TILES
}

/* ---- products with 8-bit activations

   A row's inputs are quantized per 32-input unit: d = max|x| / 127, q = round(x / d), kept
   with d and d * sum(q). Output n then adds, unit by unit, fma(isum, scale * d, acc) with
   isum = sum of q_k * code_k in exact integers (VNNI: four products a lane per instruction),
   then fma(d * sum(q), min, acc). Signed 8-bit codes meet unsigned activations (q + 128):
   isum = that product minus 128 * sum(code). The unit order is fixed, so again a row's bits do
   not depend on the call. */
#if defined(__AVX512VNNI__)
#define VS_HAS_VNNI 1

typedef struct {
    int8_t *q;      /* M x K */
    float *d;       /* M x units */
    float *dsum;    /* M x units: d * sum(q) */
} quant_rows;

static quant_rows quantize_rows(const float *x, int64_t M, int64_t ldx, int64_t K) {
    static __thread int8_t *qbuf = NULL;
    static __thread float *fbuf = NULL;
    static __thread int64_t cap = 0;
    const int64_t units = K / 32;
    if (cap < M * K) {
        free(qbuf);
        free(fbuf);
        qbuf = malloc((size_t)M * K);
        fbuf = malloc((size_t)2 * M * units * sizeof(float));
        cap = M * K;
    }
    quant_rows r = {qbuf, fbuf, fbuf + M * units};
    for (int64_t i = 0; i < M; i++)
        for (int64_t u = 0; u < units; u++) {
            const float *xu = x + i * ldx + u * 32;
            const __m512 a = _mm512_loadu_ps(xu), b = _mm512_loadu_ps(xu + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(r.q + i * K + u * 32), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(r.q + i * K + u * 32 + 16), _mm512_cvtsepi32_epi8(qb));
            r.d[i * units + u] = d;
            r.dsum[i * units + u] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
    return r;
}

ALWAYS int64_t unit_bytes_i8(const int kind) { return kind == VS_Q8I ? 512 : 256; }

/* The codes of inputs 4t .. 4t + 3 for 16 rows: one 32-bit lane per row, a byte per input. */
ALWAYS __m512i codes_quad(const int kind, const uint8_t *p, const uint64_t *high, int t) {
    if (kind == VS_Q8I) return _mm512_loadu_si512(p + t * 64);
    /* q4/q5: two bytes a row: inputs (4t, 4t + 2) in the first's nibbles, (4t + 1, 4t + 3) in
       the second's */
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + t * 32)));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F0F));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi32(0x0F0F));
    __m512i c = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    if (kind == VS_Q5I) c = _mm512_mask_add_epi8(c, (__mmask64)high[t], c, _mm512_set1_epi8(16));
    return c;
}

ALWAYS void tile_i8(const int kind, const int f16, const int g16, const int MR, const int NR,
                    const vs_weight *w, int64_t b0, quant_rows xr, int64_t m0, float *y, int64_t ldy) {
    const int64_t units = w->cols / 32, K = w->cols;
    const int has_min = kind != VS_Q8I;
    __m512 acc[4][8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) acc[i][v] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *pv[8];
        const uint64_t *hv[8];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            pv[v] = (const uint8_t *)w->data + ((b0 + v) * units + u) * unit_bytes_i8(kind);
            hv[v] = kind == VS_Q5I ? (const uint64_t *)w->high + ((b0 + v) * units + u) * 8 : NULL;
        }
        __m512i isum[4][8], csum[8];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            csum[v] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) isum[i][v] = _mm512_setzero_si512();
        }
        const int8_t *xq = xr.q + m0 * K + u * 32;
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m512i c[8];
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) {
                c[v] = codes_quad(kind, pv[v], hv[v], t);
                if (kind == VS_Q8I) csum[v] = _mm512_dpbusd_epi32(csum[v], ones, c[v]);
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                int32_t quad;
                memcpy(&quad, xq + i * K + 4 * t, 4);
                __m512i xv = _mm512_set1_epi32(quad);
                if (kind == VS_Q8I) xv = _mm512_xor_si512(xv, _mm512_set1_epi8((char)0x80)); /* q + 128 */
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++)
                    isum[i][v] = kind == VS_Q8I ? _mm512_dpbusd_epi32(isum[i][v], xv, c[v])
                                                : _mm512_dpbusd_epi32(isum[i][v], c[v], xv);
            }
            if (g16 && t == 3) { /* the first 16 inputs are a group of their own */
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) {
                    const __m512 sv = vec_at(w->scale, f16, 2 * ((b0 + v) * units + u));
                    const __m512i fix = _mm512_slli_epi32(csum[v], 7);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const __m512 sd = _mm512_mul_ps(sv, _mm512_set1_ps(xr.d[(m0 + i) * units + u]));
                        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][v], fix)), sd, acc[i][v]);
                        isum[i][v] = _mm512_setzero_si512();
                    }
                    csum[v] = _mm512_setzero_si512();
                }
            }
        }
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            const int64_t g = (b0 + v) * units + u;
            const __m512 sv = vec_at(w->scale, f16, g16 ? 2 * g + 1 : g);
            const __m512i fix = _mm512_slli_epi32(csum[v], 7);
            const __m512 mv = has_min ? vec_at(w->min, f16, g) : _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const __m512i exact = kind == VS_Q8I ? _mm512_sub_epi32(isum[i][v], fix) : isum[i][v];
                const __m512 sd = _mm512_mul_ps(sv, _mm512_set1_ps(xr.d[(m0 + i) * units + u]));
                acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), sd, acc[i][v]);
                if (has_min) acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(xr.dsum[(m0 + i) * units + u]), mv, acc[i][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) {
        const int64_t n0 = (b0 + v) * RB;
        const __mmask16 k = tail_mask(w->rows - n0);
        const __m512 bias = w->bias ? _mm512_maskz_loadu_ps(k, w->bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            _mm512_mask_storeu_ps(y + (m0 + i) * ldy + n0, k, w->bias ? _mm512_add_ps(acc[i][v], bias) : acc[i][v]);
    }
}

ALWAYS void blocks_rows_i8(const int kind, const int f16, const int g16, const vs_weight *w, int64_t b0,
                           int64_t b1, quant_rows xr, int64_t M, float *y, int64_t ldy) {
    int64_t m = 0;
#define TILES_I8(MR, NR)                                                                     \
    {                                                                                        \
        int64_t b = b0;                                                                      \
        for (; b + NR <= b1; b += NR) tile_i8(kind, f16, g16, MR, NR, w, b, xr, m, y, ldy); \
        for (; b < b1; b++) tile_i8(kind, f16, g16, MR, 1, w, b, xr, m, y, ldy);             \
    }
    for (; m + 4 <= M; m += 4) TILES_I8(4, 4)
    switch (M - m) {
    case 3: TILES_I8(3, 4) break;
    case 2: TILES_I8(2, 4) break;
    case 1: TILES_I8(1, 4) break;
    default: break;
    }
#undef TILES_I8
}

typedef void (*blocks_i8_fn)(const vs_weight *, int64_t, int64_t, quant_rows, int64_t, float *, int64_t);
#define BLOCKS_I8_FN(name, kind, f16, g16)                                                            \
    static void name(const vs_weight *w, int64_t b0, int64_t b1, quant_rows xr, int64_t M, float *y, \
                     int64_t ldy) { blocks_rows_i8(kind, f16, g16, w, b0, b1, xr, M, y, ldy); }
BLOCKS_I8_FN(blocks_q4i_h, VS_Q4I, 1, 0)
BLOCKS_I8_FN(blocks_q4i_f, VS_Q4I, 0, 0)
BLOCKS_I8_FN(blocks_q5i_h, VS_Q5I, 1, 0)
BLOCKS_I8_FN(blocks_q5i_f, VS_Q5I, 0, 0)
BLOCKS_I8_FN(blocks_q8i_h, VS_Q8I, 1, 0)
BLOCKS_I8_FN(blocks_q8i_f, VS_Q8I, 0, 0)
BLOCKS_I8_FN(blocks_q8i_g16, VS_Q8I, 0, 1)

static blocks_i8_fn blocks_i8_for(const vs_weight *w) {
    switch (w->kind) {
    case VS_Q4I: return w->scale_f16 ? blocks_q4i_h : blocks_q4i_f;
    case VS_Q5I: return w->scale_f16 ? blocks_q5i_h : blocks_q5i_f;
    default: return w->group == 16 ? blocks_q8i_g16 : w->scale_f16 ? blocks_q8i_h : blocks_q8i_f;
    }
}
#else
#define VS_HAS_VNNI 0
#endif

ALWAYS int is_i8(const vs_weight *w) { return w->kind >= VS_Q4I; }

typedef void (*blocks_fn)(const vs_weight *, int64_t, int64_t, const float *, int64_t, int64_t,
                          const float *, float *, int64_t);

#define BLOCKS_FN(name, kind, f16, g16)                                                                    \
    static void name(const vs_weight *w, int64_t b0, int64_t b1, const float *x, int64_t M, int64_t ldx, \
                     const float *xs, float *y, int64_t ldy) {                                           \
        blocks_rows(kind, f16, g16, w, b0, b1, x, M, ldx, xs, y, ldy);                                     \
    }
BLOCKS_FN(blocks_f32, VS_F32, 0, 0)
BLOCKS_FN(blocks_bf16, VS_BF16, 0, 0)
BLOCKS_FN(blocks_q4_h, VS_Q4, 1, 0)
BLOCKS_FN(blocks_q4_f, VS_Q4, 0, 0)
BLOCKS_FN(blocks_q5_h, VS_Q5, 1, 0)
BLOCKS_FN(blocks_q5_f, VS_Q5, 0, 0)
BLOCKS_FN(blocks_q8_h, VS_Q8, 1, 0)
BLOCKS_FN(blocks_q8_f, VS_Q8, 0, 0)
BLOCKS_FN(blocks_q8_g16, VS_Q8, 0, 1)

static blocks_fn blocks_for(const vs_weight *w) {
    switch (w->kind) {
    case VS_F32: return blocks_f32;
    case VS_BF16: return blocks_bf16;
    case VS_Q4: return w->scale_f16 ? blocks_q4_h : blocks_q4_f;
    case VS_Q5: return w->scale_f16 ? blocks_q5_h : blocks_q5_f;
    default: return w->group == 16 ? blocks_q8_g16 : w->scale_f16 ? blocks_q8_h : blocks_q8_f;
    }
}

int vs_has_vnni(void) { return VS_HAS_VNNI; }

/* A thread's buffer for the rows' unit sums of x (M x units). */
static float *sums_buffer(int64_t n) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (cap < n) {
        free(buf);
        buf = malloc((size_t)n * sizeof(float));
        cap = n;
    }
    return buf;
}

/* Each row's sum of x over every 32-input unit, in input order (the mins' term). */
static const float *unit_sums(const vs_weight *w, const float *x, int64_t M, int64_t ldx) {
    if (w->kind != VS_Q4 && w->kind != VS_Q5) return NULL;
    const int64_t units = w->cols / 32;
    float *xs = sums_buffer(M * units);
    for (int64_t i = 0; i < M; i++)
        for (int64_t u = 0; u < units; u++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += x[i * ldx + u * 32 + k];
            xs[i * units + u] = s;
        }
    return xs;
}

#define CHUNK 4 /* blocks per work item */

/* ys[i] = x ws[i]^T (+ bias) for `count` weights of the same input width, in one work-sharing
   loop over all their blocks (q, k and v; gate and up: one barrier, not `count`). Call inside
   a parallel region. */
static void linear_rows_multi(const vs_weight *const *ws, float *const *ys, int count, const float *x,
                              int64_t M, int64_t ldx) {
    int64_t total = 0;
    const float *xs = NULL; /* the same for every weight: they share x */
#if VS_HAS_VNNI
    quant_rows xr = {NULL, NULL, NULL};
#endif
    for (int i = 0; i < count; i++) total += ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < total; item++) {
        int64_t c = item;
        int i = 0;
        while (c >= ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK)
            c -= ((ws[i]->rows + RB - 1) / RB + CHUNK - 1) / CHUNK, i++;
        const int64_t blocks = (ws[i]->rows + RB - 1) / RB;
        const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
#if VS_HAS_VNNI
        if (is_i8(ws[i])) {
            if (xr.q == NULL) xr = quantize_rows(x, M, ldx, ws[i]->cols);
            blocks_i8_for(ws[i])(ws[i], b0, b1, xr, M, ys[i], ws[i]->rows);
            continue;
        }
#endif
        if (xs == NULL) xs = unit_sums(ws[i], x, M, ldx);
        blocks_for(ws[i])(ws[i], b0, b1, x, M, ldx, xs, ys[i], ws[i]->rows);
    }
}

static void linear_rows(const vs_weight *w, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy) {
    const int64_t blocks = (w->rows + RB - 1) / RB;
#if VS_HAS_VNNI
    if (is_i8(w)) {
        quant_rows xr = {NULL, NULL, NULL};
        const blocks_i8_fn fn = blocks_i8_for(w);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < (blocks + CHUNK - 1) / CHUNK; c++) {
            if (xr.q == NULL) xr = quantize_rows(x, M, ldx, w->cols);
            const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
            fn(w, b0, b1, xr, M, y, ldy);
        }
        return;
    }
#endif
    const float *xs = NULL;
    const blocks_fn fn = blocks_for(w);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (blocks + CHUNK - 1) / CHUNK; c++) {
        if (xs == NULL) xs = unit_sums(w, x, M, ldx);
        const int64_t b0 = c * CHUNK, b1 = b0 + CHUNK < blocks ? b0 + CHUNK : blocks;
        fn(w, b0, b1, x, M, ldx, xs, y, ldy);
    }
}

/* Rows [r0, r1) of w as float32 weights: code * scale (+ min), one rounding, exactly as gguf-py
   dequantizes them (tests, the embedding and float copies). */
void vs_dequant_rows(const vs_weight *w, int64_t r0, int64_t r1, float *out) {
    const int64_t K = w->cols, units = K / 32;
    const int f16 = w->scale_f16;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / RB, lane = r % RB;
        for (int64_t u = 0; u < units; u++) {
            const int64_t g = b * units + u;
            const uint8_t *p = (const uint8_t *)w->data + g * (w->kind >= VS_Q4I ? (w->kind == VS_Q8I ? 512 : 256)
                                                                                    : unit_bytes(w->kind));
            for (int k = 0; k < 32; k++) {
                float c, value;
                switch (w->kind) {
                case VS_F32: c = ((const float *)p)[k * 16 + lane]; break;
                case VS_BF16: {
                    const uint32_t bits = (uint32_t)((const uint16_t *)p)[k * 16 + lane] << 16;
                    memcpy(&c, &bits, 4);
                    break;
                }
                case VS_Q8: c = (float)((const int8_t *)p)[k * 16 + lane]; break;
                case VS_Q8I: c = (float)((const int8_t *)p)[(k / 4) * 64 + lane * 4 + k % 4]; break;
                case VS_Q4I:
                case VS_Q5I: {
                    const int t = k / 4, j = k % 4;
                    const uint8_t byte = p[t * 32 + lane * 2 + (j & 1)];
                    int code = j >> 1 ? byte >> 4 : byte & 15;
                    if (w->kind == VS_Q5I && (((const uint64_t *)w->high)[g * 8 + t] >> (lane * 4 + j)) & 1) code |= 16;
                    c = (float)code;
                    break;
                }
                default: {
                    const uint8_t byte = p[(k / 2) * 16 + lane];
                    int code = k % 2 ? byte >> 4 : byte & 15;
                    if (w->kind == VS_Q5 && (w->high[g * 32 + k] >> lane) & 1) code |= 16;
                    c = (float)code;
                }
                }
                if (w->kind == VS_F32 || w->kind == VS_BF16) {
                    value = c;
                } else {
                    const int64_t si = w->group == 16 ? 2 * g + k / 16 : g;
                    const float scale = f16 ? _cvtsh_ss(((const uint16_t *)w->scale)[si * 16 + lane])
                                            : ((const float *)w->scale)[si * 16 + lane];
                    if (w->min) {
                        const float mn = f16 ? _cvtsh_ss(((const uint16_t *)w->min)[g * 16 + lane])
                                             : ((const float *)w->min)[g * 16 + lane];
                        value = fmaf(c, scale, mn);
                    } else {
                        value = c * scale;
                    }
                }
                out[(r - r0) * K + u * 32 + k] = value;
            }
        }
    }
}

void vs_linear(const vs_weight *w, const float *x, int64_t M, float *y) {
#pragma omp parallel
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
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) rmsnorm_row(hidden + i * dim, norm, work + i * dim, dim, eps);
        linear_rows(w, work, M, dim, logits, w->rows);
    }
}

/* ------------------------------------------------------------------ attention */

/* Visibility of row r: cache slots [0, prefix[r]) hold positions 0 .. prefix[r] - 1, then the
   slots extra[xoff[r] .. xoff[r+1]) hold the next positions, the row's own last. Logical index
   i is position i; a sliding window drops indices below pos - window + 1. */
static void attention(const vs_stack *s, const vs_layer *L, const float *keys, const float *values,
                      const float *q, int64_t n,
                      const int32_t *pos, const int32_t *prefix, const int32_t *xoff,
                      const int32_t *extra, float *out, float *scratch) {
    const int64_t H = s->n_heads, D = s->head_dim, hpg = s->n_heads / s->n_kv, T = s->max_len;
    const __m512 scale = _mm512_set1_ps(s->attn_scale);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * H; item++) {
        const int64_t r = item / H, h = item % H, g = h / hpg;
        float *sc = scratch + (int64_t)omp_get_thread_num() * (T + 64);
        const float *qv = q + item * D;
        const float *kt = keys + g * D * T;
        const float *vv = values + g * T * D;
        const int64_t pre = prefix[r], nx = xoff[r + 1] - xoff[r];
        const int32_t *xs = extra + xoff[r];
        int64_t first = 0;
        if (L->window > 0 && pos[r] - L->window + 1 > 0) first = pos[r] - L->window + 1;
        const int64_t count = pre + nx - first;
        /* Scores over the prefix: 16 keys a vector, each key one fma chain over d. */
        int64_t i = first;
        for (; i + 64 <= pre; i += 64) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d++) {
                const __m512 qd = _mm512_set1_ps(qv[d]);
                const float *kd = kt + d * T + i;
                a0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd), a0);
                a1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 16), a1);
                a2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 32), a2);
                a3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 48), a3);
            }
            float *o = sc + (i - first);
            _mm512_storeu_ps(o, _mm512_mul_ps(a0, scale));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(a1, scale));
            _mm512_storeu_ps(o + 32, _mm512_mul_ps(a2, scale));
            _mm512_storeu_ps(o + 48, _mm512_mul_ps(a3, scale));
        }
        for (; i < pre; i += 16) {
            const __mmask16 k = tail_mask(pre - i);
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d]), _mm512_maskz_loadu_ps(k, kt + d * T + i), a0);
            _mm512_mask_storeu_ps(sc + (i - first), k, _mm512_mul_ps(a0, scale));
        }
        /* The extra slots: the same chain, one key at a time. */
        for (int64_t e = first > pre ? first - pre : 0; e < nx; e++) {
            const float *kd = kt + xs[e];
            float a = 0.0f;
            for (int64_t d = 0; d < D; d++) a = fmaf(qv[d], kd[d * T], a);
            sc[pre + e - first] = a * s->attn_scale;
        }
        /* Softmax in position order. */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < count; j += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(count - j), sc + j));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < count; j += 16) {
            const __mmask16 k = tail_mask(count - j);
            const __m512 e = _mm512_maskz_mov_ps(k, vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), top)));
            _mm512_mask_storeu_ps(sc + j, k, e);
            total = _mm512_add_ps(total, e);
        }
        const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));
        /* Weighted values: one chain per output lane, keys in position order. */
        __m512 acc[16];
        const int64_t chunks = D / 16;
        for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const int64_t li = first + j;
            const int64_t slot = li < pre ? li : xs[li - pre];
            const __m512 p = _mm512_set1_ps(sc[j]);
            const float *v = vv + slot * D;
            for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
        float *o = out + item * D;
        for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(acc[c], sum));
    }
}

/* ------------------------------------------------------------------ decoder layers */

/* Rotate-half RoPE of one head (D floats) at position p, as x * cos + rotate_half(x) * sin. */
ALWAYS void rope_head(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + half + i);
        const __m512 ra = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(cos + i)),
                                        _mm512_mul_ps(b, _mm512_loadu_ps(sin + i)));
        const __m512 rb = _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(cos + half + i)),
                                        _mm512_mul_ps(a, _mm512_loadu_ps(sin + half + i)));
        _mm512_storeu_ps(x + i, ra);
        _mm512_storeu_ps(x + half + i, rb);
    }
}

/* Workspace floats one forward of n rows needs (besides the attention scratch). */
int64_t vs_stack_work(const vs_stack *s, int64_t n) {
    const int64_t qs = (int64_t)s->n_heads * s->head_dim, kvs = (int64_t)s->n_kv * s->head_dim;
    return n * (2 * (int64_t)s->dim + 2 * qs + 2 * kvs + 3 * (int64_t)s->hidden);
}

int64_t vs_attention_scratch(const vs_stack *s) {
    return (int64_t)omp_get_max_threads() * (s->max_len + 64);
}

ALWAYS void add_rows(float *x, const float *y, int64_t dim) {
    for (int64_t i = 0; i < dim; i += 16)
        _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
}

/* x (n x dim) through every layer, in place. The cache holds, per layer, keys (n_kv x head_dim x
   max_len: a key's dimensions are strided, so scores read 16 keys a vector) and values (n_kv x
   max_len x head_dim). The new rows' keys and values go to slots start .. start + n - 1.
   taps: layer indices whose outputs are copied to tapped (n x ntaps*dim, side by side). */
void vs_stack_forward(const vs_stack *s, float *x, int64_t n, const int32_t *pos, const int32_t *prefix,
                      const int32_t *xoff, const int32_t *extra, float *keys, float *values,
                      int64_t start, float *work, float *scratch, const int32_t *taps, int64_t ntaps,
                      float *tapped) {
    const int64_t dim = s->dim, H = s->n_heads, G = s->n_kv, D = s->head_dim, I = s->hidden;
    const int64_t qs = H * D, kvs = G * D, T = s->max_len;
    float *h = work;              /* n x dim: normed input of a sub-block */
    float *q = h + n * dim;       /* n x qs: queries, then the attention output */
    float *k = q + n * qs;        /* n x kvs */
    float *v = k + n * kvs;       /* n x kvs */
    float *att = v + n * kvs;     /* n x qs: rotated queries */
    float *gate = att + n * qs;   /* n x I */
    float *up = gate + n * I;     /* n x I */
    float *act = up + n * I;      /* n x I */
    float *o = act + n * I;       /* n x dim: a sub-block's output */
#pragma omp parallel
    for (int64_t l = 0; l < s->n_layers; l++) {
        const vs_layer *L = s->layers + l;
        float *lk = keys + l * G * D * T, *lv = values + l * G * T * D;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (L->attn_norm) rmsnorm_row(x + r * dim, L->attn_norm, h + r * dim, dim, s->eps);
            else memcpy(h + r * dim, x + r * dim, dim * sizeof(float));
        }
        {
            const vs_weight *ws[3] = {&L->wq, &L->wk, &L->wv};
            float *ys[3] = {q, k, v};
            linear_rows_multi(ws, ys, 3, h, n, dim);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            float *qr = q + r * qs, *kr = k + r * kvs, *vr = v + r * kvs;
            const float *cos = L->cos + (int64_t)pos[r] * D, *sin = L->sin + (int64_t)pos[r] * D;
            for (int64_t hh = 0; hh < H; hh++) {
                if (L->q_norm) rmsnorm_row(qr + hh * D, L->q_norm, qr + hh * D, D, s->eps);
                rope_head(qr + hh * D, cos, sin, D);
            }
            for (int64_t g = 0; g < G; g++) {
                if (L->k_norm) rmsnorm_row(kr + g * D, L->k_norm, kr + g * D, D, s->eps);
                rope_head(kr + g * D, cos, sin, D);
                float *kt = lk + g * D * T + start + r;
                for (int64_t d = 0; d < D; d++) kt[d * T] = kr[g * D + d];
                memcpy(lv + (g * T + start + r) * D, vr + g * D, D * sizeof(float));
            }
            memcpy(att + r * qs, qr, qs * sizeof(float));
        }
        attention(s, L, lk, lv, att, n, pos, prefix, xoff, extra, q, scratch);
        linear_rows(&L->wo, q, n, qs, o, dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            float *orow = o + r * dim, *xr = x + r * dim;
            if (L->post_attn_norm) rmsnorm_row(orow, L->post_attn_norm, orow, dim, s->eps);
            add_rows(xr, orow, dim);
            rmsnorm_row(xr, L->mlp_norm, h + r * dim, dim, s->eps);
        }
        {
            const vs_weight *ws[2] = {&L->w_gate, &L->w_up};
            float *ys[2] = {gate, up};
            linear_rows_multi(ws, ys, 2, h, n, dim);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *g = gate + r * I, *u = up + r * I;
            float *ar = act + r * I;
            for (int64_t i = 0; i < I; i += 16) {
                const __m512 gv = _mm512_loadu_ps(g + i);
                const __m512 a = s->act ? vgelu_tanh(gv) : vsilu(gv);
                _mm512_storeu_ps(ar + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
            }
        }
        linear_rows(&L->w_down, act, n, I, o, dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            float *orow = o + r * dim, *xr = x + r * dim;
            if (L->post_mlp_norm) rmsnorm_row(orow, L->post_mlp_norm, orow, dim, s->eps);
            add_rows(xr, orow, dim);
            for (int64_t t = 0; t < ntaps; t++)
                if (taps[t] == l) memcpy(tapped + (r * ntaps + t) * dim, xr, dim * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------ draft heads */

/* For each of M rows of x: the k largest entries of x w^T (ties: the lower index first) as ids
   and log-probabilities under the softmax over all of them. logits: M x rows scratch. */
void vs_linear_topk(const vs_weight *w, const float *x, int64_t M, int64_t k, float *logits,
                    int64_t *ids, float *logprobs) {
    const int64_t N = w->rows;
#pragma omp parallel
    {
        linear_rows(w, x, M, w->cols, logits, N);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            const float *row = logits + i * N;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < N; j += 16)
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(N - j), row + j));
            const float top = _mm512_reduce_max_ps(mx);
            __m512 total = _mm512_setzero_ps();
            for (int64_t j = 0; j < N; j += 16) {
                const __mmask16 m = tail_mask(N - j);
                total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), _mm512_set1_ps(top)))));
            }
            const float lse = top + logf(_mm512_reduce_add_ps(total));
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
}
