/* Decode attention for CPU, reading the paged KV cache where it lies (srt_decode_attention),
 * queries, cache and output in float32 or bf16 (`type`), every product and sum in float32: one query row per sequence, its keys and values the cache slots
 * listed in its row of the request-to-token table. The PyTorch path gathers every sequence's
 * slots into padded [B, L] copies, then runs SDPA over them; here each (sequence, block of
 * query heads sharing one KV head) is one task that reads its slots in place:
 *   1. s[h, j] = scale · q[h] · k[slot_j]      (each key read once for the block's heads);
 *   2. p[h, j] = exp(s[h, j] - max_j s[h, j]), and their sum;
 *   3. out[h] = Σ_j p[h, j] · v[slot_j] / Σ_j p[h, j], columns in blocks of 4 vectors.
 * Every sum runs in one fixed order per (sequence, head), whatever else is in the batch, so a
 * sequence's output does not depend on the batch it came in (split and unsplit batches agree). */

#include "cpu_kernels.h"

#define HEAD_BLOCK 4 /* query heads per task (sum_lanes4 sums 4) */
#define AHEAD 8      /* keys (or values) ahead that the loops ask the cache for */

/* Asks for the n floats at p, a line of 64 bytes at a time, without waiting. Once the pool
 * has turned over, a sequence's slots lie anywhere in it (freed slots go back in the order
 * they were freed), where the hardware's own prefetch does not follow them: the loops ask for
 * the row AHEAD slots on, unless that slot follows the one before it (a prompt's run of
 * slots, which the hardware streams by itself). */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}

/* The lanes of each of 4 vectors summed, into out[0:4], in a fixed order per vector: with
 * AVX-512 the 4 transposed as they are added (13 instructions for the 4, against about 8 for
 * each alone), else one by one. */
static inline __attribute__((always_inline)) void sum_lanes4(const vec v[4], float out[4]) {
#if defined(__AVX512F__)
    __m512 a = (__m512)v[0], b = (__m512)v[1], c = (__m512)v[2], d = (__m512)v[3];
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
#else
    for (int h = 0; h < 4; h++) out[h] = sum_lanes(v[h]);
#endif
}

/* s[h] = scale · a_h · b over n values for the nh ≤ HEAD_BLOCK query heads a_h = a + h · n, b
 * (a key) of `type`: the key widened once for all of them, one accumulator per head, VEC lanes
 * at a time, then the lanes (sum_lanes4) and the tail. */
static inline __attribute__((always_inline)) void dot_heads(const float *a, int64_t nh,
                                                            int type, const void *b, int64_t n,
                                                            float scale, float *s,
                                                            int64_t s_ld) {
    vec acc[HEAD_BLOCK] = {{0}};
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vec key = load_act(type, b, i);
        for (int h = 0; h < HEAD_BLOCK; h++)
            if (h < nh) acc[h] = fma_vv(acc[h], load_vec(a + h * n + i), key);
    }
    float sums[HEAD_BLOCK];
    sum_lanes4(acc, sums);
    for (int64_t h = 0; h < nh; h++) {
        for (int64_t t = i; t < n; t++) sums[h] += a[h * n + t] * get_act(type, b, t);
        s[h * s_ld] = scale * sums[h];
    }
}

/* out_h[0:w·VEC] = Σ_j p_h[j] · v_j[col:col + w·VEC] for the block's heads h < nh (p_h at
 * p + h·len, out_h at out + h·out_ld), w ≤ 4 vectors, values of `type` (element v_stride·slot
 * + col): each value row is read once for all the heads, whose accumulators stay in registers
 * across the keys. */
static inline __attribute__((always_inline)) void weighted_rows(
    const float *p, int64_t len, int64_t nh, int type, const void *v, const int64_t *slots,
    int64_t v_stride, int64_t col, int w, float *out, int64_t out_ld) {
    vec acc[HEAD_BLOCK][4], row[4];
    int64_t size = type == T_F32 ? 4 : 2;
    memset(acc, 0, sizeof acc);
    for (int64_t j = 0; j < len; j++) {
        if (j + AHEAD < len && slots[j + AHEAD] != slots[j + AHEAD - 1] + 1)
            prefetch_row((const char *)v + (slots[j + AHEAD] * v_stride + col) * size,
                         w * VEC * size);
        for (int u = 0; u < w; u++) row[u] = load_act(type, v, slots[j] * v_stride + col + u * VEC);
        for (int h = 0; h < HEAD_BLOCK; h++)
            if (h < nh)
                for (int u = 0; u < w; u++) acc[h][u] += p[h * len + j] * row[u];
    }
    for (int h = 0; h < nh; h++)
        for (int u = 0; u < w; u++) store_vec(out + h * out_ld + col + u * VEC, acc[h][u]);
}

