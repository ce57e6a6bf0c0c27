/* Weights of the native engine: GGUF's types in a row-blocked layout, built straight from the
 * file's blocks, and the matmul over them (included by native.c, one compiled unit).
 *
 * A weight's rows come in blocks of 16, one per vector lane; a block is one stream of bytes,
 * read front to back by a product. For a quantized type the stream is, per 32-input unit (and,
 * for the 256-input superblock types, a header before every eight units):
 *
 *     [header: d[16] (and dmin[16]) as halves]  every 8 units (Q2_K..Q6_K, IQ4_XS)
 *     [codes: lo planes, then hi planes]        64 bytes a plane: 16 lanes x 4 bytes
 *     [scales: the unit's groups, 16 lanes each]
 *
 * A plane's 32-bit lane r holds row r's codes of four consecutive inputs (byte j: input 4t + j
 * of quad t), the layout the 4-way byte products (VNNI's dpbusd, AVX2's maddubs) read:
 *   - lo4 (4 planes): plane k holds quad k in the low nibbles, quad k + 4 in the high ones;
 *   - lo2 (2 planes): plane k holds quads k, k + 2, k + 4, k + 6 in bits 0-1, 2-3, 4-5, 6-7;
 *   - lo8 (8 planes): plane t holds quad t (Q8_0's signed codes as they are);
 *   - hi1 (1 plane): bit t of each byte is the high bit of quad t (bit 4 of a 5-bit code, bit 2
 *     of Q3_K's 3-bit one);
 *   - hi2 (2 planes): as lo2, the bits 4-5 of Q6_K's 6-bit codes.
 * So a quad's codes are one or two loads, shifts and masks away, and the scales keep the file's
 * sizes (halves, 4- or 6-bit fields as bytes): a packed weight is at most 4% larger than the
 * file's blocks (Q3_K's 6-bit scales as bytes: 3.6%; Q4_K's and Q5_K's: 2.8%).
 *
 * A unit's codes u are unsigned bytes; the weight of a code is (u - off) * scale (+ min): off
 * is 8 (Q4_0), 16 (Q5_0), 4 (Q3_K), 32 (Q6_K), 128 for the signed types (Q8_0's codes and the
 * IQ4 tables as u = value + 128) and 0 for the types with mins. Scales and mins are exact
 * products of the file's numbers (a half times a 4-, 6- or 8-bit integer), so every weight
 * dequantizes to the value gguf-py's `dequantize` gives (a single rounding where it rounds).
 *
 * Float weights (f32, bf16, f16) keep one unit per 32 inputs, input by input: 16 rows each.
 *
 * Products, one order per output element whatever the call (see native.c's header):
 *   - float activations: per group (16 or 32 inputs) a chain p = fma(x_k, u_k - off, p) over the
 *     inputs in ascending order, then acc = fma(p, scale, acc) and, with mins,
 *     acc = fma(sum of the group's x, min, acc);
 *   - 8-bit activations (x quantized per 32 inputs, d = max|x| / 127, as llama.cpp does): per
 *     group an exact integer sum of u_k * q_k (less off times the sum of q), then
 *     acc = fma(sum, scale * d, acc) and, with mins, acc = fma(d * sum of q, min, acc).
 * Integer sums are exact in any order, so the instruction set that summed them changes nothing.
 */


#include "native_layout.h"

int vs_type_count(void) { return VS_TYPES; }

/* Bytes of a packed weight of `type` (rows padded to blocks of 16); -1 for shapes it cannot
   take (columns not a multiple of its block's inputs). */
