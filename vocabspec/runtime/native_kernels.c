/* The native engine's matmul kernels: one body for every weight type and both activation kinds
 * (float, and 8-bit with exact integer dot products), tiled over rows of x and blocks of
 * weights (native_weights.c draws the layout, native.c's header the reduction order). A
 * translation unit of its own, compiled twice (VS_PART 0 and 1, half the types each) beside
 * native.c: the kernels are most of the engine's code, and two cores build them at once. */

#include "native_vec.h"
#include "native.h"
#include "native_layout.h"

#ifndef VS_PART
#error "native_kernels.c is compiled with -DVS_PART=0 or 1 (native.py builds it)"
#endif

/* ---------------------------------------------------------------- the kernels */

ALWAYS vi vi_mask(vi a, int32_t m) { return vi_and(a, vi_set1(m)); }

/* Bit t of each byte of h moved to bit `to` (every other bit cleared). */
ALWAYS vi bit_to(vi h, const int t, const int to) {
    const int32_t m = 0x01010101 << to;
    return to >= t ? vi_mask(vi_slli(h, to - t), m) : vi_mask(vi_srli(h, t - to), m);
}

/* Quad t's codes u of one block's unit record (hi: its high planes, loaded once a unit). */
ALWAYS vi quad_u(const int T, const uint8_t *rec, const int t, vi hi0, vi hi1, vi table) {
    vi u;
    if (t_lo(T) == 8) return vi_xor(vi_load(rec + 64 * t), vi_set1((int32_t)0x80808080));
    if (t_lo(T) == 4) {
        const vi v = vi_load(rec + 64 * (t & 3));
        u = vi_mask(t < 4 ? v : vi_srli(v, 4), 0x0F0F0F0F);
    } else {
        u = vi_mask(vi_srli(vi_load(rec + 64 * (t & 1)), 2 * (t >> 1)), 0x03030303);
    }
    if (T == VS_Q3_K) u = vi_or(u, bit_to(hi0, t, 2));
    else if (t_hi(T) == 1) u = vi_or(u, bit_to(hi0, t, 4));
    else if (t_hi(T) == 2) {
        const vi h = (t & 1) ? hi1 : hi0;
        const int s = 2 * (t >> 1);
        u = vi_or(u, vi_mask(s <= 4 ? vi_slli(h, 4 - s) : vi_srli(h, s - 4), 0x30303030));
    }
    if (T == VS_IQ4_NL || T == VS_IQ4_XS) u = vi_lookup16(table, u);
    return u;
}

/* The 16 lanes' scale (and min) of group g of a unit record; d, dmin: its header's. */
ALWAYS void group_scale(const int T, const uint8_t *rec, const int g, vf d, vf dmin, vf *scale, vf *minimum) {
    const uint8_t *s = rec + t_code_bytes(T);
    switch (T) {
    case VS_Q4_0: case VS_Q5_0: case VS_Q8_0: case VS_IQ4_NL: *scale = vf_half((const uint16_t *)s); break;
    case VS_Q4_1: case VS_Q5_1: *scale = vf_half((const uint16_t *)s), *minimum = vf_half((const uint16_t *)(s + 32)); break;
    case VS_Q2_K: {
        const vi b = vi_u8(s + 16 * g);
        *scale = vf_mul(d, vf_of_int(vi_mask(b, 15)));
        *minimum = vf_neg(vf_mul(dmin, vf_of_int(vi_srli(b, 4))));
        break;
    }
    case VS_Q3_K: case VS_Q6_K: *scale = vf_mul(d, vf_of_int(vi_i8((const int8_t *)s + 16 * g))); break;
    case VS_Q4_K: case VS_Q5_K:
        *scale = vf_mul(d, vf_of_int(vi_u8(s)));
        *minimum = vf_neg(vf_mul(dmin, vf_of_int(vi_u8(s + 16))));
        break;
    case VS_IQ4_XS: *scale = vf_mul(d, vf_of_int(vi_i8((const int8_t *)s))); break;
    default: break;
    }
}

/* An 8-bit tile of several rows reads its blocks' records once and in order, and computes long
   enough on each that the hardware's prefetcher falls behind: every record waits on memory.
   Asking for the lines VS_PF bytes ahead (into L2) keeps the stream moving: on Zen 4, SmolLM2's
   and Gemma's 2- to 8-row forwards took 11-22% less time. A lone row streams at the
   prefetcher's pace, and asking there too slowed a 1B model's token by a third; float tiles ran
   slower with it as well. A prefetch never faults, past a weight's end included, and changes
   no bit. VS_PF=0: none. */
