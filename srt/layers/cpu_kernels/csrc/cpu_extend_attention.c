/* Extend (prefill) attention for CPU, reading the paged KV cache where it lies
 * (srt_extend_attention), queries, cache and output in float32 or bf16 (`type`: widened into
 * the task's float32 tile as they are read, the output rounded once). Sequence b brings extend[b] new query tokens (rows start[b]... of
 * q) after prefix[b] cached ones; query i of it sits at position prefix[b] + i and attends the
 * keys at positions 0..prefix[b] + i, the cache slots of its row of the request-to-token table
 * (the new tokens' keys are already written there). The PyTorch path gathers every sequence's
 * slots, pads sequences into groups and copies SDPA's output back; here one task is a block of
 * TOKEN_BLOCK query tokens of one sequence with every query head of one KV head, its rows r =
 * (token, head). Per block of KEY_BLOCK keys, read once from the cache for all of them:
 *   1. s[r, j] = q[r] · (scale · k_j)         (4 query rows × KEY_BLOCK keys in registers);
 *   2. online softmax: m[r] = max(m[r], max_j s[r, j]) over r's own keys (j ≤ its position),
 *      p[r, j] = exp(s[r, j] - m[r]), the running sum and output rescaled by exp(m_old - m[r]);
 *   3. o[r] += Σ_j p[r, j] · v_j                (4 query rows × 4 value vectors in registers).
 * A row's keys are cut into the same blocks (multiples of KEY_BLOCK from position 0) and each
 * sum runs in one fixed order whatever task the row falls in; keys past a row's position add
 * exact zeros. So a token's output does not depend on the batch it came in, nor on where that
 * batch split its sequence (split and unsplit batches agree). */

#include "cpu_kernels.h"

#define KEY_BLOCK (4 * VEC) /* keys per block: one row of score accumulators */
#define ROWS 4              /* query rows per register block */
#define TOKEN_BLOCK 64      /* query tokens per task */

/* Keeps a vector in a register for the FMAs that use it, rather than each loading it again
 * (which makes the loop load-bound). */
#if defined(__AVX__)
#define HOLD(v) __asm__("" : "+v"(v))
#else
#define HOLD(v) (void)0
#endif

struct extend_attention {
    const void *q, *k, *v;
    int64_t heads, kv_heads, dim, v_dim, k_stride, v_stride;
    const int64_t *table, *rows, *prefix, *extend, *start;
    int64_t table_ld;
    float scale;
    void *out;
    int type;
    int64_t size; /* bytes of an element of `type` */
};

/* One thread's buffers, sized for a task of TOKEN_BLOCK tokens × `group` heads. */
struct tile {
    float *q, *s, *o, *m, *l, *keys, *values; /* keys transposed [dim][KEY_BLOCK] */
};

static int alloc_tile(struct tile *t, int64_t rows, int64_t dim, int64_t v_dim) {
    t->q = malloc(rows * dim * sizeof(float));
    t->s = malloc(rows * KEY_BLOCK * sizeof(float));
    t->o = malloc(rows * v_dim * sizeof(float));
    t->m = malloc(rows * sizeof(float));
    t->l = malloc(rows * sizeof(float));
    t->keys = malloc(dim * KEY_BLOCK * sizeof(float));
    t->values = malloc(KEY_BLOCK * v_dim * sizeof(float));
    return t->q && t->s && t->o && t->m && t->l && t->keys && t->values ? 0 : -1;
}

static void free_tile(struct tile *t) {
    free(t->q), free(t->s), free(t->o), free(t->m), free(t->l), free(t->keys), free(t->values);
}