int64_t vs_packed_bytes(int32_t type, int64_t rows, int64_t cols) {
    if (type < 0 || type >= VS_TYPES || rows < 1 || cols < 32 || cols % (t_super(type) ? 256 : 32)) return -1;
    int64_t per = 0;
    switch (type) {
#define PER(T) case T: per = t_block_bytes(T, cols); break;
    PER(VS_F32) PER(VS_BF16) PER(VS_F16) PER(VS_Q4_0) PER(VS_Q4_1) PER(VS_Q5_0) PER(VS_Q5_1) PER(VS_Q8_0)
    PER(VS_Q2_K) PER(VS_Q3_K) PER(VS_Q4_K) PER(VS_Q5_K) PER(VS_Q6_K) PER(VS_IQ4_NL) PER(VS_IQ4_XS)
#undef PER
    }
    return (rows + 15) / 16 * per;
}

/* ---------------------------------------------------------------- one lane's numbers

   The scalar view of a block, lane by lane: what packing writes, a gather copies and
   dequantization reads. Every element of a block's stream belongs to one lane: a code plane's
   4 bytes, a scale array's byte or half. */

/* Lane-by-lane arrays of a unit's record after its codes: (count, bytes a lane). */
ALWAYS int t_scale_arrays(const int T, int *esize) {
    if (T == VS_Q4_0 || T == VS_Q5_0 || T == VS_Q8_0 || T == VS_IQ4_NL) return *esize = 2, 1;
    if (T == VS_Q4_1 || T == VS_Q5_1) return *esize = 2, 2;
    if (T == VS_IQ4_XS) return *esize = 1, 1;
    return *esize = 1, 2;     /* Q2_K, Q3_K, Q6_K: a byte per group of 16; Q4_K, Q5_K: sc, m */
}

/* Copy lane `from` of block src to lane `to` of block dst (whole stream). */
static void lane_copy(int T, int64_t cols, const uint8_t *src, int from, uint8_t *dst, int to) {
    if (t_float(T)) {
        const int e = t_float_bytes(T);
        for (int64_t k = 0; k < cols; k++) memcpy(dst + (k * 16 + to) * e, src + (k * 16 + from) * e, e);
        return;
    }
    const int64_t units = cols / 32;
    int esize;
    switch (T) {   /* constant layouts for each type */
#define COPY(TT)                                                                                     \
    case TT: {                                                                                       \
        const int arrays = t_scale_arrays(TT, &esize);                                               \
        for (int64_t u = 0; u < units; u++) {                                                        \
            if (t_super(TT) && u % 8 == 0) {                                                         \
                const uint8_t *hs = t_head(TT, src, u);                                              \
                uint8_t *hd = (uint8_t *)t_head(TT, dst, u);                                         \
                for (int a = 0; a < t_head_bytes(TT) / 32; a++)                                      \
                    memcpy(hd + a * 32 + 2 * to, hs + a * 32 + 2 * from, 2);                         \
            }                                                                                        \
            const uint8_t *rs = t_unit(TT, src, u);                                                  \
            uint8_t *rd = (uint8_t *)t_unit(TT, dst, u);                                             \
            for (int p = 0; p < t_code_bytes(TT) / 64; p++) memcpy(rd + p * 64 + 4 * to, rs + p * 64 + 4 * from, 4); \
            rs += t_code_bytes(TT), rd += t_code_bytes(TT);                                          \
            for (int a = 0; a < arrays; a++)                                                         \
                memcpy(rd + a * 16 * esize + to * esize, rs + a * 16 * esize + from * esize, esize); \
        }                                                                                            \
        break;                                                                                       \
    }
    COPY(VS_Q4_0) COPY(VS_Q4_1) COPY(VS_Q5_0) COPY(VS_Q5_1) COPY(VS_Q8_0) COPY(VS_Q2_K) COPY(VS_Q3_K)
    COPY(VS_Q4_K) COPY(VS_Q5_K) COPY(VS_Q6_K) COPY(VS_IQ4_NL) COPY(VS_IQ4_XS)
#undef COPY
    default: break;
    }
}

/* u of lane `lane`'s 32 inputs of a unit record (the planes read back, IQ4's indices as values
   + 128, Q8_0's codes + 128). */
