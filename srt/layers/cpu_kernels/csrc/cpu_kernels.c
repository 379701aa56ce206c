/* GEMMs for CPU over weights packed in panels of PANEL output columns laid out [K][PANEL]
 * (``pack_panels`` in ops.py), run by the kernels' own team of threads (cpu_pool.c): a
 * linear layer (srt_panel_linear; the routed experts' call, srt_fused_experts, is in
 * cpu_experts.c) and RMSNorm in one pass (srt_rms_norm, float32 or bf16 activations).
 *
 * The GEMMs' activations and sums are float32. Weights are float32, bfloat16 or block-FP8 (e4m3
 * with a float32 scale per row and group of K rows of a panel, ``srt.layers.quantization.fp8``);
 * a bf16 or fp8 weight is turned into float32 in registers as it is read: bf16 (stored in pairs
 * along k, add_products_bf16) gives the float32 GEMM over the widened weight bit for bit, fp8
 * (load_w) sums each group's raw values and scales the group's sum (block_gemm), at a half or a
 * quarter of float32's bytes.
 *
 * Decode gives a linear layer one row per sequence and each expert a few rows, so both are
 * bound by reading the weights: a panel is streamed once for all rows. Every output element is
 * the same sequence of sums over k whatever the number of rows, so a row's result does not
 * depend on the batch it came in (split and unsplit batches agree). bf16 activations over bf16
 * weights run on AMX's tiles instead where the CPU has them (cpu_amx.c). */

#include "cpu_kernels.h"

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

/* VEC e4m3 bytes from p as float32, each the byte's value · 2^-8 exactly. A byte sign-extended
 * to 16 bits and shifted left by 7 holds the sign in bit 15 and the exponent and mantissa in
 * fp16's bits 7-13: an fp16 of the e4m3 value · 2^-8 (fp16's exponent bias is 15, e4m3's 7;
 * e4m3 subnormals become fp16 subnormals), which the F16C conversion widens exactly. The
 * float32 results lie far from float32's subnormal range. An earlier layout moved the e4m3
 * fields straight into float32's (the value · 2^-120): its products of small activations with
 * small weights were float32 subnormals, which lose digits and take x86's slow assists (a
 * 1536 × 1024 weight of values near 0.05 at scale 1, one row, one thread: 3.5 ms against 0.26
 * ms now). block_gemm multiplies a group's sums by its scale · 2^8 (``pack_scales``). */
static inline vec widen_fp8(const int8_t *p) {
#if defined(__AVX512F__)
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
    return (vec)_mm512_cvtph_ps(h);
#elif defined(__AVX2__) && defined(__F16C__)
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xbf80));
    return (vec)_mm256_cvtph_ps(h);
#else /* the fields into float32's (the value · 2^-120, subnormals exact), then · 2^112 */
    vec f;
    for (int q = 0; q < VEC; q++) {
        uint32_t bits = ((uint32_t)(int32_t)p[q] << 20) & 0x87f00000u;
        memcpy(&f[q], &bits, sizeof bits);
    }
    return f * 0x1p112f;
#endif
}

/* VEC weights from element `idx` of a float32 or fp8 panel, as float32: e4m3 to its value ·
 * 2^-8 (``widen_fp8``). bf16 panels are read in pairs (add_products_bf16). */
static inline __attribute__((always_inline)) vec load_w(int type, const void *w, int64_t idx) {
    if (type == T_F32) return load_vec((const float *)w + idx);
    return widen_fp8((const int8_t *)w + idx);
}

static inline const float *row_at(const struct rows *x, int64_t i) {
    return x->base + (x->order ? x->order[i] / x->div : i) * x->ld;
}

#include "cpu_fp8_dot.h"

/* add_products for a bf16 panel, which holds its weights in pairs along k ([K/2][PANEL][2],
 * ``pack_panels``, as AMX reads them): a 32-bit lane holds column j's weights at k (low half)
 * and k + 1 (high half), each a float32 once in the upper half. k0 and k1 are even; each
 * element's sums run over k in order, as for the other types. */