/* s[i, 0:w·VEC] = Σ_d q[i, d] · keys[d, 0:w·VEC] for i < n ≤ ROWS, w ≤ 4 vectors. */
static inline __attribute__((always_inline)) void score_rows(const float *q, int64_t n,
                                                             int64_t dim, const float *keys,
                                                             int w, float *s) {
    vec acc[ROWS][4];
    memset(acc, 0, sizeof acc);
    for (int64_t d = 0; d < dim; d++) {
        vec k[4];
        for (int u = 0; u < w; u++) {
            k[u] = load_vec(keys + d * KEY_BLOCK + u * VEC);
            HOLD(k[u]);
        }
        for (int64_t i = 0; i < n; i++) {
            float x = q[i * dim + d];
            for (int u = 0; u < w; u++) acc[i][u] += x * k[u];
        }
    }
    for (int64_t i = 0; i < n; i++)
        for (int u = 0; u < w; u++) store_vec(s + i * KEY_BLOCK + u * VEC, acc[i][u]);
}

/* score_rows with n and w constant in each call: full blocks of ROWS rows inlined apart for
 * every width (a block on the causal diagonal scores only the keys up to its last row's). */
static void scores(const float *q, int64_t n, int64_t dim, const float *keys, int w, float *s) {
    if (n != ROWS) score_rows(q, n, dim, keys, w, s);
    else if (w == 4) score_rows(q, ROWS, dim, keys, 4, s);
    else if (w == 3) score_rows(q, ROWS, dim, keys, 3, s);
    else if (w == 2) score_rows(q, ROWS, dim, keys, 2, s);
    else score_rows(q, ROWS, dim, keys, 1, s);
}

/* o[i, col:col + w·VEC] += Σ_{j < nk} p[i, j] · values[j, col:...] for i < n ≤ ROWS. */
static inline __attribute__((always_inline)) void add_values(const float *p, int64_t n,
                                                             int64_t nk, const float *values,
                                                             int64_t v_dim, int64_t col, int w,
                                                             float *o) {
    vec acc[ROWS][4];
    for (int64_t i = 0; i < n; i++)
        for (int u = 0; u < w; u++) acc[i][u] = load_vec(o + i * v_dim + col + u * VEC);
    for (int64_t j = 0; j < nk; j++) {
        vec row[4];
        for (int u = 0; u < w; u++) {
            row[u] = load_vec(values + j * v_dim + col + u * VEC);
            HOLD(row[u]);
        }
        for (int64_t i = 0; i < n; i++)
            for (int u = 0; u < w; u++) acc[i][u] += p[i * KEY_BLOCK + j] * row[u];
    }
    for (int64_t i = 0; i < n; i++)
        for (int u = 0; u < w; u++) store_vec(o + i * v_dim + col + u * VEC, acc[i][u]);
}

/* add_values over every whole group of 4 (then 1) vectors of o's columns, n constant in each
 * call (full blocks of ROWS rows inlined apart); returns the first column left over. */
static int64_t values_by_vectors(const float *p, int64_t n, int64_t nk, const float *values,
                                 int64_t v_dim, float *o) {
    int64_t c = 0;
    for (; c + 4 * VEC <= v_dim; c += 4 * VEC)
        if (n == ROWS) add_values(p, ROWS, nk, values, v_dim, c, 4, o);
        else add_values(p, n, nk, values, v_dim, c, 4, o);
    for (; c + VEC <= v_dim; c += VEC) add_values(p, n, nk, values, v_dim, c, 1, o);
    return c;
}

/* Rows [r0, r0 + n) of the tile: p = exp(s - m) over each row's first `valid[i]` keys (zero
 * past them), m, l and o updated as the block's keys join the row's softmax. */