ALWAYS void lane_codes(const int T, const uint8_t *rec, int lane, uint8_t *u) {
    const uint8_t *lo = rec, *hi = rec + 64 * t_lo(T);
    for (int k = 0; k < 32; k++) {
        const int t = k / 4, j = k % 4, at = 4 * lane + j;
        int c;
        if (t_lo(T) == 8) c = (uint8_t)(lo[t * 64 + at] ^ 0x80);
        else if (t_lo(T) == 4) c = (lo[(t & 3) * 64 + at] >> (4 * (t >> 2))) & 15;
        else c = (lo[(t & 1) * 64 + at] >> (2 * (t >> 1))) & 3;
        if (T == VS_Q3_K) c |= ((hi[at] >> t) & 1) << 2;
        else if (t_hi(T) == 1) c |= ((hi[at] >> t) & 1) << 4;
        else if (t_hi(T) == 2) c |= ((hi[(t & 1) * 64 + at] >> (2 * (t >> 1))) & 3) << 4;
        if (T == VS_IQ4_NL || T == VS_IQ4_XS) c = kvalues_iq4nl[c] + 128;
        u[k] = (uint8_t)c;
    }
}


/* Lane `lane`'s scale and min of group g (0 or 1 for groups of 16) of a unit record. */
ALWAYS void lane_scale(const int T, const uint8_t *head, const uint8_t *rec, int lane, int g, float *scale,
                       float *minimum) {
    const uint8_t *s = rec + t_code_bytes(T);
    const float d = t_super(T) ? half_at(head, lane) : 0.0f, dmin = t_head_bytes(T) == 64 ? half_at(head + 32, lane) : 0.0f;
    *minimum = 0.0f;
    switch (T) {
    case VS_Q4_0: case VS_Q5_0: case VS_Q8_0: case VS_IQ4_NL: *scale = half_at(s, lane); break;
    case VS_Q4_1: case VS_Q5_1: *scale = half_at(s, lane), *minimum = half_at(s + 32, lane); break;
    case VS_Q2_K: *scale = d * (float)(s[16 * g + lane] & 15), *minimum = -(dmin * (float)(s[16 * g + lane] >> 4)); break;
    case VS_Q3_K: case VS_Q6_K: *scale = d * (float)(int8_t)s[16 * g + lane]; break;
    case VS_Q4_K: case VS_Q5_K: *scale = d * (float)s[lane], *minimum = -(dmin * (float)s[16 + lane]); break;
    case VS_IQ4_XS: *scale = d * (float)(int8_t)s[lane]; break;
    default: *scale = 0.0f;
    }
}

/* Rows [r0, r1) of w as float32 weights, exactly as gguf-py dequantizes them. */
static void dequant_rows_t(const int T, const vs_weight *w, int64_t r0, int64_t r1, float *out) {
    const int64_t K = w->cols, units = K / 32, bb = t_block_bytes(T, K);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *block = w->data + (r / 16) * bb;
        const int lane = (int)(r % 16);
        float *o = out + (r - r0) * K;
        if (t_float(T)) {
            for (int64_t k = 0; k < K; k++) {
                const uint8_t *p = block + ((k / 32) * 512 + (k % 32) * 16 + lane) * t_float_bytes(T);
                if (T == VS_F32) memcpy(o + k, p, 4);
                else if (T == VS_F16) o[k] = half_at(p, 0);
                else {
                    uint16_t b;
                    memcpy(&b, p, 2);
                    const uint32_t bits = (uint32_t)b << 16;
                    memcpy(o + k, &bits, 4);
                }
            }
            continue;
        }
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *rec = t_unit(T, block, u);
            uint8_t c[32];
            lane_codes(T, rec, lane, c);
            for (int g = 0; g < 32 / t_group(T); g++) {
                float scale, minimum;
                lane_scale(T, t_head(T, block, u), rec, lane, g, &scale, &minimum);
                for (int k = g * t_group(T); k < (g + 1) * t_group(T); k++)
                    o[u * 32 + k] = t_min(T) ? fmaf((float)c[k], scale, minimum) : (float)(c[k] - t_off(T)) * scale;
            }
        }
    }
}

