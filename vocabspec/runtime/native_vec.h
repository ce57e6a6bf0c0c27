/* The native engine's 16-lane vectors (`vf`: floats, `vi`: 32-bit integers or 64 bytes): one
 * AVX-512 register, or two AVX2 registers doing the same per-lane operations, with horizontal
 * sums in one order written out here (not left to a compiler's reduce builtins). Each lane sees
 * the same sequence of IEEE operations on either instruction set; integer dot products are exact
 * on both. Included by native.c. */

#ifndef VOCABSPEC_NATIVE_VEC_H
#define VOCABSPEC_NATIVE_VEC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#if defined(__FAST_MATH__) || __FINITE_MATH_ONLY__ || defined(__ASSOCIATIVE_MATH__)
#error "the vocabspec native engine must be built without fast-math: its reductions have one fixed order"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VS_AVX512 0
#else
#error "the vocabspec native engine needs AVX-512 (F, BW) or AVX2 with FMA and F16C"
#endif

/* Products with 8-bit activations need exact 8-bit dot products: AVX-512 VNNI, or AVX2's
   multiply-add pairs (AVX-VNNI where present). */
#if VS_AVX512 ? defined(__AVX512VNNI__) : 1
#define VS_HAS_INT8 1
#else
#define VS_HAS_INT8 0
#endif

#define ALWAYS static inline __attribute__((always_inline))



#if VS_AVX512
typedef __m512 vf;  /* 16 floats */
typedef __m512i vi; /* 16 int32 lanes (or 64 bytes) */

ALWAYS vf vf_zero(void) { return _mm512_setzero_ps(); }
ALWAYS vf vf_set1(float a) { return _mm512_set1_ps(a); }
ALWAYS vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
ALWAYS vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ALWAYS vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
ALWAYS vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
ALWAYS vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
ALWAYS vf vf_abs(vf a) { return _mm512_abs_ps(a); }
ALWAYS __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
/* The first `left` lanes of p (at most 16), the others `fill`; nothing past them is read. */
ALWAYS vf vf_load_part(const float *p, int64_t left, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), tail_mask(left), p);
}
ALWAYS void vf_store_part(float *p, vf v, int64_t left) { _mm512_mask_storeu_ps(p, tail_mask(left), v); }
ALWAYS vf vf_keep_part(vf v, int64_t left) { return _mm512_maskz_mov_ps(tail_mask(left), v); }
/* Lanes where x < lo set to 0. */
ALWAYS vf vf_zero_below(vf v, vf x, vf lo) { return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v); }
ALWAYS vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n for integral n in [-126, 128], one rounding. */
ALWAYS vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
ALWAYS vf vf_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS vf vf_of_int(vi a) { return _mm512_cvtepi32_ps(a); }
ALWAYS vf vf_of_bits(vi a) { return _mm512_castsi512_ps(a); }
ALWAYS vi vi_round(vf a) { return _mm512_cvtps_epi32(a); }
ALWAYS vi vi_zero(void) { return _mm512_setzero_si512(); }
ALWAYS vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
ALWAYS vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
ALWAYS vi vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS vi vi_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS vi vi_u16(const void *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ALWAYS vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
/* Byte j of a 16-byte table (repeated in each 128-bit lane) for each byte index in 0..15. */
ALWAYS vi vi_lookup16(vi table, vi index) { return _mm512_shuffle_epi8(table, index); }
ALWAYS vf vf_neg(vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int32_t)0x80000000))); }
ALWAYS vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
ALWAYS vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
ALWAYS vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
ALWAYS vi vi_srli(vi a, const int n) { return _mm512_srli_epi32(a, n); }
ALWAYS vi vi_slli(vi a, const int n) { return _mm512_slli_epi32(a, n); }
/* Lane j of a, or-ed with `value` where bit j of `bits` is set. */
ALWAYS vi vi_or_where(vi a, uint16_t bits, vi value) { return _mm512_mask_or_epi32(a, (__mmask16)bits, a, value); }
/* Byte j of a, plus 16 where bit j of `bits` is set. */
ALWAYS vi vi_add16_bytes_where(vi a, uint64_t bits) {
    return _mm512_mask_add_epi8(a, (__mmask64)bits, a, _mm512_set1_epi8(16));
}
/* 16 int32 lanes (each in [-128, 127]) to 16 bytes, saturating. */
ALWAYS void vi_store_i8(int8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(a)); }
#if VS_HAS_INT8
/* Per lane: acc + the four products of unsigned bytes u and signed bytes s. */
ALWAYS vi vi_dot_us(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* Per lane: acc + the four products of signed bytes a and b (|a| <= 127): with a + 128 as an
   unsigned byte, less 128 times b's sum, which the caller subtracts (`vi_dot_ss_offset`). */
#define VS_DOT_SS_OFFSET 1
ALWAYS vi vi_dot_ss(vi acc, vi a, vi b) {
    return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(a, _mm512_set1_epi8((char)0x80)), b);
}
#endif