static inline __attribute__((always_inline)) void add_products_bf16(const float *const *in,
                                                                    int64_t m, struct panel p,
                                                                    int64_t k0, int64_t k1,
                                                                    int hold, int nv,
                                                                    vec sums[ROWS][4]) {
    for (int64_t k = k0; k < k1; k += 2) {
        for (int q = 0; q < nv; q++) {
            uvec pair;
            memcpy(&pair, (const uint16_t *)p.w + k * PANEL + q * 2 * VEC, sizeof pair);
            vec even = (vec)(pair << 16), odd = (vec)(pair & 0xffff0000u);
#if defined(__AVX__) /* x86, one register per vector */
            if (hold) __asm__("" : "+v"(even), "+v"(odd));
#endif
            for (int64_t i = 0; i < m; i++) sums[i][q] = fma_vec(sums[i][q], in[i][k], even);
            for (int64_t i = 0; i < m; i++) sums[i][q] = fma_vec(sums[i][q], in[i][k + 1], odd);
        }
    }
}

/* sums[i, 0:nv·VEC] += Σ_{k0 ≤ k < k1} x_i[k] · panel[k, 0:nv·VEC] for rows x_i = in[i],
 * i < m ≤ ROWS, nv ≤ 4 vectors of the panel: the sums stay in registers when m, nv and type
 * are constants (the inlined copies). `hold` keeps the panel's row in registers too (full
 * blocks, compute-bound): FMAs that each load it again are load-bound. Partial blocks (decode:
 * a few rows per expert) stream the panel from memory, and there the FMAs' own loads are
 * faster. Either way every element is the same sum in the same order. */
static inline __attribute__((always_inline)) void add_products(const float *const *in,
                                                               int64_t m, struct panel p,
                                                               int64_t k0, int64_t k1,
                                                               int hold, int nv, int type,
                                                               vec sums[ROWS][4]) {
    if (type == T_BF16) {
        add_products_bf16(in, m, p, k0, k1, hold, nv, sums);
        return;
    }
    for (int64_t k = k0; k < k1; k++) {
        vec w[4];
        for (int q = 0; q < nv; q++) {
            w[q] = load_w(type, p.w, k * PANEL + q * VEC);
#if defined(__AVX__) /* x86, one register per vector */
            if (hold) __asm__("" : "+v"(w[q]));
#endif
        }
        for (int64_t i = 0; i < m; i++) {
            float xi = in[i][k];
            for (int q = 0; q < nv; q++) sums[i][q] = fma_vec(sums[i][q], xi, w[q]);
        }
    }
}

/* y[i, 0:nv·VEC] = x_i · panel[:, 0:nv·VEC] for rows x_i = row_at(x, r + i), i < m ≤ ROWS.
 * float32 and bf16: one sum over k. fp8: a sum per group of the raw e4m3 values (load_w), each
 * multiplied by the group's scales and added in group order: the scale costs one FMA per group
 * rather than a product per weight. Every element is the same sums in the same order whatever
 * the rows of its block, so a row's result does not depend on the batch it came in. */
static inline __attribute__((always_inline)) void block_gemm(const struct rows *x, int64_t r,
                                                             int64_t m, struct panel p,
                                                             int64_t k_dim, float *y, int64_t ldy,
                                                             int hold, int nv, int type) {
    const float *in[ROWS] = {0};
    for (int64_t i = 0; i < m; i++) in[i] = row_at(x, r + i);
    vec acc[ROWS][4];
    memset(acc, 0, sizeof acc);
    if (type != T_FP8) add_products(in, m, p, 0, k_dim, hold, nv, type, acc);
    for (int64_t k0 = 0, g = 0; type == T_FP8 && k0 < k_dim; k0 += p.group, g++) {
        vec part[ROWS][4], s[4];
        memset(part, 0, sizeof part);
        add_products(in, m, p, k0, k0 + p.group < k_dim ? k0 + p.group : k_dim, hold, nv, type,
                     part);
        for (int q = 0; q < nv; q++) s[q] = load_vec(p.scale + g * PANEL + q * VEC);
        for (int64_t i = 0; i < m; i++)
            for (int q = 0; q < nv; q++) acc[i][q] = fma_vv(acc[i][q], part[i][q], s[q]);
    }
    for (int64_t i = 0; i < m; i++)
        for (int q = 0; q < nv; q++) store_vec(y + i * ldy + q * VEC, acc[i][q]);
}

