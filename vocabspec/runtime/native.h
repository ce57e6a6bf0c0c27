/* The native CPU engine's ABI: the structs native.py builds (its ctypes mirrors are checked
 * against `vs_abi` when the library loads: every size and offset) and the functions it calls.
 *
 * Layouts, drawn once:
 *
 *   a weight (vs_weight.data): blocks of 16 rows, one stream each, one row per vector lane
 *     block 0: [unit 0][unit 1]...    quantized: per 32 inputs a record [codes][scales], and
 *     block 1: ...                    every 8 units a header [d x16][dmin x16] (K-quants);
 *                                     float: per 32 inputs, input by input, 16 rows each.
 *     A code plane is 64 bytes: lane r (4 bytes) = row r's codes of inputs 4t .. 4t + 3
 *     (native_weights.c says which plane holds which quad).
 *
 *   a cache (one per sequence), per layer and kv head:
 *     keys   [T/16][head_dim][16]   blocks of 16 slots, each dimension's 16 values together
 *     values [T][head_dim]
 *
 *   what a row sees (visibility): slots [0, prefix[r]), then extra[xoff[r] .. xoff[r+1]) in
 *   position order, its own slot last; a sliding window drops positions below pos - window + 1.
 */

#ifndef VOCABSPEC_NATIVE_H
#define VOCABSPEC_NATIVE_H

#include <stdint.h>

typedef struct {
    int32_t type;          /* VS_F32 .. VS_IQ4_XS (native_weights.c) */
    int32_t rows, cols;
    int32_t int8_acts;     /* products quantize their input rows to 8 bits (gguf-a8) */
    const uint8_t *data;   /* the blocks' streams, vs_packed_bytes(type, rows, cols) */
    const float *bias;     /* rows, or NULL */
} vs_weight;

typedef struct {
    vs_weight wq, wk, wv, wo, w_gate, w_up, w_down;
    const float *attn_norm, *mlp_norm, *post_attn_norm, *post_mlp_norm, *q_norm, *k_norm;
    /* EAGLE-3's first layer: q, k and v read the row's embedding through attn_norm beside the
       row itself through hidden_norm (2 dim inputs); NULL elsewhere. */
    const float *hidden_norm;
    const float *cos, *sin;  /* RoPE tables, max_len x head_dim */
    int32_t window;          /* sliding window in positions, 0: global attention */
    int32_t norm_residual;   /* with hidden_norm: the residual is the normed row */
} vs_layer;

typedef struct {
    int32_t dim, n_heads, n_kv, head_dim, hidden, max_len, n_layers, act; /* act 0 SiLU, 1 GELU-tanh */
    float eps, attn_scale;
    int32_t kv_half, pad;  /* its caches hold keys and values as IEEE halves (else floats) */
    vs_layer *layers;
} vs_stack;

/* An EAGLE drafter: its decoder layers (a vs_stack over its own cache), fc, and a draft head
   (head_ids: the target id of each head row, NULL for all).
   - EAGLE-2 (fused 0): fc over (token embedding, feature); features are the target's last
     hidden states through its final norm (norm, eps), or the drafter's own outputs; the head
     (the target's rows) scores the outputs as they are.
   - EAGLE-3 (fused 1): at a position the target has run, fc fuses the target's tapped rows
     (fc.cols wide) into the feature; deeper, the feature is the drafter's output. The first
     layer reads the token's embedding beside it (vs_layer's hidden_norm); the head (the
     drafter's own) scores the outputs through head_norm, or the outputs are normed by
     out_norm before anything reads them (norm_output checkpoints). */
typedef struct {
    vs_weight fc, head, embed;
    const int64_t *head_ids;
    const float *norm, *head_norm, *out_norm;
    float eps, embed_scale;
    int32_t fused, pad;
} vs_drafter;

/* Sizes and offsets of the structs above, for the loader's check: count written. */
int64_t vs_abi(int64_t *out, int64_t cap);

/* weights */
int vs_type_count(void);
int64_t vs_packed_bytes(int32_t type, int64_t rows, int64_t cols);
void vs_pack(int32_t type, const uint8_t *src, int64_t row_bytes, int64_t rows, int64_t cols, const int64_t *order,
             uint8_t *dst);
void vs_take_rows(const vs_weight *w, const int64_t *ids, int64_t n, uint8_t *dst);
void vs_dequant_rows(const vs_weight *w, int64_t r0, int64_t r1, float *out);
int vs_has_int8(void);
int vs_tile_rows(void);
void vs_linear(const vs_weight *w, const float *x, int64_t M, float *y);
void vs_linear_topk(const vs_weight *w, const float *x, int64_t M, int64_t k, float *logits, int64_t *ids,
                    float *logprobs);
void vs_embed(const vs_weight *w, const int32_t *ids, int64_t n, float scale, float *out);
void vs_head(const float *norm, float eps, const vs_weight *w, const float *hidden, int64_t M, float *work,
             float *logits);

/* threads */
void vs_set_threads(int n);
int vs_threads(void);
void vs_threads_observe(int n, double cpu, double wall);