void vs_dequant_rows(const vs_weight *w, int64_t r0, int64_t r1, float *out) {
    switch (w->type) {
#define DQ(T) case T: dequant_rows_t(T, w, r0, r1, out); break;
    DQ(VS_F32) DQ(VS_BF16) DQ(VS_F16) DQ(VS_Q4_0) DQ(VS_Q4_1) DQ(VS_Q5_0) DQ(VS_Q5_1) DQ(VS_Q8_0)
    DQ(VS_Q2_K) DQ(VS_Q3_K) DQ(VS_Q4_K) DQ(VS_Q5_K) DQ(VS_Q6_K) DQ(VS_IQ4_NL) DQ(VS_IQ4_XS)
#undef DQ
    default: break;
    }
}

/* dst (n rows, packed like w) = rows ids[0..n) of w; padding lanes zero. */
void vs_take_rows(const vs_weight *w, const int64_t *ids, int64_t n, uint8_t *dst) {
    const int64_t bb = vs_packed_bytes(w->type, 16, w->cols);
    memset(dst, 0, (size_t)((n + 15) / 16 * bb));
    for (int64_t i = 0; i < n; i++)
        lane_copy(w->type, w->cols, w->data + (ids[i] / 16) * bb, (int)(ids[i] % 16), dst + (i / 16) * bb, (int)(i % 16));
}

/* ---------------------------------------------------------------- packing GGUF blocks

   One GGUF block of a row, taken apart: u (its inputs' codes as the planes hold them: the
   code with its high bits, IQ4's 4-bit index, Q8_0's signed byte), and its scales in the
   stream's terms (halves' bits, or bytes). */
typedef struct {
    uint8_t u[256];
    uint16_t d[8], m[8];        /* per 32 inputs (Q4_0 .. Q8_0, IQ4_NL: one) */
    uint8_t sc[16], mn[16];     /* per group of the superblock types */
    uint16_t hd, hdmin;         /* the superblock's header */
} gguf_block;

