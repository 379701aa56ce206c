/* float32 GEMMs for CPU over weights packed in panels of PANEL output columns laid out
 * [K][PANEL] (``pack_panels`` in ops.py), run by the threads of the OpenMP runtime
 * torch itself uses: a linear layer (srt_panel_linear_f32) and the routed experts of one MoE
 * layer in one call (srt_fused_experts_f32); and RMSNorm in one pass (srt_rms_norm_f32).
 *
 * Decode gives a linear layer one row per sequence and each expert a few rows, so both are
 * bound by reading the weights: a panel is streamed once for all rows. The experts' call
 * runs in one parallel region per layer:
 *   1. route: (token, slot) pairs sorted by local expert (counting sort, stable);
 *   2. act = silu(x · W1ᵀ) · (x · W3ᵀ) for every active expert, its tokens' rows of x read in
 *      place, gate and up panels shared out among threads in pairs, so the activation is taken
 *      a block of rows at a time and neither product is written out whole;
 *   3. down = act · W2ᵀ, panels shared out as in 2;
 *   4. out[t] = Σ_slot weight · down, slots in order; pairs of other ranks' experts add nothing.
 * Every output element is a sequential sum over k whatever the number of rows, so a token's
 * result does not depend on the batch it came in (split and unsplit batches agree). */

#include "cpu_kernels.h"

/* A panel is 4 vectors wide, and a block of ROWS rows keeps ROWS × 4 accumulators and the
 * panel's row of 4 vectors in registers. */
#define PANEL (4 * VEC) /* output columns per weight panel */
#define ROWS 4          /* rows per register block */

/* The panel width the Python side packs weights for. */
int64_t srt_panel_width(void) { return PANEL; }

/* Whether this build has the vector registers the blocks are sized for (x86 with AVX2 and FMA,
 * or AVX-512); elsewhere the vectors spill and oneDNN is the faster path. */
int srt_kernel_is_fast(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* Where a GEMM's input rows lie: row i at base + (order ? order[i] / div : i) · ld (the experts'
 * first GEMM reads each token's row of x in place for every slot routed to it). */
struct rows {
    const float *base;
    int64_t ld;
    const int64_t *order;
    int64_t div;
};

static inline const float *row_at(const struct rows *x, int64_t i) {
    return x->base + (x->order ? x->order[i] / x->div : i) * x->ld;
}

/* y[i, 0:PANEL] = Σ_k x_i[k] · panel[k, 0:PANEL] for rows x_i = row_at(x, r + i), i < m ≤ ROWS:
 * the accumulators stay in registers when m is a constant (the inlined full block). `hold`
 * keeps the panel's row in registers too (full blocks, compute-bound): FMAs that each load it
 * again are load-bound. Partial blocks (decode: a few rows per expert) stream the panel from
 * memory, and there the FMAs' own loads are faster. Either way every element is the same sum
 * in the same order. */
static inline __attribute__((always_inline)) void block_gemm(const struct rows *x, int64_t r,
                                                             int64_t m, const float *panel,
                                                             int64_t k_dim, float *y, int64_t ldy,
                                                             int hold) {
    const float *in[ROWS];
    for (int64_t i = 0; i < m; i++) in[i] = row_at(x, r + i);
    vec acc[ROWS][4];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < k_dim; k++) {
        const float *w = panel + k * PANEL;
        vec w0 = load_vec(w), w1 = load_vec(w + VEC), w2 = load_vec(w + 2 * VEC),
            w3 = load_vec(w + 3 * VEC);
#if defined(__AVX__) /* x86, one register per vector */
        if (hold) __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
#endif
        for (int64_t i = 0; i < m; i++) {
            float s = in[i][k];
            acc[i][0] = fma_vec(acc[i][0], s, w0);
            acc[i][1] = fma_vec(acc[i][1], s, w1);
            acc[i][2] = fma_vec(acc[i][2], s, w2);
            acc[i][3] = fma_vec(acc[i][3], s, w3);
        }
    }
    for (int64_t i = 0; i < m; i++)
        for (int q = 0; q < 4; q++) store_vec(y + i * ldy + q * VEC, acc[i][q]);
}