static void softmax_rows(struct tile *t, int64_t r0, int64_t n, const int64_t *valid,
                         int64_t v_dim) {
    for (int64_t i = 0; i < n; i++) {
        int64_t r = r0 + i, cnt = valid[i];
        float *s = t->s + r * KEY_BLOCK, lane_max[VEC], block_max = -INFINITY;
        for (int c = 0; c < VEC; c++) lane_max[c] = -INFINITY;
        for (int64_t j = 0; j < cnt; j += VEC) /* lane by lane: the loop vectorizes */
            for (int c = 0; c < VEC; c++) {
                float x = j + c < cnt ? s[j + c] : -INFINITY;
                lane_max[c] = x > lane_max[c] ? x : lane_max[c];
            }
        for (int c = 0; c < VEC; c++) block_max = lane_max[c] > block_max ? lane_max[c] : block_max;
        float m = t->m[r] > block_max ? t->m[r] : block_max;
        float keep = m == t->m[r] ? 1.0f : t->m[r] == -INFINITY ? 0.0f : fast_exp(t->m[r] - m);
        float lane_sum[VEC] = {0};
        for (int64_t j = 0; j < KEY_BLOCK; j += VEC)
            for (int c = 0; c < VEC; c++) {
                float e = j + c < cnt ? fast_exp(s[j + c] - m) : 0.0f;
                s[j + c] = e, lane_sum[c] += e;
            }
        t->m[r] = m, t->l[r] = t->l[r] * keep + sum_lanes(load_vec(lane_sum));
        if (keep != 1.0f)
            for (int64_t c = 0; c < v_dim; c++) t->o[r * v_dim + c] *= keep;
    }
}

/* Keys [j0, j0 + nk) of KV head `kv` into the tile: keys transposed and scaled (columns past
 * nk zero), values as rows (rows past nk are never read). */
static void load_keys(const struct extend_attention *a, const int64_t *slots, int64_t j0,
                      int64_t nk, int64_t kv, struct tile *t) {
    for (int64_t c = 0; c < KEY_BLOCK; c++) {
        if (c >= nk) {
            for (int64_t d = 0; d < a->dim; d++) t->keys[d * KEY_BLOCK + c] = 0.0f;
            continue;
        }
        int64_t key = slots[j0 + c] * a->k_stride + kv * a->dim;
        for (int64_t d = 0; d < a->dim; d++)
            t->keys[d * KEY_BLOCK + c] = a->scale * get_act(a->type, a->k, key + d);
        widen_acts(a->type,
                   (const char *)a->v + (slots[j0 + c] * a->v_stride + kv * a->v_dim) * a->size,
                   a->v_dim, t->values + c * a->v_dim);
    }
}

/* One key block's scores, softmax and value sums for the task's `rows` rows; row r's token is
 * r / group, at position pos0 + r / group. */
static void attend_block(const struct extend_attention *a, struct tile *t, int64_t rows,
                         int64_t group, int64_t pos0, int64_t j0, int64_t nk) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        int64_t n = rows - r < ROWS ? rows - r : ROWS, valid[ROWS], used = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t cnt = pos0 + (r + i) / group - j0 + 1; /* keys j0..position */
            valid[i] = cnt < 0 ? 0 : cnt > nk ? nk : cnt;
            used = valid[i] > used ? valid[i] : used;
        }
        if (used == 0) continue; /* every key of the block lies after these rows' tokens */
        float *p = t->s + r * KEY_BLOCK, *o = t->o + r * a->v_dim;
        scores(t->q + r * a->dim, n, a->dim, t->keys, (int)((used + VEC - 1) / VEC), p);
        softmax_rows(t, r, n, valid, a->v_dim);
        /* Keys past `used` weigh zero in every row of the block: left out of the sums. */
        int64_t c = values_by_vectors(p, n, used, t->values, a->v_dim, o);
        for (int64_t i = 0; i < n; i++) /* columns past the last whole vector */
            for (int64_t col = c; col < a->v_dim; col++)
                for (int64_t j = 0; j < used; j++)
                    o[i * a->v_dim + col] += p[i * KEY_BLOCK + j] * t->values[j * a->v_dim + col];
    }
}