#ifndef VS_PF
#define VS_PF 16384
#endif
ALWAYS void prefetch_ahead(const uint8_t *p, const int64_t bytes) {
#pragma GCC unroll 4
    for (int64_t at = 0; VS_PF > 0 && at < bytes; at += 64) __builtin_prefetch(p + VS_PF + at, 0, 2);
}

ALWAYS vi iq4_table(void) {
    int8_t t[64];
    for (int i = 0; i < 64; i++) t[i] = (int8_t)(kvalues_iq4nl[i % 16] + 128);
    return vi_load(t);
}

/* Tiles: MR rows of x by NR blocks of weights, MR * NR chains at a time: four rows by one block,
   three or two by two, or one row by four blocks (AVX2, with half the registers: one block).
   The tiling changes no lane's operations. */
#if VS_AVX512
#define QTILE_N 4
/* A lone row (decoding) takes VS_NR_ONE blocks a tile, four rows VS_NR_FOUR: four each on
   Intel's cores, one and two on AMD's (Zen 4 runs a 512-bit op as two halves; there more
   chains in flight measured slower). native.py sets them from the CPU's vendor;
   VOCABSPEC_NATIVE_DEFINES may try others. */
#ifndef VS_NR_ONE
#define VS_NR_ONE 1
#endif
#ifndef VS_NR_FOUR
#define VS_NR_FOUR 2
#endif
#define NR_OF(MR) ((MR) >= 3 ? VS_NR_FOUR : (MR) == 2 ? 2 : VS_NR_ONE)
#else
#define QTILE_N 1
#define NR_OF(MR) 1
#endif

/* y[i, 16 (b0 + v) + lane] for MR rows (from m0) and NR blocks (from b0) of a quantized weight,
   float activations. */
ALWAYS void qtile_f(const int T, const int MR, const int NR, const vs_weight *w, int64_t b0, const acts *a,
                    int64_t m0, float *y, int64_t ldy) {
    const int64_t units = w->cols / 32, bb = t_block_bytes(T, w->cols);
    const vi table = (T == VS_IQ4_NL || T == VS_IQ4_XS) ? iq4_table() : vi_zero();
    const vf off = vf_set1((float)t_off(T));
    vf acc[QTILE_M][QTILE_N], d[QTILE_N], dmin[QTILE_N];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) acc[i][v] = vf_zero();
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) d[v] = dmin[v] = vf_zero();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *rec[QTILE_N];
        vi hi0[QTILE_N], hi1[QTILE_N];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            const uint8_t *block = w->data + (b0 + v) * bb;
            rec[v] = t_unit(T, block, u);
            if (t_super(T) && u % 8 == 0) {
                const uint8_t *h = t_head(T, block, u);
                d[v] = vf_half((const uint16_t *)h);
                if (t_head_bytes(T) == 64) dmin[v] = vf_half((const uint16_t *)(h + 32));
            }
            hi0[v] = t_hi(T) ? vi_load(rec[v] + 64 * t_lo(T)) : vi_zero();
            hi1[v] = t_hi(T) == 2 ? vi_load(rec[v] + 64 * t_lo(T) + 64) : vi_zero();
        }
        const float *xu = a->x + m0 * a->ldx + u * 32;
#pragma GCC unroll 2
        for (int g = 0; g < 32 / t_group(T); g++) {
            vf p[QTILE_M][QTILE_N];
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) p[i][v] = vf_zero();
#pragma GCC unroll 8
            for (int t = g * t_group(T) / 4; t < (g + 1) * t_group(T) / 4; t++) {
                vi c[QTILE_N];
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) c[v] = quad_u(T, rec[v], t, hi0[v], hi1[v], table);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    vf wj[QTILE_N];
#pragma GCC unroll 8
                    for (int v = 0; v < NR; v++) wj[v] = vf_sub(vf_of_int(vi_mask(vi_srli(c[v], 8 * j), 0xFF)), off);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const vf xv = vf_set1(xu[i * a->ldx + 4 * t + j]);
