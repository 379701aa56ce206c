/* What the CPU kernels' C files share: the functions they export (called from Python through
 * ctypes, each declared there with the same types: build.py, checked by a test), the attention
 * kernels' index checks, the vector type (one register), the sum of its lanes and a
 * vectorizable exp. */

#ifndef SRT_CPU_KERNELS_H
#define SRT_CPU_KERNELS_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* The exported functions. Each returns 0, or one of the codes below; none writes its output
 * before its index checks pass. Where the arguments are described: in the C file of each.
 * `act` and `type` are tensor formats: every kernel takes float32 or bfloat16 activations
 * (and KV cache) (ACT_TYPES in checks.py), the GEMMs weights of any of the three
 * (WEIGHT_TYPES). */
int64_t srt_panel_width(void);
int srt_kernel_is_fast(void);
int srt_amx(int mode);
void srt_panel_linear(int act, const void *x, int64_t n, int64_t k_dim, int type,
                      const void *panels, const float *scale, int64_t group, int64_t n_dim,
                      void *y, float *work);
int srt_fused_experts(int act, const void *x, int64_t num_tokens, int64_t hidden,
                      const int64_t *ids, const float *weights, int64_t topk, int64_t start,
                      int64_t num_experts, int64_t inter, int type, const void *w13,
                      const float *scale13, int64_t group13, const void *w2,
                      const float *scale2, int64_t group2, void *out, float *work);
void srt_rms_norm(int type, const void *x, int64_t rows, int64_t inner, int64_t ld, int64_t dim,
                  const void *residual, void *sum_out, const void *weight, float eps, void *out);
int srt_decode_attention(int type, const void *q, int64_t batch, int64_t heads, int64_t dim,
                         const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                         int64_t v_dim, int64_t kv_heads, const int64_t *table, int64_t table_ld,
                         int64_t table_rows, int64_t table_cols, int64_t num_slots,
                         const int64_t *rows, const int64_t *lens, float scale, void *out);
int srt_extend_attention(int type, const void *q, int64_t tokens, int64_t batch, int64_t heads,
                         int64_t dim, const void *k, int64_t k_stride, const void *v,
                         int64_t v_stride, int64_t v_dim, int64_t kv_heads, const int64_t *table,
                         int64_t table_ld, int64_t table_rows, int64_t table_cols,
                         int64_t num_slots, const int64_t *rows, const int64_t *prefix,
                         const int64_t *extend, const int64_t *start, float scale, void *out);
int srt_rope(int type, const void *x, int64_t tokens, int64_t heads, int64_t ld_token,
             int64_t ld_head, int64_t rot, const int64_t *positions, const float *cos_sin,
             int64_t rows, int neox, void *out);
void srt_select_experts(int act, const void *logits, int64_t tokens, int64_t experts, int64_t ld,
                        const float *bias, int sigmoid, int64_t top_k, int64_t groups,
                        int64_t topk_group, int renormalize, float scaling, float *weights,
                        int64_t *ids, int64_t *counts, int64_t *window);
int srt_store_kv(int type, int64_t tokens, const int64_t *loc, int64_t num_slots, const void *k,
                 int64_t k_ld, int64_t k_row, void *k_cache, int64_t k_stride, const void *v,
                 int64_t v_ld, int64_t v_row, void *v_cache, int64_t v_stride);
int64_t srt_program_op(const char *name, int64_t *args);
int srt_run(const int64_t *program, int64_t length, int64_t *failed);

/* A parallel region of the kernels' own threads (cpu_pool.c): team_run calls fn(arg, team) on
 * each of a team's threads, the calling one among them, and returns when all have; on one
 * thread where `parallel` is 0 or torch runs one. Within it, team_barrier waits for the whole
 * team, and team_share gives a thread its contiguous share of n items (a static schedule). */