/* Softmax of s[0:len] in place; returns the sum of the exponentials. */
static float exp_shifted(float *s, int64_t len) {
    float max = s[0], sum = 0.0f;
    for (int64_t j = 1; j < len; j++) max = s[j] > max ? s[j] : max;
    for (int64_t j = 0; j < len; j++) s[j] = fast_exp(s[j] - max);
    for (int64_t j = 0; j < len; j++) sum += s[j];
    return sum;
}

struct decode_attention {
    const void *q, *k, *v;
    int64_t heads, kv_heads, dim, v_dim, k_stride, v_stride;
    const int64_t *table, *rows, *lens;
    int64_t table_ld;
    float scale;
    void *out;
};

/* Heads [h0, h1) of sequence b, all on KV head kv, over activations of `type`; `s` holds
 * (h1 - h0) · len floats, `qf` and `of` the heads' queries and outputs in float32. */
static inline __attribute__((always_inline)) void attend(const struct decode_attention *a,
                                                         int type, int64_t b, int64_t h0,
                                                         int64_t h1, int64_t kv, float *s,
                                                         float *qf, float *of) {
    int64_t len = a->lens[b], nh = h1 - h0, size = type == T_F32 ? 4 : 2;
    const int64_t *slots = a->table + a->rows[b] * a->table_ld;
    widen_acts(type, (const char *)a->q + (b * a->heads + h0) * a->dim * size, nh * a->dim, qf);
    for (int64_t j = 0; j < len; j++) {
        if (j + AHEAD < len && slots[j + AHEAD] != slots[j + AHEAD - 1] + 1)
            prefetch_row((const char *)a->k + (slots[j + AHEAD] * a->k_stride + kv * a->dim) * size,
                         a->dim * size);
        const char *key = (const char *)a->k + (slots[j] * a->k_stride + kv * a->dim) * size;
        dot_heads(qf, nh, type, key, a->dim, a->scale, s + j, len);
    }
    const char *v = (const char *)a->v + kv * a->v_dim * size;
    float inv[HEAD_BLOCK];
    for (int64_t h = 0; h < nh; h++) inv[h] = 1.0f / exp_shifted(s + h * len, len);
    int64_t c = 0;
    for (; c + 4 * VEC <= a->v_dim; c += 4 * VEC)
        weighted_rows(s, len, nh, type, v, slots, a->v_stride, c, 4, of, a->v_dim);
    for (; c + VEC <= a->v_dim; c += VEC)
        weighted_rows(s, len, nh, type, v, slots, a->v_stride, c, 1, of, a->v_dim);
    for (int64_t h = 0; h < nh; h++) {
        float *o = of + h * a->v_dim;
        for (int64_t t = c; t < a->v_dim; t++) { /* columns past the last whole vector */
            o[t] = 0.0f;
            for (int64_t j = 0; j < len; j++)
                o[t] += s[h * len + j] * get_act(type, v, slots[j] * a->v_stride + t);
        }
        for (int64_t t = 0; t < a->v_dim; t++) o[t] *= inv[h];
    }
    narrow_acts(type, of, nh * a->v_dim, (char *)a->out + (b * a->heads + h0) * a->v_dim * size);
}

static void attend_f32(const struct decode_attention *a, int64_t b, int64_t h0, int64_t h1,
                       int64_t kv, float *s, float *qf, float *of) {
    attend(a, T_F32, b, h0, h1, kv, s, qf, of);
}

static void attend_bf16(const struct decode_attention *a, int64_t b, int64_t h0, int64_t h1,
                        int64_t kv, float *s, float *qf, float *of) {
    attend(a, T_BF16, b, h0, h1, kv, s, qf, of);
}

/* q [B, H, dim]; key of slot s, KV head h at element s·k_stride + h·dim of k, its value at
 * s·v_stride + h·v_dim of v (MLA: v = k, the latent's first v_dim columns); sequence b's slots
 * table[rows[b] · table_ld + j] for j < lens[b] (≥ 1); out [B, H, v_dim]; all of `type`.
 * Returns 0, SRT_OUT_OF_MEMORY, or the code of the first index check that fails (nothing
 * written then): rows inside the table, lengths in [1, table_cols], slots below num_slots. */
/* The tasks of a decode attention call: (sequence, KV head, block of HEAD_BLOCK query heads),
 * each thread its share, in a buffer of its own (`failed` counts threads without one). */
struct decode_call {
    const struct decode_attention *a;
    int type;
    int64_t tasks, blocks, group, max_len;
    _Atomic int failed;
};