ALWAYS uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static void k_scale_min(const uint8_t *q, int j, uint8_t *d, uint8_t *m) { /* ggml's get_scale_min_k4 */
    if (j < 4) *d = q[j] & 63, *m = q[j + 4] & 63;
    else *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

/* GGUF block bytes (inputs, bytes) of a type. */
ALWAYS void gguf_block_shape(const int T, int *inputs, int *bytes) {
    static const int shape[VS_TYPES][2] = {{1, 4}, {1, 2}, {1, 2}, {32, 18}, {32, 20}, {32, 22}, {32, 24}, {32, 34},
                                           {256, 84}, {256, 110}, {256, 144}, {256, 176}, {256, 210}, {32, 18}, {256, 136}};
    *inputs = shape[T][0], *bytes = shape[T][1];
}

/* The per-type pieces of gguf_decode: loops of 16 or 32 bytes without divisions, which the
   compiler vectorizes. */

/* Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL: a half scale (and min), 32 4-bit codes (Q5's with their
   fifth bits). */
ALWAYS void decode_32(const int T, const uint8_t *b, gguf_block *o) {
    const int mins = T == VS_Q4_1 || T == VS_Q5_1, five = T == VS_Q5_0 || T == VS_Q5_1;
    o->d[0] = u16_at(b);
    if (mins) o->m[0] = u16_at(b + 2);
    const uint8_t *qh = b + 2 + 2 * mins, *qs = qh + 4 * five;
    uint32_t h = 0;
    if (five) memcpy(&h, qh, 4);
    for (int k = 0; k < 16; k++) o->u[k] = qs[k] & 15, o->u[k + 16] = qs[k] >> 4;
    if (five)
        for (int k = 0; k < 32; k++) o->u[k] |= (uint8_t)(((h >> k) & 1) << 4);
}

/* Q3_K's sixteen 6-bit group scales, as signed bytes. */
ALWAYS void decode_q3_k_scales(const uint8_t *b, gguf_block *o) {
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    const uint32_t tmp = aux[2], k1 = 0x03030303, k2 = 0x0f0f0f0f;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    const int8_t *scales = (const int8_t *)aux;
    o->hd = u16_at(b + 108);
    for (int g = 0; g < 16; g++) o->sc[g] = (uint8_t)(int8_t)(scales[g] - 32);
}

/* Q2_K and Q3_K: 2-bit codes (Q3_K's with their third bits), then the scales. */
ALWAYS void decode_q2_q3_k(const int T, const uint8_t *b, gguf_block *o) {
    const uint8_t *q = b + (T == VS_Q2_K ? 16 : 32), *hm = b;
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {      /* l: h * 16 + the 16-input group's input */
                uint8_t c = (q[n * 32 + l] >> (2 * j)) & 3;
                if (T == VS_Q3_K) c |= (uint8_t)(((hm[l] >> (n * 4 + j)) & 1) << 2);
                o->u[n * 128 + j * 32 + l] = c;
            }
    if (T == VS_Q2_K) {
        o->hd = u16_at(b + 80), o->hdmin = u16_at(b + 82);
        memcpy(o->sc, b, 16);
    } else {
        decode_q3_k_scales(b, o);
    }
}

/* Q4_K and Q5_K: the header, eight groups' 6-bit scales and mins, 4-bit codes (Q5_K's with
   their fifth bits). */
ALWAYS void decode_q4_q5_k(const int T, const uint8_t *b, gguf_block *o) {
    const int five = T == VS_Q5_K;
    const uint8_t *qh = b + 16, *qs = b + 16 + 32 * five;
    o->hd = u16_at(b), o->hdmin = u16_at(b + 2);
    for (int g = 0; g < 8; g++) k_scale_min(b + 4, g, &o->sc[g], &o->mn[g]);
    for (int J = 0; J < 4; J++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[J * 32 + l] & 15, hi = qs[J * 32 + l] >> 4;
            if (five) lo |= (uint8_t)(((qh[l] >> (2 * J)) & 1) << 4), hi |= (uint8_t)(((qh[l] >> (2 * J + 1)) & 1) << 4);
            o->u[J * 64 + l] = lo, o->u[J * 64 + 32 + l] = hi;
        }
}

/* Q6_K: 4 low and 2 high bits a code, sixteen 8-bit group scales. */
ALWAYS void decode_q6_k(const uint8_t *b, gguf_block *o) {
    const uint8_t *ql = b, *qh = b + 128;
    o->hd = u16_at(b + 208);
    memcpy(o->sc, b + 192, 16);
    for (int N = 0; N < 2; N++)
        for (int l = 0; l < 32; l++) {
            const uint8_t a = ql[64 * N + l], c = ql[64 * N + 32 + l], h = qh[32 * N + l];
            o->u[128 * N + l] = (uint8_t)((a & 15) | ((h & 3) << 4));
            o->u[128 * N + 32 + l] = (uint8_t)((c & 15) | (((h >> 2) & 3) << 4));
            o->u[128 * N + 64 + l] = (uint8_t)((a >> 4) | (((h >> 4) & 3) << 4));
            o->u[128 * N + 96 + l] = (uint8_t)((c >> 4) | (((h >> 6) & 3) << 4));
        }
}

/* IQ4_XS: the header, eight groups' 6-bit scales, 4-bit indices into the IQ4 table. */
ALWAYS void decode_iq4_xs(const uint8_t *b, gguf_block *o) {
    const uint16_t sh = u16_at(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    o->hd = u16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xf) | (((sh >> (2 * ib)) & 3) << 4);
        o->sc[ib] = (uint8_t)(int8_t)(ls - 32);
        for (int j = 0; j < 16; j++) o->u[ib * 32 + j] = qs[ib * 16 + j] & 15, o->u[ib * 32 + 16 + j] = qs[ib * 16 + j] >> 4;
    }
}