struct team {
    int t, nt; /* this thread's index, the team's size */
    int omp;   /* run on OpenMP's threads (see cpu_pool.c) */
};
typedef void (*team_fn)(void *arg, const struct team *team);
void team_run(team_fn fn, void *arg, int64_t parallel);
void team_barrier(const struct team *team);

static inline void team_share(const struct team *team, int64_t n, int64_t *lo, int64_t *hi) {
    *lo = n * team->t / team->nt;
    *hi = n * (team->t + 1) / team->nt;
}

/* The exported functions' error codes (their Python callers raise on them). */
#define SRT_OUT_OF_MEMORY (-1) /* a buffer of the kernel's own could not be allocated */
#define SRT_BAD_ROW (-2)       /* a sequence's row outside the request-to-token table */
#define SRT_BAD_LENGTH (-3)    /* a sequence longer than its row (or, decode, empty) */
#define SRT_BAD_SLOT (-4)      /* a slot outside the KV cache */
#define SRT_BAD_QUERY (-5)     /* extend: a sequence's query rows outside q */
#define SRT_BAD_POSITION (-6)  /* rope: a position outside the cos/sin table */
#define SRT_BAD_INDEX (-7)     /* a program's gather: an index outside the table */

/* The request-to-token table as the attention kernels read it: `rows` × `cols` slots, row r at
 * table + r · ld, every slot below `slots` (the KV cache's size). */
struct slot_table {
    const int64_t *table;
    int64_t ld, rows, cols, slots;
};

/* Whether a sequence's row and its first `len` slots lie inside the table and the cache. */
static inline int check_sequence(const struct slot_table *t, int64_t row, int64_t len) {
    if (row < 0 || row >= t->rows) return SRT_BAD_ROW;
    if (len < 0 || len > t->cols) return SRT_BAD_LENGTH;
    const int64_t *slots = t->table + row * t->ld;
    for (int64_t j = 0; j < len; j++)
        if (slots[j] < 0 || slots[j] >= t->slots) return SRT_BAD_SLOT;
    return 0;
}

/* A vector is one register: 16 floats with AVX-512, else 8 (AVX2, NEON pairs...). */
#ifdef __AVX512F__
#define VEC 16
#else
#define VEC 8
#endif

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

/* The GEMMs' weight panels are 4 vectors wide, and a block of ROWS rows keeps ROWS × 4
 * accumulators and the panel's row of 4 vectors in registers (cpu_kernels.c). */
#define PANEL (4 * VEC) /* output columns per weight panel */
#define ROWS 4          /* rows per register block */

/* The bf16 × bf16 GEMMs on AMX's tiles (cpu_amx.c): amx_usable says whether they run here for
 * a K of k_dim; amx_panel_gemm computes y[i, 0:PANEL] = a_i · panel for n rows a_i = a + i · lda;
 * `rows` is a thread's tile state within a region (0 at its start), amx_end releases it. */
int amx_usable(int64_t k_dim);
void amx_panel_gemm(int *rows, const uint16_t *a, int64_t lda, int64_t n,
                    const uint16_t *panel, int64_t k_dim, float *y, int64_t ldy);
void amx_end(int *rows);
/* The first block of m ≤ 16 rows of amx_panel_gemm over K = k_dim ≤ 256, its panel's pairs
 * written by `fill` 32 k at a time (fill(arg, k, k + 32) writes pair rows k/2 .. of `pairs`)
 * just before the tiles read them, so that the writing and the tiles' work overlap; the sums
 * are amx_panel_gemm's, bit for bit (cpu_fp8_dot.h converts fp8 so). */
typedef void (*amx_fill)(void *arg, int64_t k0, int64_t k1);
void amx_first_block(int *rows, int m, float *y, int64_t ldy, amx_fill fill, void *arg,
                     const uint16_t *a, int64_t lda, const uint16_t *pairs, int64_t k_dim);

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* acc + s·w as one fused multiply-add, always: left to the compiler, `acc += s * w` is fused in
 * some inlined copies of a loop and not in others (seen with AVX2 for a narrow panel's partial
 * row blocks), and a row's result would then depend on the block it was computed in. */