/* y[r, 0:PANEL] for rows r < n of x, in blocks of ROWS rows; y rows ldy apart. */
static void panel_gemm(const struct rows *x, int64_t n, const float *panel, int64_t k_dim,
                       float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + ROWS <= n; r += ROWS) block_gemm(x, r, ROWS, panel, k_dim, y + r * ldy, ldy, 1);
    if (r < n) block_gemm(x, r, n - r, panel, k_dim, y + r * ldy, ldy, 0);
}

/* block_gemm for the first nv < 4 vectors of a narrow last panel (each element the same sum in
 * the same order as there). Kept apart: block_gemm written for any nv ran the full panels'
 * GEMMs 2-5 % slower (2048 rows × 384 → 2304 / 512 → 3072 / 1024 → 1536). */
static inline __attribute__((always_inline)) void narrow_block_gemm(
    const struct rows *x, int64_t r, int64_t m, const float *panel, int64_t k_dim, float *y,
    int64_t ldy, int hold, int nv) {
    const float *in[ROWS];
    for (int64_t i = 0; i < m; i++) in[i] = row_at(x, r + i);
    vec acc[ROWS][3];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < k_dim; k++) {
        const float *w = panel + k * PANEL;
        vec wq[3];
        for (int q = 0; q < nv; q++) {
            wq[q] = load_vec(w + q * VEC);
#if defined(__AVX__)
            if (hold) __asm__("" : "+v"(wq[q]));
#endif
        }
        for (int64_t i = 0; i < m; i++) {
            float s = in[i][k];
            for (int q = 0; q < nv; q++) acc[i][q] = fma_vec(acc[i][q], s, wq[q]);
        }
    }
    for (int64_t i = 0; i < m; i++)
        for (int q = 0; q < nv; q++) store_vec(y + i * ldy + q * VEC, acc[i][q]);
}

static inline __attribute__((always_inline)) void narrow_rows(const struct rows *x, int64_t n,
                                                              const float *panel, int64_t k_dim,
                                                              float *y, int64_t ldy, int nv) {
    int64_t r = 0;
    for (; r + ROWS <= n; r += ROWS)
        narrow_block_gemm(x, r, ROWS, panel, k_dim, y + r * ldy, ldy, 1, nv);
    if (r < n) narrow_block_gemm(x, r, n - r, panel, k_dim, y + r * ldy, ldy, 0, nv);
}

/* y[r, 0:nv·VEC] of a last panel for rows r < n: all four vectors through panel_gemm, fewer
 * through a code path of their own for each width. */
static void narrow_panel_gemm(const struct rows *x, int64_t n, const float *panel, int64_t k_dim,
                              float *y, int64_t ldy, int nv) {
    switch (nv) {
    case 1: narrow_rows(x, n, panel, k_dim, y, ldy, 1); break;
    case 2: narrow_rows(x, n, panel, k_dim, y, ldy, 2); break;
    case 3: narrow_rows(x, n, panel, k_dim, y, ldy, 3); break;
    default: panel_gemm(x, n, panel, k_dim, y, ldy); break;
    }
}

/* act[r, 0:PANEL] = silu(gate) · up for rows r < n of x, gate and up the products with two
 * panels, block by block of ROWS rows (neither is written out whole). */
static void act_gemm(const struct rows *x, int64_t n, const float *gate_panel,
                     const float *up_panel, int64_t k_dim, float *act, int64_t ld_act) {
    float gate[ROWS * PANEL], up[ROWS * PANEL];
    for (int64_t r = 0; r < n; r += ROWS) {
        int64_t m = n - r < ROWS ? n - r : ROWS;
        if (m == ROWS) {
            block_gemm(x, r, ROWS, gate_panel, k_dim, gate, PANEL, 1);
            block_gemm(x, r, ROWS, up_panel, k_dim, up, PANEL, 1);
        } else {
            block_gemm(x, r, m, gate_panel, k_dim, gate, PANEL, 0);
            block_gemm(x, r, m, up_panel, k_dim, up, PANEL, 0);
        }
        for (int64_t i = 0; i < m; i++) {
            const float *g = gate + i * PANEL, *u = up + i * PANEL;
            float *a = act + (r + i) * ld_act;
            for (int64_t j = 0; j < PANEL; j++) a[j] = g[j] / (1.0f + fast_exp(-g[j])) * u[j];
        }
    }
}

/* act = silu(x · W1ᵀ) · (x · W3ᵀ) [routed, I] for every active expert, its rows of x read in
 * place (inside a parallel region): each thread takes a contiguous share of every expert's
 * gate panels (and the matching up panels), balanced however unevenly the tokens went to
 * experts. Ends with a barrier. */