static void decode_region(void *arg, const struct team *team) {
    struct decode_call *c = arg;
    const struct decode_attention *a = c->a;
    int64_t kv_heads = a->kv_heads, blocks = c->blocks, group = c->group, lo, hi;
    float *s = malloc(HEAD_BLOCK * (c->max_len + a->dim + a->v_dim) * sizeof *s);
    if (!s) {
        c->failed++;
        return;
    }
    float *qf = s + HEAD_BLOCK * c->max_len, *of = qf + HEAD_BLOCK * a->dim;
    team_share(team, c->tasks, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        int64_t b = t / (kv_heads * blocks), kv = t / blocks % kv_heads;
        int64_t h0 = kv * group + t % blocks * HEAD_BLOCK;
        int64_t h1 = h0 + HEAD_BLOCK < (kv + 1) * group ? h0 + HEAD_BLOCK : (kv + 1) * group;
        if (c->type == T_F32) attend_f32(a, b, h0, h1, kv, s, qf, of);
        else attend_bf16(a, b, h0, h1, kv, s, qf, of);
    }
    free(s);
}

int srt_decode_attention(int type, const void *q, int64_t batch, int64_t heads, int64_t dim,
                         const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                         int64_t v_dim, int64_t kv_heads, const int64_t *table, int64_t table_ld,
                         int64_t table_rows, int64_t table_cols, int64_t num_slots,
                         const int64_t *rows, const int64_t *lens, float scale, void *out) {
    struct slot_table slot_table = {table, table_ld, table_rows, table_cols, num_slots};
    struct decode_attention a = {q, k, v, heads, kv_heads, dim, v_dim, k_stride, v_stride,
                                 table, rows, lens, table_ld, scale, out};
    int64_t group = heads / kv_heads, blocks = (group + HEAD_BLOCK - 1) / HEAD_BLOCK;
    int64_t max_len = 0, tasks = batch * kv_heads * blocks;
    for (int64_t b = 0; b < batch; b++) {
        int status = lens[b] < 1 ? SRT_BAD_LENGTH : check_sequence(&slot_table, rows[b], lens[b]);
        if (status) return status;
        max_len = lens[b] > max_len ? lens[b] : max_len;
    }
    if (tasks == 0) return 0;
    struct decode_call c = {&a, type, tasks, blocks, group, max_len, 0};
    team_run(decode_region, &c, tasks > 1);
    return c.failed ? SRT_OUT_OF_MEMORY : 0;
}

/* Rotary position embedding of x [T, H, rot] (token t's head h at element t·ld_token +
 * h·ld_head) into out [T, H, rot], contiguous, both of `type` (each product in float32, each
 * result rounded once). cos_sin [rows, rot] (float32) holds, for each position, the cosines
 * of the rot/2 frequencies and then their sines. NeoX pairs columns (i, i + rot/2), GPT-J
 * (2i, 2i + 1). Returns 0, or SRT_BAD_POSITION (nothing written) when a position is outside
 * the table. */
static inline __attribute__((always_inline)) void rotate(int type, const void *x, int64_t t,
                                                         int64_t heads, int64_t ld_token,
                                                         int64_t ld_head, int64_t rot,
                                                         const float *cos, int neox,
                                                         void *out) {
    int64_t half = rot / 2, a = neox ? half : 1, step = neox ? 1 : 2; /* pair i: (i·step, +a) */
    for (int64_t h = 0; h < heads; h++) {
        int64_t in = t * ld_token + h * ld_head, o = (t * heads + h) * rot;
        const float *sin = cos + half;
        for (int64_t i = 0; i < half; i++) {
            float x1 = get_act(type, x, in + i * step), x2 = get_act(type, x, in + i * step + a);
            put_act(type, out, o + i * step, x1 * cos[i] - x2 * sin[i]);
            put_act(type, out, o + i * step + a, x2 * cos[i] + x1 * sin[i]);
        }
    }
}

struct rope_call {
    int type;
    const void *x;
    int64_t tokens, heads, ld_token, ld_head, rot;
    const int64_t *positions;
    const float *cos_sin;
    int neox;
    void *out;
};

static void rope_region(void *arg, const struct team *team) {
    const struct rope_call *c = arg;
    int64_t lo, hi;
    team_share(team, c->tokens, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *cos = c->cos_sin + c->positions[t] * c->rot;
        if (c->type == T_F32)
            rotate(T_F32, c->x, t, c->heads, c->ld_token, c->ld_head, c->rot, cos, c->neox, c->out);
        else rotate(T_BF16, c->x, t, c->heads, c->ld_token, c->ld_head, c->rot, cos, c->neox,
                    c->out);
    }
}

int srt_rope(int type, const void *x, int64_t tokens, int64_t heads, int64_t ld_token,
             int64_t ld_head, int64_t rot, const int64_t *positions, const float *cos_sin,
             int64_t rows, int neox, void *out) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= rows) return SRT_BAD_POSITION;
    struct rope_call c = {type, x, tokens, heads, ld_token, ld_head, rot, positions, cos_sin,
                          neox, out};
    team_run(rope_region, &c, tokens * heads >= 4096);
    return 0;
}
