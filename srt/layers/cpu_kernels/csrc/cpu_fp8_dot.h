/* fp8 weights times bf16 activations as bf16 weights, for the GEMMs of cpu_kernels.c (included
 * there only; cpu_experts.c calls fp8_amx_gemm): on AMX's tiles where the CPU has them
 * (fp8_amx_gemm), else on AVX512-BF16's dot products (VDPBF16PS, fp8_dot_gemm).
 *
 * Widening e4m3 to float32 for an FMA (widen_fp8) costs four instructions per 16 weights, so a
 * decode step over fp8 weights is bound by those instructions rather than by its bytes. Where
 * the activations are bf16 (exactly: ``--dtype bfloat16``) the weights need only become bf16,
 * which holds every e4m3 value exactly: a table lookup on the byte (VPERMI2B, 128 entries, the
 * sign ORed in) gives each weight's two bytes, two rows k and k + 1 are interleaved into the
 * pairs VDPBF16PS and the tiles multiply, 32 weights to an instruction. The weights are
 * e4m3 · 2^-8 as widen_fp8 gives them (the scales carry 2^8). The products of bf16 values are
 * exact in float32; VDPBF16PS adds each to its sum with one rounding, as an FMA adds it, but
 * the pair (k, k + 1) k + 1 first, and the tiles sum in an order of their own: the sums differ
 * from the FMA path's in the last bits (never with the batch: a row's result still does not
 * depend on the rows beside it).
 *
 * The interleaving works within 128-bit lanes, so sums[q] lane j holds the columns
 * 16·j + 4·q .. + 3; ``fp8_dot_columns`` puts them back in order (a 4 × 4 transpose of lanes). */

#ifndef SRT_CPU_FP8_DOT_H
#define SRT_CPU_FP8_DOT_H

#include "cpu_kernels.h"

#if FP8_DOT

/* The bf16 of each e4m3 magnitude b < 128 times 2^-8: its low bytes, then its high bytes. */
static uint8_t fp8_bf16_bytes[2][128];

__attribute__((constructor)) static void fp8_bf16_table(void) {
    for (int b = 0; b < 128; b++) {
        int e = b >> 3, m = b & 7; /* as widen_fp8 reads it: 0x7f is 480, not NaN */
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 15) : ldexpf(m / 8.0f, -14);
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        fp8_bf16_bytes[0][b] = (uint8_t)(bits >> 16), fp8_bf16_bytes[1][b] = (uint8_t)(bits >> 24);
    }
}

/* PANEL e4m3 bytes as bf16: the low bytes and the high bytes (sign included). */
static inline __attribute__((always_inline)) void fp8_row_bf16(__m512i b, const __m512i t[4],
                                                               __m512i *lo, __m512i *hi) {
    *lo = _mm512_permutex2var_epi8(t[0], b, t[1]);
    *hi = _mm512_permutex2var_epi8(t[2], b, t[3]);
    *hi = _mm512_ternarylogic_epi32(*hi, b, _mm512_set1_epi8((char)0x80), 0xf8); /* hi | b & 0x80 */
}

/* How far ahead fp8_dot_pairs asks for its panel's rows (of PANEL bytes): into the first-level
 * cache 4 KB on, into the second 32 KB on. The conversion costs about as much time as reading
 * the bytes from memory, and the hardware's own prefetch, which stops at each 4 KB page, let
 * the two alternate (one thread streaming 128 MB of panels: 5.3 GB/s without, 8.0 with). */
#define FP8_AHEAD 64
#define FP8_FAR 512

/* The weights of rows k0 .. k1 of an fp8 panel as bf16 pairs (k, k + 1), 4 vectors a pair of
 * rows in lane order (see above; an odd last row is paired with zeros). The two rows' bytes are
 * interleaved first, so that each lookup's low and high bytes interleave into whole pairs: 10
 * shuffles for 128 weights, against 12 where each row is looked up alone. */