static void experts_act(const float *x, int64_t hidden, const int64_t *order, int64_t topk,
                        const float *w13, int64_t inter, const int64_t *active,
                        int64_t num_active, const int64_t *begin, const int64_t *count,
                        float *act) {
    int64_t panels = inter / PANEL, t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t a = 0; a < num_active; a++) {
        int64_t e = active[a];
        struct rows rows = {x, hidden, order + begin[e], topk};
        const float *w = w13 + e * 2 * panels * hidden * PANEL;
        for (int64_t b = t * panels / nt; b < (t + 1) * panels / nt; b++)
            act_gemm(&rows, count[e], w + b * hidden * PANEL, w + (panels + b) * hidden * PANEL,
                     hidden, act + begin[e] * inter + b * PANEL, inter);
    }
#pragma omp barrier
}

/* down = act · W2ᵀ [routed, H] for every active expert, shared out as in experts_act. */
static void experts_down(const float *act, int64_t inter, const float *w2, int64_t hidden,
                         const int64_t *active, int64_t num_active, const int64_t *begin,
                         const int64_t *count, float *down) {
    int64_t panels = hidden / PANEL, t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t a = 0; a < num_active; a++) {
        int64_t e = active[a];
        struct rows rows = {act + begin[e] * inter, inter, NULL, 1};
        for (int64_t b = t * panels / nt; b < (t + 1) * panels / nt; b++)
            panel_gemm(&rows, count[e], w2 + (e * panels + b) * inter * PANEL, inter,
                       down + begin[e] * hidden + b * PANEL, hidden);
    }
#pragma omp barrier
}

/* The (token, slot) pairs of this rank's experts, sorted by expert. */
struct routing {
    int64_t *count, *begin, *active, *order, *position; /* position[pair]: its row, or -1 */
    int64_t num_active, routed;
};

static void free_routing(struct routing *r) {
    free(r->count), free(r->begin), free(r->active), free(r->order), free(r->position);
}

/* Stable counting sort of the pairs by local expert (global id - start); -1 when out of memory. */
static int route(const int64_t *ids, int64_t pairs, int64_t start, int64_t num_experts,
                 struct routing *r) {
    r->count = calloc(num_experts, sizeof *r->count);
    r->begin = malloc(num_experts * sizeof *r->begin);
    r->active = malloc(num_experts * sizeof *r->active);
    r->order = malloc((pairs + 1) * sizeof *r->order);
    r->position = malloc((pairs + 1) * sizeof *r->position);
    if (!r->count || !r->begin || !r->active || !r->order || !r->position) return -1;
    for (int64_t p = 0, e; p < pairs; p++)
        if ((e = ids[p] - start) >= 0 && e < num_experts) r->count[e]++;
    r->num_active = r->routed = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        r->begin[e] = r->routed;
        r->routed += r->count[e];
        if (r->count[e]) r->active[r->num_active++] = e;
    }
    memset(r->count, 0, num_experts * sizeof *r->count); /* counted again while placing */
    for (int64_t p = 0, e; p < pairs; p++) {
        r->position[p] = -1;
        if ((e = ids[p] - start) >= 0 && e < num_experts) {
            r->position[p] = r->begin[e] + r->count[e]++;
            r->order[r->position[p]] = p;
        }
    }
    return 0;
}

/* out[t] = Σ_slot weight · down[row of (t, slot)], slots in order (inside a parallel region). */
static void combine(const float *down, const struct routing *r, const float *weights,
                    int64_t num_tokens, int64_t topk, int64_t hidden, float *out) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *o = out + t * hidden;
        memset(o, 0, hidden * sizeof *o);
        for (int64_t s = 0; s < topk; s++) {
            int64_t pos = r->position[t * topk + s];
            if (pos < 0) continue;
            float w = weights[t * topk + s];
            const float *d = down + pos * hidden;
            for (int64_t j = 0; j < hidden; j++) o[j] += w * d[j];
        }
    }
}

/* x [T, H]; ids, weights [T, topk] (global expert ids; this rank holds [start, start + E));
 * w13 packed [E][2I/PANEL][H][PANEL], w2 packed [E][H/PANEL][I][PANEL]; out [T, H].
 * `work` holds T·topk·(H + I) floats; the caller keeps it from call to call, because fresh
 * buffers this large are mapped anew by malloc and every first touch of a page faults.
 * Returns 0, or SRT_OUT_OF_MEMORY. */