/* layers */
int64_t vs_stack_work(const vs_stack *s, int64_t n);
int64_t vs_attention_scratch(const vs_stack *s);

/* The rows of one vs_stack_forward_rows call, of one sequence or several: row r at position
   pos[r] sees what prefix/xoff/extra say (the visibility drawn above) and writes its key and
   value to slot slot[r] of the cache keys[r], values[r]. embeds: n x dim, the rows' token
   embeddings, read by a layer with hidden_norm (NULL when none has one). taps: the layers whose
   outputs are copied to tapped (n x ntaps*dim, side by side); ntaps 0: none. */
typedef struct {
    int64_t n, ntaps;
    const int32_t *pos, *prefix, *xoff, *extra, *slot, *taps;
    void *const *keys;
    void *const *values;
    const float *embeds;
    float *tapped;
} vs_rows;

/* x (rows->n x dim) through every layer, in place. work: vs_stack_work floats; scratch:
   vs_attention_scratch floats a thread. */
void vs_stack_forward_rows(const vs_stack *s, float *x, const vs_rows *rows, float *work, float *scratch);

/* speculative steps */

/* One sequence's cache in the layout drawn above: keys (layers x n_kv x slots/16 x head_dim x 16)
   and values (layers x n_kv x slots x head_dim), IEEE halves (half) or floats. */
typedef struct {
    void *keys, *values;
    int64_t layers, n_kv, head_dim, slots, half;
} vs_cache;

/* Keep the pending slots keep[0..nkeep) (increasing, relative to `length`), packed right after
   the committed `length`. */
void vs_cache_keep(const vs_cache *c, int64_t length, const int64_t *keep, int64_t nkeep);

/* Greedy verification of ntrees trees (vs_verify_greedy): tree t's rows are rows offsets[t] ..
   offsets[t+1] of hidden (their last hidden states, head->cols wide), with tokens and parents
   (tree-local, -1 for the root); the head scores rows through norm (eps) head_rows at a time.
   Out: each tree's accepted rows in paths (at its offset, root first), their count in counts[t],
   the target's token after them in next[t]. work: ntrees * head_rows x head->cols floats. */
typedef struct {
    const float *norm;
    const vs_weight *head;
    const float *hidden;
    const int64_t *offsets, *tokens, *parents;
    int64_t *paths, *counts, *next;
    float *work;
    int64_t ntrees, head_rows;
    float eps;
    int32_t pad;
} vs_verify_request;

void vs_verify_greedy(const vs_verify_request *r);

/* The drafter reads n committed rows (vs_drafter_read): tokens, and the target's rows at the
   tokens before them (EAGLE-2: its hidden states, n x dim; EAGLE-3: its tapped rows, n x
   fc.cols), into its cache (keys, values) after `length` slots, causally. Out: state, the last
   row's state (dim floats). scratch: vs_drafter_read_scratch floats; work, att: as
   vs_stack_forward_rows's for n rows. */
typedef struct {
    const vs_drafter *drafter;
    const vs_stack *stack;
    void *keys, *values;
    int64_t length, n;
    const int64_t *tokens;
    const float *hidden;
    float *state, *scratch, *work, *att;
} vs_read_request;

void vs_drafter_read(const vs_read_request *r);
int64_t vs_drafter_read_scratch(const vs_drafter *d, int64_t n);
int64_t vs_tree_capacity(int64_t top_k, int64_t depth);
/* How far EAGLE-2's tree grows (the live tree-size rule, live_tree.py). A node's chance to be on
   the accepted path is chance[depth * bins + bin], bin = min(bins - 1, (int)(exp(value) * bins)),
   depth capped at depths - 1; what expanding a frontier node can add is its chance less that of
   the node ranked total_tokens-th where the tree holds more (a child kept pushes it out; a
   negative remainder counts 0). Each level expands the frontier's first w nodes (value order),
   w maximising the sum of what they add less node_cost each, and only where that sum reaches
   min_gain; none: the tree stops (expected tokens: what a node's row and drafting, and a
   level's own drafting, cost at the rule's rate).
   levels, rows (written by vs_eagle_tree): the levels it drafted, the root's children counted,
   and the rows its head scored over them, so the rule prices drafting by what was drafted. */
typedef struct {
    const double *chance;
    int64_t depths, bins;
    double min_gain, node_cost;
    int64_t levels, rows;
} vs_tree_stop;

/* One EAGLE-2 tree (vs_eagle_tree): the drafter and its stack, its cache of `length` committed
   slots, its output at the root (`state`, the root token `root`), the tree's shape and stop;
   out: the kept tree; scratch: head_logits (top_k x head rows floats), work/att (as
   vs_stack_forward_rows for top_k rows). */
typedef struct {
    const vs_drafter *drafter;
    const vs_stack *stack;
    void *keys, *values;
    int64_t length;
    const float *state;
    int64_t root, top_k, depth, total_tokens;
    vs_tree_stop *stop;
    int64_t *tokens, *parents, *ranks;
    double *node_values;
    float *head_logits, *work, *att;
} vs_tree_request;

int64_t vs_eagle_tree(const vs_tree_request *r);

#endif