static inline void fp8_dot_pairs(struct panel p, int64_t k0, int64_t k1, __m512i *pairs) {
    const __m512i t[4] = {
        _mm512_loadu_si512(fp8_bf16_bytes[0]), _mm512_loadu_si512(fp8_bf16_bytes[0] + 64),
        _mm512_loadu_si512(fp8_bf16_bytes[1]), _mm512_loadu_si512(fp8_bf16_bytes[1] + 64)};
    const uint8_t *w = p.w;
    for (int64_t k = k0; k < k1; k += 2, pairs += 4) {
        _mm_prefetch((const char *)w + (k + FP8_AHEAD) * PANEL, _MM_HINT_T0);
        _mm_prefetch((const char *)w + (k + FP8_AHEAD + 1) * PANEL, _MM_HINT_T0);
        _mm_prefetch((const char *)w + (k + FP8_FAR) * PANEL, _MM_HINT_T1);
        _mm_prefetch((const char *)w + (k + FP8_FAR + 1) * PANEL, _MM_HINT_T1);
        __m512i a = _mm512_loadu_si512(w + k * PANEL);
        __m512i b = k + 1 < k1 ? _mm512_loadu_si512(w + (k + 1) * PANEL) : _mm512_setzero_si512();
        /* per 128-bit lane j: columns 16j .. 16j + 7 of rows k and k + 1 byte by byte, then
         * columns 16j + 8 .. 16j + 15; each pair of bf16 bytes from them is one weight */
        __m512i lo, hi, x[2] = {_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)};
        for (int h = 0; h < 2; h++) {
            fp8_row_bf16(x[h], t, &lo, &hi);
            pairs[2 * h] = _mm512_unpacklo_epi8(lo, hi);
            pairs[2 * h + 1] = _mm512_unpackhi_epi8(lo, hi);
        }
    }
}

/* sums[i][q] = Σ_{k0 ≤ k < k1} x_i[k] · panel[k, columns of (q, lane)] for m ≤ ROWS rows x_i
 * whose float32 values are bf16 exactly, from fp8_dot_pairs' pairs of those rows. */
static inline __attribute__((always_inline)) void fp8_dot_rows(const float *const *in, int64_t m,
                                                               const __m512i *pairs, int64_t k0,
                                                               int64_t k1, vec sums[ROWS][4]) {
    memset(sums, 0, ROWS * sizeof *sums);
    for (int64_t k = k0; k < k1; k += 2, pairs += 4) {
        for (int64_t i = 0; i < m; i++) {
            uint32_t x0, x1 = 0;
            memcpy(&x0, in[i] + k, sizeof x0);
            if (k + 1 < k1) memcpy(&x1, in[i] + k + 1, sizeof x1);
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)((x0 >> 16) | (x1 & 0xffff0000u)));
            for (int q = 0; q < 4; q++)
                sums[i][q] = (vec)_mm512_dpbf16_ps((__m512)sums[i][q], (__m512bh)pairs[q], x);
        }
    }
}

/* The 4 vectors of add_products_fp8_dot's lane order back in column order. */
static inline __attribute__((always_inline)) void fp8_dot_columns(vec s[4]) {
    __m512 t0 = _mm512_shuffle_f32x4((__m512)s[0], (__m512)s[1], 0x44);
    __m512 t1 = _mm512_shuffle_f32x4((__m512)s[0], (__m512)s[1], 0xee);
    __m512 t2 = _mm512_shuffle_f32x4((__m512)s[2], (__m512)s[3], 0x44);
    __m512 t3 = _mm512_shuffle_f32x4((__m512)s[2], (__m512)s[3], 0xee);
    s[0] = (vec)_mm512_shuffle_f32x4(t0, t2, 0x88), s[1] = (vec)_mm512_shuffle_f32x4(t0, t2, 0xdd);
    s[2] = (vec)_mm512_shuffle_f32x4(t1, t3, 0x88), s[3] = (vec)_mm512_shuffle_f32x4(t1, t3, 0xdd);
}

/* The most K rows of a group fp8_dot_gemm converts at once (on its stack: 32 KB). */
#define FP8_DOT_MAX_GROUP 256

/* The 4 vectors of a row's sums over one group of rows of k, scaled by the group's scales s and
 * added to the row's y (its columns back in order; y holds the groups before). */
static inline __attribute__((always_inline)) void fp8_dot_add(vec sums[4], const vec s[4],
                                                              float *y, int nv, int first) {
    fp8_dot_columns(sums);
    for (int q = 0; q < nv; q++) {
        vec acc = first ? (vec){0} : load_vec(y + q * VEC);
        store_vec(y + q * VEC, fma_vv(acc, sums[q], s[q]));
    }
}

/* y[r, 0:nv·VEC] for rows r < n of x (bf16 values in float32) times fp8 panel p, each group's
 * weights turned into bf16 pairs once for every row: the sums of block_gemm's fp8 path, in the
 * dot products' order, whatever n is. */