int srt_fused_experts_f32(const float *x, int64_t num_tokens, int64_t hidden, const int64_t *ids,
                          const float *weights, int64_t topk, int64_t start, int64_t num_experts,
                          int64_t inter, const float *w13, const float *w2, float *out,
                          float *work) {
    struct routing r;
    if (route(ids, num_tokens * topk, start, num_experts, &r)) {
        free_routing(&r);
        return SRT_OUT_OF_MEMORY;
    }
    /* act [routed, I] | down [routed, H] */
    float *act = work, *down = act + r.routed * inter;
#pragma omp parallel
    {
        experts_act(x, hidden, r.order, topk, w13, inter, r.active, r.num_active, r.begin,
                    r.count, act);
        experts_down(act, inter, w2, hidden, r.active, r.num_active, r.begin, r.count, down);
        combine(down, &r, weights, num_tokens, topk, hidden, out);
    }
    free_routing(&r);
    return 0;
}

/* A linear layer (or one expert's projection): y [n, N] = x [n, K] · Wᵀ, W packed
 * [ceil(N/PANEL)][K][PANEL], the last panel's columns past N zero. The work is shared out by
 * (panel, chunk of LINEAR_CHUNK rows), panel-major: decode's few rows leave whole panels to each
 * thread, and a layer of few panels (a router's) still has every thread busy in prefill. A
 * partial last panel computes only the vectors that hold its N % PANEL columns, into a buffer of
 * its own whose first N % PANEL columns are copied out. */
#define LINEAR_CHUNK 64
void srt_panel_linear_f32(const float *x, int64_t n, int64_t k_dim, const float *panels,
                          int64_t n_dim, float *y) {
    int64_t full = n_dim / PANEL, rest = n_dim % PANEL;
    int64_t num_panels = full + (rest > 0), chunks = (n + LINEAR_CHUNK - 1) / LINEAR_CHUNK;
    int nv = (int)((rest + VEC - 1) / VEC);
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < num_panels * chunks; u++) {
        int64_t b = u / chunks, r0 = (u % chunks) * LINEAR_CHUNK;
        int64_t m = n - r0 < LINEAR_CHUNK ? n - r0 : LINEAR_CHUNK;
        struct rows rows = {x + r0 * k_dim, k_dim, NULL, 1};
        const float *panel = panels + b * k_dim * PANEL;
        if (b < full) {
            panel_gemm(&rows, m, panel, k_dim, y + r0 * n_dim + b * PANEL, n_dim);
            continue;
        }
        float last[LINEAR_CHUNK * PANEL];
        narrow_panel_gemm(&rows, m, panel, k_dim, last, PANEL, nv);
        for (int64_t i = 0; i < m; i++)
            memcpy(y + (r0 + i) * n_dim + full * PANEL, last + i * PANEL, rest * sizeof *last);
    }
}

/* RMSNorm, HF's: out = weight · h / sqrt(mean(h²) + eps) per row of `dim`, h = x (+ residual,
 * then also written to `sum_out`). Row i of x starts at (i / inner) · ld + (i % inner) · dim,
 * so the heads of a split QKV row are read where they lie; out, residual and sum_out are
 * contiguous. The sum of squares runs in VEC lanes summed in a fixed order. */
void srt_rms_norm_f32(const float *x, int64_t rows, int64_t inner, int64_t ld, int64_t dim,
                      const float *residual, float *sum_out, const float *weight, float eps,
                      float *out) {
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
    for (int64_t i = 0; i < rows; i++) {
        const float *h = x + (i / inner) * ld + (i % inner) * dim;
        if (residual) {
            float *s = sum_out + i * dim;
            for (int64_t j = 0; j < dim; j++) s[j] = h[j] + residual[i * dim + j];
            h = s;
        }
        vec acc = {0};
        int64_t j = 0;
        for (; j + VEC <= dim; j += VEC) {
            vec v = load_vec(h + j);
            acc += v * v;
        }
        float sum = sum_lanes(acc);
        for (; j < dim; j++) sum += h[j] * h[j];
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        float *o = out + i * dim;
        for (j = 0; j < dim; j++) o[j] = weight[j] * (h[j] * scale);
    }
}
