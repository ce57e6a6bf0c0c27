/* The native engine's weight layout as numbers of each type, and what a product reads of its
 * input rows (included by native_weights.c and native_kernels.c; native_weights.c draws the
 * layout). Every function here takes the type as a constant where speed matters, so each
 * kernel is its own type's copy with the numbers folded in. */

#ifndef VOCABSPEC_NATIVE_LAYOUT_H
#define VOCABSPEC_NATIVE_LAYOUT_H

enum {
    VS_F32 = 0, VS_BF16 = 1, VS_F16 = 2,
    VS_Q4_0 = 3, VS_Q4_1 = 4, VS_Q5_0 = 5, VS_Q5_1 = 6, VS_Q8_0 = 7,
    VS_Q2_K = 8, VS_Q3_K = 9, VS_Q4_K = 10, VS_Q5_K = 11, VS_Q6_K = 12,
    VS_IQ4_NL = 13, VS_IQ4_XS = 14, VS_TYPES = 15
};

ALWAYS int t_float(const int T) { return T <= VS_F16; }
ALWAYS int t_super(const int T) { return (T >= VS_Q2_K && T <= VS_Q6_K) || T == VS_IQ4_XS; }
ALWAYS int t_lo(const int T) { return T == VS_Q2_K || T == VS_Q3_K ? 2 : T == VS_Q8_0 ? 8 : 4; }
ALWAYS int t_hi(const int T) {
    return T == VS_Q5_0 || T == VS_Q5_1 || T == VS_Q5_K || T == VS_Q3_K ? 1 : T == VS_Q6_K ? 2 : 0;
}
ALWAYS int t_code_bytes(const int T) { return 64 * (t_lo(T) + t_hi(T)); }
ALWAYS int t_scale_bytes(const int T) {
    return T == VS_Q4_1 || T == VS_Q5_1 ? 64 : T == VS_IQ4_XS ? 16 : 32;
}
ALWAYS int t_head_bytes(const int T) {
    return T == VS_Q2_K || T == VS_Q4_K || T == VS_Q5_K ? 64 : t_super(T) ? 32 : 0;
}
ALWAYS int t_group(const int T) { return T == VS_Q2_K || T == VS_Q3_K || T == VS_Q6_K ? 16 : 32; }
ALWAYS int t_min(const int T) {
    return T == VS_Q4_1 || T == VS_Q5_1 || T == VS_Q2_K || T == VS_Q4_K || T == VS_Q5_K;
}
ALWAYS int t_off(const int T) {
    return T == VS_Q4_0 ? 8 : T == VS_Q5_0 ? 16 : T == VS_Q3_K ? 4 : T == VS_Q6_K ? 32
         : T == VS_Q8_0 || T == VS_IQ4_NL || T == VS_IQ4_XS ? 128 : 0;
}
ALWAYS int t_signed(const int T) { return T == VS_Q8_0 || T == VS_IQ4_NL || T == VS_IQ4_XS; }
ALWAYS int t_float_bytes(const int T) { return T == VS_F32 ? 4 : 2; }

/* Bytes of one block's stream (16 rows) of a weight of `cols` inputs. */
ALWAYS int64_t t_block_bytes(const int T, int64_t cols) {
    const int64_t units = cols / 32;
    if (t_float(T)) return units * 32 * 16 * t_float_bytes(T);
    return (t_super(T) ? cols / 256 * t_head_bytes(T) : 0) + units * (t_code_bytes(T) + t_scale_bytes(T));
}

/* Where unit u's record (codes, then scales) starts in a block; its superblock's header. */
ALWAYS const uint8_t *t_unit(const int T, const uint8_t *block, int64_t u) {
    const int64_t rec = t_code_bytes(T) + t_scale_bytes(T);
    if (!t_super(T)) return block + u * rec;
    return block + (u / 8) * (t_head_bytes(T) + 8 * rec) + t_head_bytes(T) + (u % 8) * rec;
}
ALWAYS const uint8_t *t_head(const int T, const uint8_t *block, int64_t u) {
    return block + (u / 8) * (t_head_bytes(T) + 8 * (t_code_bytes(T) + t_scale_bytes(T)));
}

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

ALWAYS float half_at(const uint8_t *p, int i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return _cvtsh_ss(h);
}

/* ---------------------------------------------------------------- what a product reads of x */

typedef struct {
    const float *x;       /* float activations: M x ldx */
    int64_t ldx;
    const float *xs;      /* per row and unit: sums of x over inputs 0-15, 16-31, 0-31 (types with mins) */
#if VS_HAS_INT8
    const int8_t *q;      /* 8-bit activations: M x K codes */
    const float *d;       /* M x units: the unit's d */
    const int32_t *qsum;  /* M x units x 2: sums of the codes over inputs 0-15, 16-31 */
    const float *dsum;    /* M x units x 3: d times those sums, and d times the unit's */
#endif
    int float_ready, int8_ready;
} acts;

/* A weight's blocks [b0, b1) for M rows of x (native_kernels.c: one function a type and
   activation kind, compiled in two halves side by side). */
typedef void (*blocks_fn)(const vs_weight *, int64_t, int64_t, const acts *, int64_t, float *, int64_t);
#define VS_BLOCK_FUNCTIONS(X) X(VS_F32) X(VS_BF16) X(VS_F16) X(VS_Q4_0) X(VS_Q4_1) X(VS_Q5_0) X(VS_Q5_1) \
    X(VS_Q8_0) X(VS_Q2_K) X(VS_Q3_K) X(VS_Q4_K) X(VS_Q5_K) X(VS_Q6_K) X(VS_IQ4_NL) X(VS_IQ4_XS)
#define VS_DECLARE_BLOCKS(T)                                                                          \
    void vs_blocks_f_##T(const vs_weight *, int64_t, int64_t, const acts *, int64_t, float *, int64_t); \
    void vs_blocks_a8_##T(const vs_weight *, int64_t, int64_t, const acts *, int64_t, float *, int64_t);
VS_BLOCK_FUNCTIONS(VS_DECLARE_BLOCKS)

/* Rows a matmul takes per pass over a weight's blocks. */
#define QTILE_M 4

#endif
