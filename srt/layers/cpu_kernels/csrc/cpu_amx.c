/* The bf16 × bf16 GEMM of a block of rows with one weight panel on AMX's tiles (Intel's
 * Advanced Matrix Extensions, Sapphire Rapids and later), where the build and the CPU have
 * them: srt_panel_linear and srt_fused_experts take it for bfloat16 activations over bfloat16
 * weights (cpu_kernels.c). Decode reads each weight once whatever the instructions; prefill and
 * large batches are bound by arithmetic, and one tile instruction does 16 × 16 × 32
 * multiply-adds where an AVX-512 FMA does 16 (a 1536 × 1024 weight, 2048 rows, 2 threads: 25 ms
 * on FMAs against 2.1 ms for oneDNN's AMX GEMM).
 *
 * The tile multiply (TDPBF16PS) takes the weights as bf16 pairs along k ("VNNI" layout), which is
 * how bf16 panels are packed ([K/2][PANEL][2], ``pack_panels``); the FMA kernels read the same
 * layout. Products of two bf16 numbers are exact in float32 and the sums are float32, in an order
 * the hardware fixes for each output element whatever the number of rows: a row's result does
 * not depend on its batch. It is not the FMA kernels' order, and the instruction treats float32
 * subnormals as zero; the results agree with float32 arithmetic to its rounding.
 *
 * Tiles: 0-3 the sums of a block of up to 16 rows × the panel's 64 columns, 4 a block of
 * activations (rows × 32 k), 5 and 6 the panel's 32 k × 16 columns in pairs. The tile
 * configuration is per thread and other code (oneDNN) changes it: each region loads its own
 * (amx_rows) and releases the tiles when it ends. */

#define _GNU_SOURCE
#include "cpu_kernels.h"

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && PANEL == 64
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for an extended state component */
#define XFEATURE_XTILEDATA 18       /* AMX's tile data */

/* 1 where the tiles may be used: built with them, and the kernel granted the process their
 * state (asked once). srt_amx switches them off and on (tests compare both paths). */
static int amx_state = -1;

static int amx_granted(void) {
#if HAVE_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* mode < 0: whether AMX is used; 0: stop using it; > 0: use it where it can be. Returns
 * whether it is used now. */
int srt_amx(int mode) {
    static int granted = -1;
    if (granted < 0) granted = amx_granted();
    if (amx_state < 0 || mode >= 0) amx_state = granted && mode != 0;
    return amx_state;
}

int amx_usable(int64_t k_dim) { return k_dim % 32 == 0 && srt_amx(-1); }

#if HAVE_AMX
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

/* Tiles configured for blocks of m rows, unless they already are (*rows == m). */
static void amx_rows(int *rows, int m) {
    if (*rows == m) return;
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = t < 5 ? m : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
    *rows = m;
}

/* A block of m ≤ 16 rows in three steps: amx_block_start (the sums zeroed, or loaded from y),
 * amx_block_k (32 k more: rows a_i = a + i · lda, the panel's 16 pair rows from `pairs`, bf16
 * pairs along k, pair row j at pairs + j · 2 · PANEL), amx_block_store (the sums to y). */
static void amx_block_start(int *rows, int m, int zero, const float *y, int64_t ldy) {
    const int64_t ld = ldy * sizeof *y;
    amx_rows(rows, m);
    if (zero) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        return;
    }
    _tile_loadd(0, y, ld);
    _tile_loadd(1, y + 16, ld);
    _tile_loadd(2, y + 32, ld);
    _tile_loadd(3, y + 48, ld);
}

static inline void amx_block_k(const uint16_t *a, int64_t lda, const uint16_t *pairs) {
    const int64_t pair_row = 2 * PANEL * sizeof *pairs;
    _tile_loadd(4, a, lda * sizeof *a);
    _tile_loadd(5, pairs, pair_row);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, pairs + 32, pair_row);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, pairs + 64, pair_row);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, pairs + 96, pair_row);
    _tile_dpbf16ps(3, 4, 6);
}

static void amx_block_store(float *y, int64_t ldy) {
    const int64_t ld = ldy * sizeof *y;
    _tile_stored(0, y, ld);
    _tile_stored(1, y + 16, ld);
    _tile_stored(2, y + 32, ld);
    _tile_stored(3, y + 48, ld);
}

/* y[i, 0:64] (+)= Σ_{k0 ≤ k < k1} a_i[k] · panel[k] for i < m ≤ 16, rows a_i = a + i · lda
 * (bf16), the panel bf16 in pairs along k, k0 and k1 multiples of 32: the sums start from zero
 * at k0 = 0, else from y. */
static void amx_block(int *rows, const uint16_t *a, int64_t lda, int m, const uint16_t *panel,
                      int64_t k0, int64_t k1, float *y, int64_t ldy) {
    amx_block_start(rows, m, k0 == 0, y, ldy);
    for (int64_t k = k0; k < k1; k += 32) amx_block_k(a + k, lda, panel + k * PANEL);
    amx_block_store(y, ldy);
}
#endif

/* The panel's K in slices of AMX_K (32 KB of a bf16 panel), each slice read for every block of
 * 16 rows while it is in the first-level cache; the sums go to y and back between slices. */
#define AMX_K 256

void amx_panel_gemm(int *rows, const uint16_t *a, int64_t lda, int64_t n,
                    const uint16_t *panel, int64_t k_dim, float *y, int64_t ldy) {
#if HAVE_AMX
    for (int64_t k0 = 0; k0 < k_dim; k0 += AMX_K) {
        int64_t k1 = k0 + AMX_K < k_dim ? k0 + AMX_K : k_dim;
        for (int64_t r = 0; r < n; r += 16)
            amx_block(rows, a + r * lda, lda, n - r < 16 ? (int)(n - r) : 16, panel, k0, k1,
                      y + r * ldy, ldy);
    }
#else
    (void)rows, (void)a, (void)lda, (void)n, (void)panel, (void)k_dim, (void)y, (void)ldy;
    abort(); /* amx_usable is 0 */
#endif
}

void amx_first_block(int *rows, int m, float *y, int64_t ldy, amx_fill fill, void *arg,
                     const uint16_t *a, int64_t lda, const uint16_t *pairs, int64_t k_dim) {
#if HAVE_AMX
    amx_block_start(rows, m, 1, y, ldy);
    for (int64_t k = 0; k < k_dim; k += 32) {
        fill(arg, k, k + 32);
        amx_block_k(a + k, lda, pairs + k * PANEL);
    }
    amx_block_store(y, ldy);
#else
    (void)rows, (void)m, (void)y, (void)ldy, (void)fill, (void)arg, (void)a, (void)lda;
    (void)pairs, (void)k_dim;
    abort(); /* amx_usable is 0 */
#endif
}

void amx_end(int *rows) {
#if HAVE_AMX
    if (*rows) _tile_release();
#endif
    *rows = 0;
}
