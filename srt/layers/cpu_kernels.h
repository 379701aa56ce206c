/* What the CPU kernels' C files share: the vector type (one register), the sum of its lanes and
 * a vectorizable exp. */

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

/* A vector is one register: 16 floats with AVX-512, else 8 (AVX2, NEON pairs...). */
#ifdef __AVX512F__
#define VEC 16
#else
#define VEC 8
#endif

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

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

#endif