static inline vec fma_vec(vec acc, float s, vec w) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)w, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)w, (__m256)acc);
#else
    return acc + s * w;
#endif
}

/* The tensor formats (ACT_TYPES and WEIGHT_TYPES in checks.py), and T_FP8_DOT: a GEMM of fp8
 * weights over bf16 activations on dot products (cpu_fp8_dot.h; a GEMM type, not a format). */
enum { T_F32 = 0, T_BF16 = 1, T_FP8 = 2, T_FP8_DOT = 3 };
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && VEC == 16
#define FP8_DOT 1
#else
#define FP8_DOT 0
#endif

/* The GEMM type for weights of `type` under activations of `act`: T_FP8_DOT where fp8 weights
 * meet bf16 activations and the build has the dot products, else the weights' own. */
static inline int gemm_type(int act, int type) {
    return FP8_DOT && act == T_BF16 && type == T_FP8 ? T_FP8_DOT : type;
}

typedef uint32_t uvec __attribute__((vector_size(VEC * sizeof(uint32_t))));
typedef uint16_t bf16vec __attribute__((vector_size(VEC * sizeof(uint16_t))));

/* VEC bf16 values from p, each in the low half of a 32-bit lane. */
static inline uvec widen_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (uvec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (uvec)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    bf16vec h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, uvec);
#endif
}

/* Activations of `type` (T_F32 or T_BF16) as float32: bf16 is float32's upper half, so it
 * widens exactly; a float32 is narrowed to bf16 rounding to nearest, ties to even (NaN kept
 * quiet), as torch's conversion rounds. Called with a constant type in the inlined loops. */