/* Tokens [i0, i1) of sequence b with the query heads of KV head kv. */
static void attend_task(const struct extend_attention *a, int64_t b, int64_t i0, int64_t i1,
                        int64_t kv, struct tile *t) {
    int64_t group = a->heads / a->kv_heads, rows = (i1 - i0) * group;
    const int64_t *slots = a->table + a->rows[b] * a->table_ld;
    for (int64_t r = 0; r < rows; r++) {
        int64_t q = ((a->start[b] + i0 + r / group) * a->heads + kv * group + r % group) * a->dim;
        widen_acts(a->type, (const char *)a->q + q * a->size, a->dim, t->q + r * a->dim);
        t->m[r] = -INFINITY, t->l[r] = 0.0f;
    }
    memset(t->o, 0, rows * a->v_dim * sizeof(float));
    int64_t pos0 = a->prefix[b] + i0, keys = pos0 + (i1 - i0);
    for (int64_t j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
        int64_t nk = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
        load_keys(a, slots, j0, nk, kv, t);
        attend_block(a, t, rows, group, pos0, j0, nk);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t out = ((a->start[b] + i0 + r / group) * a->heads + kv * group + r % group) *
                      a->v_dim;
        float inv = 1.0f / t->l[r], *o = t->o + r * a->v_dim;
        for (int64_t c = 0; c < a->v_dim; c++) o[c] *= inv;
        narrow_acts(a->type, o, a->v_dim, (char *)a->out + out * a->size);
    }
}

/* q [T, H, dim]; key of slot s, KV head h at element s·k_stride + h·dim of k, its value at
 * s·v_stride + h·v_dim of v; sequence b's queries are rows start[b] .. start[b] + extend[b] of
 * q, its slots table[rows[b] · table_ld + j] for j < prefix[b] + extend[b]; out [T, H, v_dim];
 * all of `type`.
 * Returns 0, SRT_OUT_OF_MEMORY, or the code of the first index check that fails (nothing
 * written then): query rows inside q, rows inside the table, prefix + extend in
 * [0, table_cols], slots below num_slots. */
int srt_extend_attention(int type, const void *q, int64_t tokens, int64_t batch, int64_t heads,
                         int64_t dim, const void *k, int64_t k_stride, const void *v,
                         int64_t v_stride, int64_t v_dim, int64_t kv_heads, const int64_t *table,
                         int64_t table_ld, int64_t table_rows, int64_t table_cols,
                         int64_t num_slots, const int64_t *rows, const int64_t *prefix,
                         const int64_t *extend, const int64_t *start, float scale, void *out) {
    struct slot_table slot_table = {table, table_ld, table_rows, table_cols, num_slots};
    struct extend_attention a = {q,      k,      v,      heads,    kv_heads, dim,
                                 v_dim,  k_stride, v_stride, table, rows,  prefix,
                                 extend, start,  table_ld, scale, out,   type,
                                 type == T_F32 ? 4 : 2};
    int64_t tasks = 0, failed = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (extend[b] < 0 || start[b] < 0 || start[b] > tokens - extend[b]) return SRT_BAD_QUERY;
        int status = prefix[b] < 0 ? SRT_BAD_LENGTH
                                   : check_sequence(&slot_table, rows[b], prefix[b] + extend[b]);
        if (status) return status;
        tasks += (extend[b] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    }
    tasks *= kv_heads;
    if (tasks == 0) return 0;
#pragma omp parallel reduction(+ : failed) if (tasks > 1)
    {
        struct tile t;
        int ok = alloc_tile(&t, TOKEN_BLOCK * (heads / kv_heads), dim, v_dim) == 0;
        failed += !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = 0, blocks = task / kv_heads, kv = task % kv_heads;
            while (blocks >= (extend[b] + TOKEN_BLOCK - 1) / TOKEN_BLOCK)
                blocks -= (extend[b++] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
            int64_t i0 = blocks * TOKEN_BLOCK;
            int64_t i1 = i0 + TOKEN_BLOCK < extend[b] ? i0 + TOKEN_BLOCK : extend[b];
            if (ok) attend_task(&a, b, i0, i1, kv, &t);
        }
        free_tile(&t);
    }
    return failed ? SRT_OUT_OF_MEMORY : 0;
}