/* One GGUF block of type T at b, taken apart into o. */
ALWAYS void gguf_decode(const int T, const uint8_t *b, gguf_block *o) {
    switch (T) {
    case VS_Q4_0: case VS_Q4_1: case VS_Q5_0: case VS_Q5_1: case VS_IQ4_NL: decode_32(T, b, o); break;
    case VS_Q8_0:
        o->d[0] = u16_at(b);
        memcpy(o->u, b + 2, 32);
        break;
    case VS_Q2_K: case VS_Q3_K: decode_q2_q3_k(T, b, o); break;
    case VS_Q4_K: case VS_Q5_K: decode_q4_q5_k(T, b, o); break;
    case VS_Q6_K: decode_q6_k(b, o); break;
    case VS_IQ4_XS: decode_iq4_xs(b, o); break;
    default: break;
    }
}

/* One unit's record of 16 lanes (lanes past `valid` stay zero): codes from u[lane][32],
   four codes a 32-bit word at a time. */
ALWAYS void write_unit(const int T, uint8_t *rec, uint8_t u[16][32], const gguf_block *const *blk, int sub,
                       int valid) {
    uint32_t planes[12][16];
    memset(planes, 0, sizeof(planes));
    uint32_t (*hi)[16] = planes + t_lo(T);
    for (int r = 0; r < valid; r++)
        for (int t = 0; t < 8; t++) {
            uint32_t w;
            memcpy(&w, u[r] + 4 * t, 4);
            if (t_lo(T) == 8) planes[t][r] = w;
            else if (t_lo(T) == 4) planes[t & 3][r] |= (w & 0x0F0F0F0Fu) << (4 * (t >> 2));
            else planes[t & 1][r] |= (w & 0x03030303u) << (2 * (t >> 1));
            if (T == VS_Q3_K) hi[0][r] |= ((w >> 2) & 0x01010101u) << t;
            else if (t_hi(T) == 1) hi[0][r] |= ((w >> 4) & 0x01010101u) << t;
            else if (t_hi(T) == 2) hi[t & 1][r] |= ((w >> 4) & 0x03030303u) << (2 * (t >> 1));
        }
    memcpy(rec, planes, (size_t)t_code_bytes(T));
    uint8_t *s = rec + t_code_bytes(T);
    for (int r = 0; r < valid; r++) {
        const gguf_block *b = blk[r];
        switch (T) {
        case VS_Q4_0: case VS_Q5_0: case VS_Q8_0: case VS_IQ4_NL: memcpy(s + 2 * r, &b->d[0], 2); break;
        case VS_Q4_1: case VS_Q5_1: memcpy(s + 2 * r, &b->d[0], 2), memcpy(s + 32 + 2 * r, &b->m[0], 2); break;
        case VS_Q2_K: case VS_Q3_K: case VS_Q6_K: s[r] = b->sc[2 * sub], s[16 + r] = b->sc[2 * sub + 1]; break;
        case VS_Q4_K: case VS_Q5_K: s[r] = b->sc[sub], s[16 + r] = b->mn[sub]; break;
        case VS_IQ4_XS: s[r] = b->sc[sub]; break;
        default: break;
        }
    }
}