/* y[r, 0:nv·VEC] for rows r < n of x, in blocks of ROWS rows; y rows ldy apart. */
static inline __attribute__((always_inline)) void panel_rows(const struct rows *x, int64_t n,
                                                             struct panel p, int64_t k_dim,
                                                             float *y, int64_t ldy, int nv,
                                                             int type) {
    int64_t r = 0;
    for (; r + ROWS <= n; r += ROWS)
        block_gemm(x, r, ROWS, p, k_dim, y + r * ldy, ldy, 1, nv, type);
    if (r < n) block_gemm(x, r, n - r, p, k_dim, y + r * ldy, ldy, 0, nv, type);
}

/* One copy of the GEMMs per weight type and panel width, chosen at run time: the type and the
 * number of vectors must be constants inside for the blocks to stay in registers. */
#define PANEL_GEMM(type)                                                                        \
    static void panel_gemm_##type(const struct rows *x, int64_t n, struct panel p,            \
                                  int64_t k_dim, float *y, int64_t ldy, int nv) {             \
        switch (nv) {                                                                           \
        case 1: panel_rows(x, n, p, k_dim, y, ldy, 1, type); break;                             \
        case 2: panel_rows(x, n, p, k_dim, y, ldy, 2, type); break;                             \
        case 3: panel_rows(x, n, p, k_dim, y, ldy, 3, type); break;                             \
        default: panel_rows(x, n, p, k_dim, y, ldy, 4, type); break;                            \
        }                                                                                       \
    }
PANEL_GEMM(T_F32)
PANEL_GEMM(T_BF16)
PANEL_GEMM(T_FP8)

/* y[r, 0:nv·VEC] for rows r < n of x times panel p of a weight of `type` (nv = 4: the whole
 * panel; fewer: a narrow last panel, whose vectors past nv are not computed). */
void panel_gemm(const struct rows *x, int64_t n, struct panel p, int64_t k_dim, float *y,
                int64_t ldy, int nv, int type) {
    if (type == T_BF16) panel_gemm_T_BF16(x, n, p, k_dim, y, ldy, nv);
    else if (type == T_FP8) panel_gemm_T_FP8(x, n, p, k_dim, y, ldy, nv);
#if FP8_DOT
    else if (type == T_FP8_DOT && p.group <= FP8_DOT_MAX_GROUP)
        fp8_dot_gemm(x, n, p, k_dim, y, ldy, nv);
    else if (type == T_FP8_DOT) panel_gemm_T_FP8(x, n, p, k_dim, y, ldy, nv);
#endif
    else panel_gemm_T_F32(x, n, p, k_dim, y, ldy, nv);
}

/* n activations of `type` widened into float32 dst, or float32 src narrowed into n activations,
 * shared out among a team's threads in chunks of 4096 (every thread calls; each ends with a
 * barrier). */
void widen_shared(const struct team *team, int type, const void *p, int64_t n,
                         float *dst) {
    int64_t size = type == T_F32 ? 4 : 2, lo, hi;
    team_share(team, (n + 4095) / 4096, &lo, &hi);
    for (int64_t c = lo * 4096; c < hi * 4096 && c < n; c += 4096)
        widen_acts(type, (const char *)p + c * size, n - c < 4096 ? n - c : 4096, dst + c);
    team_barrier(team);
}

void narrow_shared(const struct team *team, int type, const float *src, int64_t n,
                          void *p) {
    int64_t size = type == T_F32 ? 4 : 2, lo, hi;
    team_share(team, (n + 4095) / 4096, &lo, &hi);
    for (int64_t c = lo * 4096; c < hi * 4096 && c < n; c += 4096)
        narrow_acts(type, src + c, n - c < 4096 ? n - c : 4096, (char *)p + c * size);
    team_barrier(team);
}

/* A linear layer (or one expert's projection): y [n, N] = x [n, K] · Wᵀ, W packed
 * [ceil(N/PANEL)][K][PANEL] of `type` (fp8: with its scales [ceil(N/PANEL)][ceil(K/group)]
 * [PANEL], else NULL), the last panel's columns past N zero; x and y float32 or bf16 (`act`:
 * bf16 is widened into `work`, n·(K + N) floats, and the float32 product narrowed from it).
 * The work is shared out by (panel, chunk of LINEAR_CHUNK rows), panel-major: decode's few
 * rows leave whole panels to each thread, and a layer of few panels (a router's) still has
 * every thread busy in prefill. A partial last panel computes only the vectors that hold its
 * N % PANEL columns, into a buffer of its own whose first N % PANEL columns are copied out. */