#pragma GCC unroll 8
                        for (int v = 0; v < NR; v++) p[i][v] = vf_fma(xv, wj[v], p[i][v]);
                    }
                }
            }
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) {
                vf s, mn = vf_zero();
                group_scale(T, rec[v], g, d[v], dmin[v], &s, &mn);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    acc[i][v] = vf_fma(p[i][v], s, acc[i][v]);
                    if (t_min(T)) {
                        const float *xs = a->xs + ((m0 + i) * units + u) * 3;
                        acc[i][v] = vf_fma(vf_set1(t_group(T) == 16 ? xs[g] : xs[2]), mn, acc[i][v]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) {
        const int64_t n0 = (b0 + v) * 16, left = w->rows - n0;
        const vf bias = w->bias ? vf_load_part(w->bias + n0, left, 0.0f) : vf_zero();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            vf_store_part(y + (m0 + i) * ldy + n0, w->bias ? vf_add(acc[i][v], bias) : acc[i][v], left);
    }
}

#if VS_HAS_INT8
#if VS_AVX512
/* acc + the four products of u's bytes with the 4 bytes at x (signed), in every lane: the
   broadcast folded into the dot product's memory operand (GCC emits a broadcast of its own
   for each, an instruction per product at four rows to a block). */
ALWAYS vi dot_broadcast(vi acc, vi u, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)x));
    return acc;
}
#endif

/* Exact integer sums of one group (quads t0 .. t1) for MR rows and NR blocks: isum[i][v] lane r
   = sum over the group of u_k * q_k (signed types on AVX2: of the signed codes, off 0). */
ALWAYS void group_isums(const int T, const int MR, const int NR, const uint8_t *const *rec, const vi *hi0,
                        const vi *hi1, vi table, const int8_t *xq, int64_t K, const int t0, const int t1,
                        vi isum[QTILE_M][QTILE_N]) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) isum[i][v] = vi_zero();
#if VS_AVX512
#pragma GCC unroll 8
    for (int t = t0; t < t1; t++) {
        vi c[QTILE_N];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) c[v] = quad_u(T, rec[v], t, hi0[v], hi1[v], table);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) isum[i][v] = dot_broadcast(isum[i][v], c[v], xq + i * K + 4 * t);
    }
#else
    /* maddubs: u (at most 63 unsigned) times q, pairs summed in 16 bits: up to `per` quads add
       up there before they are widened, within 32767 (signed codes: their magnitude, one quad). */
    const int umax = t_signed(T) ? 128 : (1 << (t_lo(T) + t_hi(T))) - 1;
    const int per = t_signed(T) ? 1 : 32767 / (2 * 127 * umax) >= 8 ? 8 : 32767 / (2 * 127 * umax);
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int s = t0; s < t1; s += per) {
        __m256i a16[QTILE_M][QTILE_N][2];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) a16[i][v][0] = a16[i][v][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = s; t < s + per && t < t1; t++) {
            vi c[QTILE_N];
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) {
                c[v] = quad_u(T, rec[v], t, hi0[v], hi1[v], table);
                if (t_signed(T)) c[v] = vi_xor(c[v], vi_set1((int32_t)0x80808080));   /* the signed codes */
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                int32_t quad;
                memcpy(&quad, xq + i * K + 4 * t, 4);
                const __m256i xv = _mm256_set1_epi32(quad);
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) {
                    if (t_signed(T)) {
                        a16[i][v][0] = _mm256_maddubs_epi16(_mm256_abs_epi8(c[v].lo), _mm256_sign_epi8(xv, c[v].lo));
                        a16[i][v][1] = _mm256_maddubs_epi16(_mm256_abs_epi8(c[v].hi), _mm256_sign_epi8(xv, c[v].hi));
                    } else {
                        a16[i][v][0] = _mm256_add_epi16(a16[i][v][0], _mm256_maddubs_epi16(c[v].lo, xv));
                        a16[i][v][1] = _mm256_add_epi16(a16[i][v][1], _mm256_maddubs_epi16(c[v].hi, xv));
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++)
                isum[i][v] = vi_add(isum[i][v], vi_make(_mm256_madd_epi16(a16[i][v][0], ones),
                                                        _mm256_madd_epi16(a16[i][v][1], ones)));
    }
#endif
}