static void fp8_dot_gemm(const struct rows *x, int64_t n, struct panel p, int64_t k_dim,
                         float *y, int64_t ldy, int nv) {
    __m512i pairs[FP8_DOT_MAX_GROUP / 2 * 4];
    for (int64_t k0 = 0, g = 0; k0 < k_dim; k0 += p.group, g++) {
        int64_t k1 = k0 + p.group < k_dim ? k0 + p.group : k_dim;
        vec s[4];
        for (int q = 0; q < 4; q++) s[q] = load_vec(p.scale + g * PANEL + q * VEC);
        fp8_dot_pairs(p, k0, k1, pairs);
        for (int64_t r = 0; r < n; r += ROWS) {
            int64_t m = n - r < ROWS ? n - r : ROWS;
            const float *in[ROWS] = {0};
            vec sums[ROWS][4];
            for (int64_t i = 0; i < m; i++) in[i] = row_at(x, r + i);
            fp8_dot_rows(in, m, pairs, k0, k1, sums);
            for (int64_t i = 0; i < m; i++)
                fp8_dot_add(sums[i], s, y + (r + i) * ldy, nv, k0 == 0);
        }
    }
}

/* Whether fp8_amx_gemm takes a weight of this K and group: AMX here, and groups of whole
 * tile steps (32 rows of k) that fp8_dot_gemm's buffer holds. */
int fp8_amx_usable(int64_t k_dim, int64_t group) {
    return group % 32 == 0 && group <= FP8_DOT_MAX_GROUP && amx_usable(k_dim);
}

/* fp8_dot_pairs for amx_first_block: rows k0 .. k1 of the group from k (relative to it). */
struct fp8_fill {
    struct panel p;
    int64_t k;
    __m512i *pairs;
};

static void fp8_fill_pairs(void *arg, int64_t k0, int64_t k1) {
    const struct fp8_fill *f = arg;
    fp8_dot_pairs(f->p, f->k + k0, f->k + k1, f->pairs + k0 / 2 * 4);
}

/* y[i, 0:PANEL] (float32) for m bf16 rows a_i = a + i · lda times fp8 panel p on AMX's tiles:
 * each group's weights turned into bf16 pairs once (fp8_dot_pairs, whose 4 vectors a pair of
 * rows sit where a bf16 panel's do, so the tiles read them as one, columns in lane order),
 * multiplied on the tiles 64 rows at a time, scaled and added as fp8_dot_gemm adds them. The
 * first 16 rows are multiplied 32 k at a time as the pairs are written (amx_first_block): a
 * decode step's one row then costs the conversion alone, the tiles working beside it. */
void fp8_amx_gemm(int *tiles, const uint16_t *a, int64_t lda, int64_t m, struct panel p,
                  int64_t k_dim, float *y, int64_t ldy) {
    __m512i pairs[FP8_DOT_MAX_GROUP / 2 * 4];
    float sums[64 * PANEL];
    for (int64_t k0 = 0, g = 0; k0 < k_dim; k0 += p.group, g++) {
        int64_t k1 = k0 + p.group < k_dim ? k0 + p.group : k_dim;
        struct fp8_fill fill = {p, k0, pairs};
        vec s[4];
        for (int q = 0; q < 4; q++) s[q] = load_vec(p.scale + g * PANEL + q * VEC);
        for (int64_t r = 0; r < m; r += 64) {
            int64_t n = m - r < 64 ? m - r : 64, first = r ? 0 : n < 16 ? n : 16;
            const uint16_t *ar = a + r * lda + k0;
            if (first)
                amx_first_block(tiles, (int)first, sums, PANEL, fp8_fill_pairs, &fill, ar, lda,
                                (const uint16_t *)pairs, k1 - k0);
            if (n > first)
                amx_panel_gemm(tiles, ar + first * lda, lda, n - first, (const uint16_t *)pairs,
                               k1 - k0, sums + first * PANEL, PANEL);
            for (int64_t i = 0; i < n; i++) {
                vec v[4];
                for (int q = 0; q < 4; q++) v[q] = load_vec(sums + i * PANEL + q * VEC);
                fp8_dot_add(v, s, y + (r + i) * ldy, 4, k0 == 0);
            }
        }
    }
}

#else
int fp8_amx_usable(int64_t k_dim, int64_t group) {
    (void)k_dim, (void)group;
    return 0;
}

void fp8_amx_gemm(int *tiles, const uint16_t *a, int64_t lda, int64_t m, struct panel p,
                  int64_t k_dim, float *y, int64_t ldy) {
    (void)tiles, (void)a, (void)lda, (void)m, (void)p, (void)k_dim, (void)y, (void)ldy;
    abort(); /* fp8_amx_usable is 0 */
}
#endif

#endif