static inline __attribute__((always_inline)) float get_act(int type, const void *p, int64_t i) {
    if (type == T_F32) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) void put_act(int type, void *p, int64_t i,
                                                          float v) {
    if (type == T_F32) {
        ((float *)p)[i] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x00400000u; /* NaN: stays a NaN */
    else bits += 0x7fffu + ((bits >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

/* VEC activations from element i of p, as float32. */
static inline __attribute__((always_inline)) vec load_act(int type, const void *p, int64_t i) {
    if (type == T_F32) return load_vec((const float *)p + i);
    uvec bits = widen_bf16((const uint16_t *)p + i) << 16;
    vec f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* v rounded to bf16's precision (``put_act``), as a float32. */
static inline float to_bf16(float v) {
    uint16_t b;
    put_act(T_BF16, &b, 0, v);
    return get_act(T_BF16, &b, 0);
}

/* v rounded to bf16's precision lane by lane (as ``put_act``), as float32. */
static inline vec round_bf16(vec v) {
    uvec bits;
    memcpy(&bits, &v, sizeof bits);
    uvec nan = (uvec)((bits & 0x7fffffffu) > 0x7f800000u);
    uvec rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    bits = (((bits | 0x00400000u) & nan) | (rounded & ~nan)) & 0xffff0000u;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* VEC float32 values into activations of `type` from element i of p (bf16: ``round_bf16``). */
static inline __attribute__((always_inline)) void store_act(int type, void *p, int64_t i, vec v) {
    if (type == T_F32) {
        store_vec((float *)p + i, v);
        return;
    }
    uvec bits;
    v = round_bf16(v);
    memcpy(&bits, &v, sizeof bits);
    bf16vec half = __builtin_convertvector(bits >> 16, bf16vec);
    memcpy((uint16_t *)p + i, &half, sizeof half);
}

/* n activations from p into float32 dst, and n float32 from src out as activations. */
static inline void widen_acts(int type, const void *p, int64_t n, float *dst) {
    if (type == T_F32) memcpy(dst, p, n * sizeof *dst);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = get_act(T_BF16, p, i);
}

static inline void narrow_acts(int type, const float *src, int64_t n, void *p) {
    if (type == T_F32) {
        memcpy(p, src, n * sizeof *src);
        return;
    }
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) store_act(T_BF16, p, i, load_vec(src + i));
    for (; i < n; i++) put_act(T_BF16, p, i, src[i]);
}

/* acc + a·b lane by lane as one fused multiply-add (as fma_vec, for a vector a). */
static inline vec fma_vv(vec acc, vec a, vec b) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* The sum of a vector's lanes, in a fixed order: halves added pairwise (shuffles on x86). */
static inline float sum_lanes(vec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float lanes[VEC], sum = 0.0f;
    memcpy(lanes, &v, sizeof lanes);
    for (int q = 0; q < VEC; q++) sum += lanes[q];
    return sum;
#endif
}

/* e^v for v in [-87, 88] (clamped outside): range reduction to 2^m · e^r with |r| ≤ ln2/2 and
 * a degree-6 Taylor polynomial (relative error about 1e-7), written so that loops calling it
 * vectorize: libm's scalar expf would cost as much as the GEMMs around it. */
static inline float fast_exp(float v) {
    v = v < 88.0f ? v : 88.0f;
    v = v > -87.0f ? v : -87.0f;
    float m = (v * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = v - m * 0.693359375f + m * 2.12194440e-4f;       /* v - m·ln2, two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (
                  1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = ((int32_t)m + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The GEMMs' weights and input rows (cpu_kernels.c), shared with the experts' kernel
 * (cpu_experts.c). */
/* A packed weight: panels [ceil(N/PANEL)][K][PANEL] of `type`; for fp8, `scale` holds per panel
 * ceil(K/group) rows of PANEL scales. For the other types `group` is K (one group). */
struct weights {
    const void *w;
    const float *scale;
    int64_t k_dim, group;
    int type;
};

/* Panel b of a packed weight. */
struct panel {
    const void *w;
    const float *scale;
    int64_t group;
};

static inline struct panel panel_at(const struct weights *W, int64_t b) {
    static const int64_t size[] = {4, 2, 1};
    int64_t groups = (W->k_dim + W->group - 1) / W->group;
    struct panel p = {(const char *)W->w + b * W->k_dim * PANEL * size[W->type],
                      W->scale ? W->scale + b * groups * PANEL : NULL, W->group};
    return p;
}

/* Where a GEMM's input rows lie: row i at base + (order ? order[i] / div : i) · ld (the experts'
 * first GEMM reads each token's row of x in place for every slot routed to it). */
struct rows {
    const float *base;
    int64_t ld;
    const int64_t *order;
    int64_t div;
};

/* fp8 panels under bf16 activations on AMX's tiles, each group of k as bf16 (cpu_fp8_dot.h):
 * fp8_amx_usable says whether they run here for a K of k_dim in groups of `group`;
 * fp8_amx_gemm computes y[i, 0:PANEL] = a_i · panel for m bf16 rows a_i = a + i · lda. */
int fp8_amx_usable(int64_t k_dim, int64_t group);
void fp8_amx_gemm(int *tiles, const uint16_t *a, int64_t lda, int64_t m, struct panel p,
                  int64_t k_dim, float *y, int64_t ldy);

/* y[r, 0:nv·VEC] for rows r < n of x times panel p of a weight of `type` (cpu_kernels.c). */
void panel_gemm(const struct rows *x, int64_t n, struct panel p, int64_t k_dim, float *y,
                int64_t ldy, int nv, int type);

/* n activations of `type` widened into float32 dst, or float32 src narrowed into n activations,
 * by every thread of a team (each ends with a barrier). */
void widen_shared(const struct team *team, int type, const void *p, int64_t n, float *dst);
void narrow_shared(const struct team *team, int type, const float *src, int64_t n, void *p);

#endif