/* One block of 16 rows (row[r]: row r's GGUF bytes; rows past `valid` are zero). */
ALWAYS void pack_block(const int T, const uint8_t *const *row, int valid, int64_t cols, uint8_t *block) {
    int inputs, bytes;
    gguf_block_shape(T, &inputs, &bytes);
    if (t_float(T)) {
        const int e = t_float_bytes(T);
        for (int r = 0; r < valid; r++)
            for (int64_t k = 0; k < cols; k++)
                memcpy(block + ((k / 32) * 512 + (k % 32) * 16 + r) * e, row[r] + k * e, e);
        return;
    }
    gguf_block dec[16];
    const gguf_block *bp[16];
    for (int64_t first = 0; first < cols; first += inputs) {     /* one GGUF block of each row */
        for (int r = 0; r < valid; r++) {
            gguf_decode(T, row[r] + (first / inputs) * bytes, &dec[r]);
            bp[r] = &dec[r];
        }
        if (t_super(T)) {
            uint8_t *head = (uint8_t *)t_head(T, block, first / 32);
            for (int r = 0; r < valid; r++) {
                memcpy(head + 2 * r, &dec[r].hd, 2);
                if (t_head_bytes(T) == 64) memcpy(head + 32 + 2 * r, &dec[r].hdmin, 2);
            }
        }
        for (int sub = 0; sub < inputs / 32; sub++) {
            uint8_t u[16][32];
            for (int r = 0; r < valid; r++) memcpy(u[r], dec[r].u + 32 * sub, 32);
            write_unit(T, (uint8_t *)t_unit(T, block, first / 32 + sub), u, bp, sub, valid);
        }
    }
}

ALWAYS void pack_blocks_t(const int T, const uint8_t *src, int64_t row_bytes, int64_t rows, int64_t cols,
                          const int64_t *order, uint8_t *dst) {
    const int64_t blocks = (rows + 15) / 16, bb = t_block_bytes(T, cols);
#pragma omp parallel for schedule(dynamic, 4) num_threads(team())
    for (int64_t bi = 0; bi < blocks; bi++) {
        uint8_t *block = dst + bi * bb;
        memset(block, 0, (size_t)bb);
        const int valid = rows - bi * 16 < 16 ? (int)(rows - bi * 16) : 16;
        const uint8_t *row[16];
        for (int r = 0; r < valid; r++) row[r] = src + (order ? order[bi * 16 + r] : bi * 16 + r) * row_bytes;
        pack_block(T, row, valid, cols, block);
    }
}

/* Pack `rows` rows of GGUF blocks (row i at src + order[i] * row_bytes, order NULL: i) into
   dst (vs_packed_bytes of it). Floats: row-major f32, f16 or bf16 values. */
void vs_pack(int32_t type, const uint8_t *src, int64_t row_bytes, int64_t rows, int64_t cols,
             const int64_t *order, uint8_t *dst) {
    switch (type) {   /* a copy of the loops for each type: its layout's numbers are constants */
#define PACK(T) case T: pack_blocks_t(T, src, row_bytes, rows, cols, order, dst); break;
    PACK(VS_F32) PACK(VS_BF16) PACK(VS_F16) PACK(VS_Q4_0) PACK(VS_Q4_1) PACK(VS_Q5_0) PACK(VS_Q5_1) PACK(VS_Q8_0)
    PACK(VS_Q2_K) PACK(VS_Q3_K) PACK(VS_Q4_K) PACK(VS_Q5_K) PACK(VS_Q6_K) PACK(VS_IQ4_NL) PACK(VS_IQ4_XS)
#undef PACK
    default: break;
    }
}


/* A thread's buffer, grown as needed. */
static void *thread_buffer(int which, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t cap[4];
    if (cap[which] < bytes) {
        free(buf[which]);
        buf[which] = malloc(bytes);
        cap[which] = bytes;
    }
    return buf[which];
}