#define LINEAR_CHUNK 64

/* srt_panel_linear's arguments as its region reads them. */
struct linear_call {
    int act;
    const void *x;
    float *xf;
    int64_t n, k_dim;
    int type, amx; /* amx: bf16 rows of x times bf16 (or fp8, as bf16) panels on AMX's tiles */
    const struct weights *W;
    int64_t n_dim, full, rest, chunks;
    int nv;
    float *yf;
    void *y;
};

/* AMX: rows r0 .. r0 + m of y (bf16) from panel b, through float32 sums that stay in cache
 * (no float32 copy of y is written). */
static void linear_tiles(const struct linear_call *c, int64_t b, int64_t r0, int64_t m,
                         int *tiles) {
    float sums[LINEAR_CHUNK * PANEL];
    int64_t cols = b < c->full ? PANEL : c->rest, k_dim = c->k_dim;
    const uint16_t *x = c->x;
#if FP8_DOT
    if (c->type == T_FP8) /* through bf16 pairs of each group (cpu_fp8_dot.h) */
        fp8_amx_gemm(tiles, x + r0 * k_dim, k_dim, m, panel_at(c->W, b), k_dim, sums, PANEL);
    else
#endif
        amx_panel_gemm(tiles, x + r0 * k_dim, k_dim, m, panel_at(c->W, b).w, k_dim, sums, PANEL);
    for (int64_t i = 0; i < m; i++)
        narrow_acts(T_BF16, sums + i * PANEL, cols,
                    (uint16_t *)c->y + (r0 + i) * c->n_dim + b * PANEL);
}

/* y[i, :] for m rows of x from r0 times panel b on FMAs (float32 y; a partial last panel
 * through a buffer of its own). */
static void linear_rows(const struct linear_call *c, int64_t b, int64_t r0, int64_t m) {
    struct panel p = panel_at(c->W, b);
    struct rows rows = {c->xf + r0 * c->k_dim, c->k_dim, NULL, 1};
    if (b < c->full) {
        panel_gemm(&rows, m, p, c->k_dim, c->yf + r0 * c->n_dim + b * PANEL, c->n_dim, 4,
                   gemm_type(c->act, c->type));
        return;
    }
    float last[LINEAR_CHUNK * PANEL];
    panel_gemm(&rows, m, p, c->k_dim, last, PANEL, c->nv, gemm_type(c->act, c->type));
    for (int64_t i = 0; i < m; i++)
        memcpy(c->yf + (r0 + i) * c->n_dim + c->full * PANEL, last + i * PANEL,
               c->rest * sizeof *last);
}

static void linear_region(void *arg, const struct team *team) {
    const struct linear_call *c = arg;
    int64_t n = c->n, lo, hi;
    int tiles = 0;
    if (c->act != T_F32 && !c->amx) widen_shared(team, c->act, c->x, n * c->k_dim, c->xf);
    team_share(team, (c->full + (c->rest > 0)) * c->chunks, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        int64_t b = u / c->chunks, r0 = (u % c->chunks) * LINEAR_CHUNK;
        int64_t m = n - r0 < LINEAR_CHUNK ? n - r0 : LINEAR_CHUNK;
        if (c->amx) linear_tiles(c, b, r0, m, &tiles);
        else linear_rows(c, b, r0, m);
    }
    amx_end(&tiles);
    if (c->act != T_F32 && !c->amx) {
        team_barrier(team);
        narrow_shared(team, c->act, c->yf, n * c->n_dim, c->y);
    }
}