/* As qtile_f with 8-bit activations. */
ALWAYS void qtile_a8(const int T, const int MR, const int NR, const vs_weight *w, int64_t b0, const acts *a,
                     int64_t m0, float *y, int64_t ldy) {
    const int64_t units = w->cols / 32, K = w->cols, bb = t_block_bytes(T, w->cols);
    const vi table = (T == VS_IQ4_NL || T == VS_IQ4_XS) ? iq4_table() : vi_zero();
    /* off: the codes' offset the integer sums carry (none where AVX2 sums signed codes) */
    const int off = !VS_AVX512 && t_signed(T) ? 0 : t_off(T);
    vf acc[QTILE_M][QTILE_N], d[QTILE_N], dmin[QTILE_N];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) acc[i][v] = vf_zero();
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) d[v] = dmin[v] = vf_zero();
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *rec[QTILE_N];
        vi hi0[QTILE_N], hi1[QTILE_N];
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) {
            const uint8_t *block = w->data + (b0 + v) * bb;
            rec[v] = t_unit(T, block, u);
            if (t_super(T) && u % 8 == 0) {
                const uint8_t *h = t_head(T, block, u);
                d[v] = vf_half((const uint16_t *)h);
                if (t_head_bytes(T) == 64) dmin[v] = vf_half((const uint16_t *)(h + 32));
            }
            hi0[v] = t_hi(T) ? vi_load(rec[v] + 64 * t_lo(T)) : vi_zero();
            hi1[v] = t_hi(T) == 2 ? vi_load(rec[v] + 64 * t_lo(T) + 64) : vi_zero();
            if (MR > 1) prefetch_ahead(rec[v], t_code_bytes(T) + t_scale_bytes(T));
        }
        const int8_t *xq = a->q + m0 * K + u * 32;
#pragma GCC unroll 2
        for (int g = 0; g < 32 / t_group(T); g++) {
            vi isum[QTILE_M][QTILE_N];
            group_isums(T, MR, NR, rec, hi0, hi1, table, xq, K, g * t_group(T) / 4, (g + 1) * t_group(T) / 4, isum);
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) {
                vf s, mn = vf_zero();
                group_scale(T, rec[v], g, d[v], dmin[v], &s, &mn);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    const int64_t at = (m0 + i) * units + u;
                    vi sum = isum[i][v];
                    if (off) {
                        const int32_t q = t_group(T) == 16 ? a->qsum[2 * at + g] : a->qsum[2 * at] + a->qsum[2 * at + 1];
                        sum = vi_sub(sum, vi_set1(off * q));
                    }
                    acc[i][v] = vf_fma(vf_of_int(sum), vf_mul(s, vf_set1(a->d[at])), acc[i][v]);
                    if (t_min(T)) acc[i][v] = vf_fma(vf_set1(a->dsum[3 * at + (t_group(T) == 16 ? g : 2)]), mn, acc[i][v]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) {
        const int64_t n0 = (b0 + v) * 16, left = w->rows - n0;
        const vf bias = w->bias ? vf_load_part(w->bias + n0, left, 0.0f) : vf_zero();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            vf_store_part(y + (m0 + i) * ldy + n0, w->bias ? vf_add(acc[i][v], bias) : acc[i][v], left);
    }
}
#endif

/* Float weights: per unit a chain over its 32 inputs (two lane sets of 16 weights' rows),
   added to acc once the unit is done. */
ALWAYS void ftile(const int T, const int MR, const int NR, const vs_weight *w, int64_t b0, const acts *a,
                  int64_t m0, float *y, int64_t ldy) {
    const int64_t units = w->cols / 32, bb = t_block_bytes(T, w->cols), e = t_float_bytes(T);
    vf acc[QTILE_M][QTILE_N];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NR; v++) acc[i][v] = vf_zero();
    for (int64_t u = 0; u < units; u++) {
        vf p[QTILE_M][QTILE_N];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) p[i][v] = vf_zero();
        const float *xu = a->x + m0 * a->ldx + u * 32;