/* Each row's sums of x over every group, in input order (the mins' terms). */
static void prepare_float(acts *a, const float *x, int64_t M, int64_t ldx, int64_t K, int mins) {
    a->x = x, a->ldx = ldx, a->float_ready = 1;
    if (!mins) return;
    const int64_t units = K / 32;
    float *xs = thread_buffer(0, (size_t)M * units * 3 * sizeof(float));
    for (int64_t i = 0; i < M; i++)
        for (int64_t u = 0; u < units; u++) {
            const float *xu = x + i * ldx + u * 32;
            float s = 0.0f, a0 = 0.0f, a1 = 0.0f;
            for (int k = 0; k < 32; k++) s += xu[k];
            for (int k = 0; k < 16; k++) a0 += xu[k];
            for (int k = 16; k < 32; k++) a1 += xu[k];
            float *o = xs + (i * units + u) * 3;
            o[0] = a0, o[1] = a1, o[2] = s;
        }
    a->xs = xs;
}

#if VS_HAS_INT8
/* Rows quantized per 32 inputs: d = max|x| / 127, q = round(x / d), with the sums of q. */
static void prepare_int8(acts *a, const float *x, int64_t M, int64_t ldx, int64_t K) {
    const int64_t units = K / 32;
    int8_t *q = thread_buffer(1, (size_t)M * K);
    float *d = thread_buffer(2, (size_t)M * units * 4 * sizeof(float)), *dsum = d + M * units;
    int32_t *qsum = thread_buffer(3, (size_t)M * units * 2 * sizeof(int32_t));
    for (int64_t i = 0; i < M; i++)
        for (int64_t u = 0; u < units; u++) {
            const float *xu = x + i * ldx + u * 32;
            const vf va = vf_load(xu), vb = vf_load(xu + 16);
            const float amax = vf_hmax(vf_max(vf_abs(va), vf_abs(vb)));
            const float du = amax / 127.0f, id = du != 0.0f ? 1.0f / du : 0.0f;
            const vi qa = vi_round(vf_mul(va, vf_set1(id))), qb = vi_round(vf_mul(vb, vf_set1(id)));
            vi_store_i8(q + i * K + u * 32, qa);
            vi_store_i8(q + i * K + u * 32 + 16, qb);
            const int64_t at = i * units + u;
            const int32_t sa = vi_sum(qa), sb = vi_sum(qb);
            d[at] = du;
            qsum[2 * at] = sa, qsum[2 * at + 1] = sb;
            dsum[3 * at] = du * (float)sa, dsum[3 * at + 1] = du * (float)sb, dsum[3 * at + 2] = du * (float)(sa + sb);
        }
    a->q = q, a->d = d, a->qsum = qsum, a->dsum = dsum, a->int8_ready = 1;
}
#endif

static blocks_fn blocks_for(const vs_weight *w) {
    static const blocks_fn f[VS_TYPES][2] = {
#define ROW(T) {vs_blocks_f_##T, vs_blocks_a8_##T},
        VS_BLOCK_FUNCTIONS(ROW)
#undef ROW
    };
    return f[w->type][w->int8_acts && !t_float(w->type)];
}

/* y's columns for weight blocks [b0, b1) of w and M rows of x: one work item. A thread
   prepares what its items read of x on its first one that needs it (weights sharing x may
   differ in type: q, k and v of a Q4_K_M file). */
ALWAYS void linear_blocks(const vs_weight *w, int64_t b0, int64_t b1, const float *x, int64_t M, int64_t ldx,
                          float *y, int64_t ldy, acts *a) {
#if VS_HAS_INT8
    if (w->int8_acts && !t_float(w->type)) {
        if (!a->int8_ready) prepare_int8(a, x, M, ldx, w->cols);
    } else
#endif
    if (!a->float_ready || (t_min(w->type) && a->xs == NULL)) prepare_float(a, x, M, ldx, w->cols, t_min(w->type));
    blocks_for(w)(w, b0, b1, a, M, y, ldy);
}

int vs_has_int8(void) { return VS_HAS_INT8; }

/* Rows a matmul takes per pass over a weight's blocks: up to this many cost about one row's
   streaming of the weights. */
int vs_tile_rows(void) { return QTILE_M; }