void srt_panel_linear(int act, const void *x, int64_t n, int64_t k_dim, int type,
                      const void *panels, const float *scale, int64_t group, int64_t n_dim,
                      void *y, float *work) {
    struct weights W = {panels, scale, k_dim, scale ? group : k_dim, type};
    int64_t full = n_dim / PANEL, rest = n_dim % PANEL;
    int64_t chunks = (n + LINEAR_CHUNK - 1) / LINEAR_CHUNK;
    int nv = (int)((rest + VEC - 1) / VEC);
    int amx = act == T_BF16 && type == T_BF16 && amx_usable(k_dim);
    amx = amx || (act == T_BF16 && type == T_FP8 && scale && fp8_amx_usable(k_dim, group));
    float *xf = (float *)x, *yf = y;
    if (act != T_F32) xf = work, yf = work + n * k_dim;
    struct linear_call c = {act, x, xf, n, k_dim, type, amx, &W, n_dim, full, rest, chunks, nv,
                            yf, y};
    team_run(linear_region, &c, 1);
}

/* One row of RMSNorm in activations of `type`: h = x (+ residual, rounded to the type and
 * written to sum_out) widened into `h`, then out = weight · (h · scale) with the normalized
 * value rounded to the type before the product, as HF's norm in bf16 rounds it. */
static inline __attribute__((always_inline)) void norm_row(int type, const void *x,
                                                           const void *residual, void *sum_out,
                                                           const void *weight, float eps,
                                                           int64_t dim, float *h, void *out) {
    int64_t j = 0;
    for (; j + VEC <= dim; j += VEC) {
        vec v = load_act(type, x, j);
        if (residual) {
            v += load_act(type, residual, j);
            if (type == T_BF16) v = round_bf16(v);
            store_act(type, sum_out, j, v);
        }
        store_vec(h + j, v);
    }
    for (; j < dim; j++) {
        h[j] = get_act(type, x, j);
        if (residual) {
            put_act(type, sum_out, j, h[j] + get_act(type, residual, j));
            h[j] = get_act(type, sum_out, j);
        }
    }
    vec acc = {0};
    for (j = 0; j + VEC <= dim; j += VEC) {
        vec v = load_vec(h + j);
        acc += v * v;
    }
    float sum = sum_lanes(acc);
    for (; j < dim; j++) sum += h[j] * h[j];
    float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (j = 0; j + VEC <= dim; j += VEC) {
        vec normed = load_vec(h + j) * scale;
        if (type == T_BF16) normed = round_bf16(normed);
        store_act(type, out, j, load_act(type, weight, j) * normed);
    }
    for (; j < dim; j++) {
        float normed = h[j] * scale;
        if (type == T_BF16) normed = to_bf16(normed);
        put_act(type, out, j, get_act(type, weight, j) * normed);
    }
}

/* RMSNorm, HF's: out = weight · h / sqrt(mean(h²) + eps) per row of `dim`, h = x (+ residual,
 * then also written to `sum_out`), in float32 over activations of `type` (weight too). Row i
 * of x starts at (i / inner) · ld + (i % inner) · dim elements, so the heads of a split QKV row
 * are read where they lie; out, residual and sum_out are contiguous. The sum of squares runs
 * in VEC lanes summed in a fixed order. */
struct norm_call {
    int type;
    const void *x;
    int64_t rows, inner, ld, dim;
    const void *residual;
    void *sum_out;
    const void *weight;
    float eps;
    void *out;
};

static void norm_region(void *arg, const struct team *team) {
    const struct norm_call *c = arg;
    int64_t size = c->type == T_F32 ? 4 : 2, dim = c->dim, lo, hi;
    team_share(team, c->rows, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        float h[dim];
        int64_t at = (i / c->inner) * c->ld + (i % c->inner) * dim;
        const char *row = (const char *)c->x + at * size;
        const char *res = c->residual ? (const char *)c->residual + i * dim * size : NULL;
        char *sum = c->sum_out ? (char *)c->sum_out + i * dim * size : NULL;
        char *o = (char *)c->out + i * dim * size;
        if (c->type == T_F32) norm_row(T_F32, row, res, sum, c->weight, c->eps, dim, h, o);
        else norm_row(T_BF16, row, res, sum, c->weight, c->eps, dim, h, o);
    }
}

void srt_rms_norm(int type, const void *x, int64_t rows, int64_t inner, int64_t ld, int64_t dim,
                  const void *residual, void *sum_out, const void *weight, float eps, void *out) {
    struct norm_call c = {type, x, rows, inner, ld, dim, residual, sum_out, weight, eps, out};
    team_run(norm_region, &c, rows * dim >= (1 << 16));
}