#pragma GCC unroll 2
        for (int k = 0; k < 32; k++) {
            vf wk[QTILE_N];
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) {
                const uint8_t *at = w->data + (b0 + v) * bb + (u * 512 + k * 16) * e;
                wk[v] = T == VS_F32 ? vf_load((const float *)at)
                      : T == VS_F16 ? vf_half((const uint16_t *)at) : vf_of_bits(vi_slli(vi_u16(at), 16));
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const vf xv = vf_set1(xu[i * a->ldx + k]);
#pragma GCC unroll 8
                for (int v = 0; v < NR; v++) p[i][v] = vf_fma(xv, wk[v], p[i][v]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int v = 0; v < NR; v++) acc[i][v] = vf_add(acc[i][v], p[i][v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NR; v++) {
        const int64_t n0 = (b0 + v) * 16, left = w->rows - n0;
        const vf bias = w->bias ? vf_load_part(w->bias + n0, left, 0.0f) : vf_zero();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            vf_store_part(y + (m0 + i) * ldy + n0, w->bias ? vf_add(acc[i][v], bias) : acc[i][v], left);
    }
}

ALWAYS void any_tile(const int T, const int A8, const int MR, const int NR, const vs_weight *w, int64_t b0,
                     const acts *a, int64_t m0, float *y, int64_t ldy) {
    if (t_float(T)) ftile(T, MR, NR, w, b0, a, m0, y, ldy);
#if VS_HAS_INT8
    else if (A8) qtile_a8(T, MR, NR, w, b0, a, m0, y, ldy);
#endif
    else qtile_f(T, MR, NR, w, b0, a, m0, y, ldy);
}

/* Blocks [b0, b1) for all M rows: tiles of four rows, then one tile for the two or three left
   (a tile reads its weights once: as two tiles, a 3-row forward, a step's root and two drafts,
   cost more than a 4-row one), then one. VS_TAIL=0: three rows as two and one, and float
   activations' two or three rows one by one. */
#ifndef VS_TAIL
#define VS_TAIL 1
#endif
ALWAYS void blocks_rows(const int T, const int A8, const vs_weight *w, int64_t b0, int64_t b1, const acts *a,
                        int64_t M, float *y, int64_t ldy) {
    /* Float activations over quantized weights (the gguf format, not the default) take fewer
       tile shapes: a block at a time (less code to compile). */
    const int few = !A8 && !t_float(T);
    int64_t m = 0;
#define TILES(MR, NR)                                                                              \
    {                                                                                              \
        int64_t b = b0;                                                                            \
        if ((NR) > 1)                                                                              \
            for (; b + (NR) <= b1; b += (NR)) any_tile(T, A8, MR, NR, w, b, a, m, y, ldy);         \
        for (; b < b1; b++) any_tile(T, A8, MR, 1, w, b, a, m, y, ldy);                            \
    }
    if (few) {
        for (; m + 4 <= M; m += 4) TILES(4, 1)
        if (VS_TAIL && M - m == 3) {
            TILES(3, 1)
            m += 3;
        }
        if (VS_TAIL && M - m == 2) {
            TILES(2, 1)
            m += 2;
        }
        for (; m < M; m++) TILES(1, 1)
        return;
    }
    for (; m + 4 <= M; m += 4) TILES(4, NR_OF(4))
    if (VS_TAIL && M - m == 3) {
        TILES(3, NR_OF(3))
        m += 3;
    }
    if (M - m >= 2) {
        TILES(2, NR_OF(2))
        m += 2;
    }
    if (M - m == 1) TILES(1, NR_OF(1))
#undef TILES
}

/* This half's types (VS_PART 0 or 1): the two halves compile side by side. */
#define VS_BLOCKS(T)                                                                                       \
    void vs_blocks_f_##T(const vs_weight *w, int64_t b0, int64_t b1, const acts *a, int64_t M, float *y,  \
                         int64_t ldy) { blocks_rows(T, 0, w, b0, b1, a, M, y, ldy); }                      \
    void vs_blocks_a8_##T(const vs_weight *w, int64_t b0, int64_t b1, const acts *a, int64_t M, float *y, \
                          int64_t ldy) { blocks_rows(T, 1, w, b0, b1, a, M, y, ldy); }
#if VS_PART == 0
VS_BLOCKS(VS_F32) VS_BLOCKS(VS_BF16) VS_BLOCKS(VS_F16) VS_BLOCKS(VS_Q4_0) VS_BLOCKS(VS_Q4_1) VS_BLOCKS(VS_Q5_0)
VS_BLOCKS(VS_Q5_1) VS_BLOCKS(VS_Q8_0)
#else
VS_BLOCKS(VS_Q2_K) VS_BLOCKS(VS_Q3_K) VS_BLOCKS(VS_Q4_K) VS_BLOCKS(VS_Q5_K) VS_BLOCKS(VS_Q6_K) VS_BLOCKS(VS_IQ4_NL)
VS_BLOCKS(VS_IQ4_XS)
#endif
