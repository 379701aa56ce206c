/* fp8 weights times bf16 activations on AVX512-BF16's dot products (VDPBF16PS), for the GEMMs
 * of cpu_kernels.c (included there only).
 *
 * Widening e4m3 to float32 for an FMA (widen_fp8) costs four instructions per 16 weights, so a
 * decode step over fp8 weights is bound by those instructions rather than by its bytes. Where
 * the activations are bf16 (exactly: ``--dtype bfloat16``) the weights need only become bf16,
 * which holds every e4m3 value exactly: a table lookup on the byte (VPERMI2B, 128 entries, the
 * sign ORed in) gives each weight's two bytes, two rows k and k + 1 are interleaved into the
 * pairs VDPBF16PS multiplies, 32 weights to an instruction. The weights are e4m3 · 2^-8 as
 * widen_fp8 gives them (the scales carry 2^8). The products of bf16 values are exact in float32
 * and each is added to its sum with one rounding, as an FMA adds it, but the pair (k, k + 1)
 * is added k + 1 first: the sums differ from the FMA path's in the last bits (never with the
 * batch: a row's result still does not depend on the rows beside it).
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

/* One row of PANEL e4m3 bytes as bf16: the low bytes and the high bytes (sign included). */
static inline __attribute__((always_inline)) void fp8_row_bf16(__m512i b, const __m512i t[4],
                                                               __m512i *lo, __m512i *hi) {
    *lo = _mm512_permutex2var_epi8(t[0], b, t[1]);
    *hi = _mm512_permutex2var_epi8(t[2], b, t[3]);
    *hi = _mm512_ternarylogic_epi32(*hi, b, _mm512_set1_epi8((char)0x80), 0xf8); /* hi | b & 0x80 */
}

/* sums[i][q] += Σ_{k0 ≤ k < k1} x_i[k] · panel[k, columns of (q, lane)] for m ≤ ROWS rows whose
 * float32 values are bf16 exactly, all 4 vectors of an fp8 panel, in lane order (see above). */
static inline __attribute__((always_inline)) void add_products_fp8_dot(const float *const *in,
                                                                       int64_t m, struct panel p,
                                                                       int64_t k0, int64_t k1,
                                                                       vec sums[ROWS][4]) {
    const __m512i t[4] = {
        _mm512_loadu_si512(fp8_bf16_bytes[0]), _mm512_loadu_si512(fp8_bf16_bytes[0] + 64),
        _mm512_loadu_si512(fp8_bf16_bytes[1]), _mm512_loadu_si512(fp8_bf16_bytes[1] + 64)};
    const uint8_t *w = p.w;
    for (int64_t k = k0; k < k1; k += 2) {
        int pair = k + 1 < k1; /* else row k + 1 counts as zeros */
        __m512i l0, h0, l1, h1;
        fp8_row_bf16(_mm512_loadu_si512(w + k * PANEL), t, &l0, &h0);
        fp8_row_bf16(pair ? _mm512_loadu_si512(w + (k + 1) * PANEL) : _mm512_setzero_si512(), t,
                     &l1, &h1);
        __m512i a = _mm512_unpacklo_epi8(l0, h0), b = _mm512_unpackhi_epi8(l0, h0);
        __m512i c = _mm512_unpacklo_epi8(l1, h1), d = _mm512_unpackhi_epi8(l1, h1);
        __m512i wq[4] = {_mm512_unpacklo_epi16(a, c), _mm512_unpackhi_epi16(a, c),
                         _mm512_unpacklo_epi16(b, d), _mm512_unpackhi_epi16(b, d)};
        for (int64_t i = 0; i < m; i++) {
            uint32_t x0, x1 = 0;
            memcpy(&x0, in[i] + k, sizeof x0);
            if (pair) memcpy(&x1, in[i] + k + 1, sizeof x1);
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)((x0 >> 16) | (x1 & 0xffff0000u)));
            for (int q = 0; q < 4; q++)
                sums[i][q] = (vec)_mm512_dpbf16_ps((__m512)sums[i][q], (__m512bh)wq[q], x);
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

#endif

#endif