#else /* AVX2: a vector is two registers, lanes 0-7 and 8-15 */
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;

ALWAYS vf vf_make(__m256 lo, __m256 hi) { vf r = {lo, hi}; return r; }
ALWAYS vi vi_make(__m256i lo, __m256i hi) { vi r = {lo, hi}; return r; }
ALWAYS vf vf_zero(void) { return vf_make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
ALWAYS vf vf_set1(float a) { return vf_make(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
ALWAYS vf vf_load(const float *p) { return vf_make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
ALWAYS void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#define VF_2(name, op) ALWAYS vf name(vf a, vf b) { return vf_make(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF_2(vf_add, _mm256_add_ps)
VF_2(vf_sub, _mm256_sub_ps)
VF_2(vf_mul, _mm256_mul_ps)
VF_2(vf_div, _mm256_div_ps)
VF_2(vf_max, _mm256_max_ps)
VF_2(vf_min, _mm256_min_ps)
#undef VF_2
ALWAYS vf vf_fma(vf a, vf b, vf c) { return vf_make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
ALWAYS vf vf_fnma(vf a, vf b, vf c) { return vf_make(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
ALWAYS vf vf_neg(vf a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return vf_make(_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign));
}
ALWAYS vf vf_abs(vf a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return vf_make(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
/* Lanes j < left all ones, as two 8-lane masks. */
ALWAYS __m256i lanes_below(int64_t left, int half) {
    const int64_t n = left - 8 * half;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n < 0 ? 0 : n > 8 ? 8 : (int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
ALWAYS vf vf_load_part(const float *p, int64_t left, float fill) {
    const __m256i m0 = lanes_below(left, 0), m1 = lanes_below(left, 1);
    const __m256 f = _mm256_set1_ps(fill);
    return vf_make(_mm256_blendv_ps(f, _mm256_maskload_ps(p, m0), _mm256_castsi256_ps(m0)),
                   _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, m1), _mm256_castsi256_ps(m1)));
}
ALWAYS void vf_store_part(float *p, vf v, int64_t left) {
    _mm256_maskstore_ps(p, lanes_below(left, 0), v.lo);
    _mm256_maskstore_ps(p + 8, lanes_below(left, 1), v.hi);
}
ALWAYS vf vf_keep_part(vf v, int64_t left) {
    return vf_make(_mm256_and_ps(v.lo, _mm256_castsi256_ps(lanes_below(left, 0))),
                   _mm256_and_ps(v.hi, _mm256_castsi256_ps(lanes_below(left, 1))));
}
ALWAYS vf vf_zero_below(vf v, vf x, vf lo) {
    return vf_make(_mm256_andnot_ps(_mm256_cmp_ps(x.lo, lo.lo, _CMP_LT_OQ), v.lo),
                   _mm256_andnot_ps(_mm256_cmp_ps(x.hi, lo.hi, _CMP_LT_OQ), v.hi));
}
ALWAYS vf vf_round(vf a) {
    return vf_make(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* p * 2^n for integral n in [-126, 128], one rounding, as AVX-512's scalef: n split in two
   halves that are each a normal power of two, the first product exact. */
ALWAYS __m256 pow2(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
ALWAYS __m256 scale2_8(__m256 p, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(b));
}
ALWAYS vf vf_scale2(vf p, vf n) { return vf_make(scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)); }
ALWAYS vf vf_half(const uint16_t *p) {
    return vf_make(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
ALWAYS vf vf_of_int(vi a) { return vf_make(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
ALWAYS vf vf_of_bits(vi a) { return vf_make(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
ALWAYS vi vi_round(vf a) { return vi_make(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); }
ALWAYS vi vi_zero(void) { return vi_make(_mm256_setzero_si256(), _mm256_setzero_si256()); }
ALWAYS vi vi_set1(int32_t a) { return vi_make(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
ALWAYS vi vi_load(const void *p) {
    return vi_make(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
ALWAYS vi vi_u8(const uint8_t *p) {
    return vi_make(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
ALWAYS vi vi_i8(const int8_t *p) {
    return vi_make(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
ALWAYS vi vi_u16(const void *p) {
    return vi_make(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p + 1)));
}
#define VI_2(name, op) ALWAYS vi name(vi a, vi b) { return vi_make(op(a.lo, b.lo), op(a.hi, b.hi)); }
VI_2(vi_and, _mm256_and_si256)
VI_2(vi_xor, _mm256_xor_si256)
VI_2(vi_lookup16, _mm256_shuffle_epi8)
VI_2(vi_or, _mm256_or_si256)
VI_2(vi_add, _mm256_add_epi32)
VI_2(vi_sub, _mm256_sub_epi32)
#undef VI_2
#define vi_srli(a, n) vi_make(_mm256_srli_epi32((a).lo, n), _mm256_srli_epi32((a).hi, n))
#define vi_slli(a, n) vi_make(_mm256_slli_epi32((a).lo, n), _mm256_slli_epi32((a).hi, n))
ALWAYS vi vi_or_where(vi a, uint16_t bits, vi value) {
    const __m256i b = _mm256_set1_epi32(bits);
    const __m256i l0 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i l1 = _mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768);
    const __m256i m0 = _mm256_cmpeq_epi32(_mm256_and_si256(b, l0), l0), m1 = _mm256_cmpeq_epi32(_mm256_and_si256(b, l1), l1);
    return vi_make(_mm256_or_si256(a.lo, _mm256_and_si256(m0, value.lo)), _mm256_or_si256(a.hi, _mm256_and_si256(m1, value.hi)));
}
/* 32 bits to a byte mask over 32 bytes: byte j all ones where bit j is set. */
ALWAYS __m256i byte_mask(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
ALWAYS vi vi_add16_bytes_where(vi a, uint64_t bits) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    return vi_make(_mm256_add_epi8(a.lo, _mm256_and_si256(byte_mask((uint32_t)bits), sixteen)),
                   _mm256_add_epi8(a.hi, _mm256_and_si256(byte_mask((uint32_t)(bits >> 32)), sixteen)));
}
ALWAYS void vi_store_i8(int8_t *p, vi a) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8); /* 16 int16 in order */
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
/* Per 32-bit lane: acc + the four products of unsigned bytes u and signed bytes s, for u <= 127
   (the codes here are at most 31, or |b| <= 128 below): the pairwise 16-bit sums never
   saturate, so the result is exact. */
ALWAYS __m256i dot_us8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
ALWAYS vi vi_dot_us(vi acc, vi u, vi s) { return vi_make(dot_us8(acc.lo, u.lo, s.lo), dot_us8(acc.hi, u.hi, s.hi)); }
/* Signed bytes a (|a| <= 127) and b: |b| times a with b's sign, exact. */
#define VS_DOT_SS_OFFSET 0
ALWAYS vi vi_dot_ss(vi acc, vi a, vi b) {
    return vi_make(dot_us8(acc.lo, _mm256_abs_epi8(b.lo), _mm256_sign_epi8(a.lo, b.lo)),
                   dot_us8(acc.hi, _mm256_abs_epi8(b.hi), _mm256_sign_epi8(a.hi, b.hi)));
}
#endif

/* Horizontal sum in one order on either instruction set: lanes 0-7 plus lanes 8-15, then the
   halves of that, then (0 + 2) + (1 + 3). */
ALWAYS float sum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 q = _mm_add_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 1, 1, 1))));
}
ALWAYS float max8(__m256 v) {
    const __m128 h = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 q = _mm_max_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 1, 1, 1))));
}
ALWAYS int32_t isum8(__m256i v) {
    const __m128i h = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 1, 1, 1))));
}
#if VS_AVX512
ALWAYS __m256 hi256(vf v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
ALWAYS float vf_sum(vf v) { return sum8(_mm256_add_ps(hi256(v), _mm512_castps512_ps256(v))); }
ALWAYS float vf_hmax(vf v) { return max8(_mm256_max_ps(hi256(v), _mm512_castps512_ps256(v))); }
ALWAYS int32_t vi_sum(vi v) { return isum8(_mm256_add_epi32(_mm512_extracti64x4_epi64(v, 1), _mm512_castsi512_si256(v))); }
#else
ALWAYS float vf_sum(vf v) { return sum8(_mm256_add_ps(v.hi, v.lo)); }
ALWAYS float vf_hmax(vf v) { return max8(_mm256_max_ps(v.hi, v.lo)); }
ALWAYS int32_t vi_sum(vi v) { return isum8(_mm256_add_epi32(v.hi, v.lo)); }
#endif

#endif
