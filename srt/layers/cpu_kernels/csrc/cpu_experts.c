/* The routed experts of one MoE layer in one call (srt_fused_experts), over the GEMMs' weight
 * panels (cpu_kernels.c), in one parallel region of the kernels' team (cpu_pool.c):
 *   1. route: (token, slot) pairs sorted by local expert (counting sort, stable);
 *   2. act = silu(x · W1ᵀ) · (x · W3ᵀ) for every active expert, its tokens' rows of x read in
 *      place, gate and up panels shared out among threads in pairs, so the activation is taken
 *      a block of rows at a time and neither product is written out whole;
 *   3. down = act · W2ᵀ, panels shared out as in 2;
 *   4. out[t] = Σ_slot weight · down, slots in order; pairs of other ranks' experts add nothing.
 * A token's result does not depend on the batch it came in (split and unsplit batches agree).
 * bf16 activations over bf16 weights take AMX's tiles where the CPU has them (cpu_amx.c), and
 * over fp8 weights too, each group of k turned into bf16 first (cpu_fp8_dot.h): the rows are
 * gathered by expert in bf16 first and the activation is rounded to bf16 between the two
 * GEMMs, as a bf16 model rounds it. */

#include "cpu_kernels.h"

/* The (token, slot) pairs of this rank's experts, sorted by expert. */
struct routing {
    int64_t *count, *begin, *active, *order, *position; /* position[pair]: its row, or -1 */
    int64_t num_active, routed;
};

/* srt_fused_experts' arguments as its region reads them. On AMX (bf16 activations and weights)
 * the rows of x are first gathered by expert into bf16 [routed, H] in the space of `down`
 * (written only after), and the activations are kept in bf16 in `gated`. */
struct experts_call {
    int act, amx;
    const void *x;
    const float *xf;
    int64_t num_tokens, hidden, topk;
    const float *weights;
    const struct routing *r;
    const struct weights *up, *down_w;
    int64_t inter;
    float *gated, *down, *outf;
    void *out;
};

/* act[r, 0:PANEL] = silu(gate) · up for rows r < n, gate and up the products with two panels,
 * block by block of rows (neither is written out whole): float32 rows read through `x` on
 * FMAs, ROWS at a time, or (AMX) bf16 rows xb [n, K] on the tiles, AMX_ROWS at a time (each
 * slice of a panel read once for all of them: ``amx_panel_gemm``), their act rounded to
 * bf16. */
#define AMX_ROWS 64

static void act_gemm(const struct rows *x, const uint16_t *xb, int64_t n, struct panel gate_panel,
                     struct panel up_panel, int64_t k_dim, void *act, int64_t ld_act, int type,
                     int *tiles) {
    float gate[AMX_ROWS * PANEL], up[AMX_ROWS * PANEL];
    int64_t step = xb ? AMX_ROWS : ROWS;
    for (int64_t r = 0; r < n; r += step) {
        int64_t m = n - r < step ? n - r : step;
        if (xb && gate_panel.scale) { /* fp8, as bf16 */
            fp8_amx_gemm(tiles, xb + r * k_dim, k_dim, m, gate_panel, k_dim, gate, PANEL);
            fp8_amx_gemm(tiles, xb + r * k_dim, k_dim, m, up_panel, k_dim, up, PANEL);
        } else if (xb) {
            amx_panel_gemm(tiles, xb + r * k_dim, k_dim, m, gate_panel.w, k_dim, gate, PANEL);
            amx_panel_gemm(tiles, xb + r * k_dim, k_dim, m, up_panel.w, k_dim, up, PANEL);
        } else {
            struct rows block = *x;
            if (x->order) block.order += r;
            else block.base += r * x->ld;
            panel_gemm(&block, m, gate_panel, k_dim, gate, PANEL, 4, type);
            panel_gemm(&block, m, up_panel, k_dim, up, PANEL, 4, type);
        }
        for (int64_t i = 0; i < m; i++) {
            const float *g = gate + i * PANEL, *u = up + i * PANEL;
            float a[PANEL];
            for (int64_t j = 0; j < PANEL; j++) a[j] = g[j] / (1.0f + fast_exp(-g[j])) * u[j];
            for (int64_t j = 0; type == T_FP8_DOT && j < PANEL; j += VEC) /* as bf16: read so */
                store_vec(a + j, round_bf16(load_vec(a + j))); /* by the down projection's dots */
            if (xb) narrow_acts(T_BF16, a, PANEL, (uint16_t *)act + (r + i) * ld_act);
            else memcpy((float *)act + (r + i) * ld_act, a, sizeof a);
        }
    }
}

/* act = silu(x · W1ᵀ) · (x · W3ᵀ) [routed, I] for every active expert, its rows of x read in
 * place, or gathered (AMX), by each thread of a team: each thread takes a contiguous share of
 * every expert's gate panels (and the matching up panels), balanced however unevenly the
 * tokens went to experts. Expert e's w13 follows expert 0's at e · 2I/PANEL panels. Ends with
 * a barrier. */
static void experts_act(const struct team *team, const struct experts_call *c, int *tiles) {
    const struct routing *r = c->r;
    int64_t panels = c->inter / PANEL, hidden = c->hidden, lo, hi;
    team_share(team, panels, &lo, &hi);
    for (int64_t a = 0; a < r->num_active; a++) {
        int64_t e = r->active[a], first = e * 2 * panels, row = r->begin[e];
        struct rows rows = {c->xf, hidden, r->order + row, c->topk};
        const uint16_t *xb = c->amx ? (const uint16_t *)c->down + row * hidden : NULL;
        for (int64_t b = lo; b < hi; b++) {
            int64_t at = row * c->inter + b * PANEL;
            void *act = c->amx ? (void *)((uint16_t *)c->gated + at) : (void *)(c->gated + at);
            act_gemm(&rows, xb, r->count[e], panel_at(c->up, first + b),
                     panel_at(c->up, first + panels + b), hidden, act, c->inter,
                     gemm_type(c->act, c->up->type), tiles);
        }
    }
    team_barrier(team);
}

/* down = act · W2ᵀ [routed, H] for every active expert, shared out as in experts_act. */
static void experts_down(const struct team *team, const struct experts_call *c, int *tiles) {
    const struct routing *r = c->r;
    int64_t panels = c->hidden / PANEL, inter = c->inter, lo, hi;
    int type = gemm_type(c->act, c->down_w->type);
    team_share(team, panels, &lo, &hi);
    for (int64_t a = 0; a < r->num_active; a++) {
        int64_t e = r->active[a], n = r->count[e];
        float *down = c->down + r->begin[e] * c->hidden;
        struct rows rows = {c->gated + r->begin[e] * inter, inter, NULL, 1};
        const uint16_t *act = (const uint16_t *)c->gated + r->begin[e] * inter;
        for (int64_t b = lo; b < hi; b++) {
            struct panel p = panel_at(c->down_w, e * panels + b);
            float *y = down + b * PANEL;
            if (c->amx && p.scale) fp8_amx_gemm(tiles, act, inter, n, p, inter, y, c->hidden);
            else if (c->amx) amx_panel_gemm(tiles, act, inter, n, p.w, inter, y, c->hidden);
            else panel_gemm(&rows, n, p, inter, y, c->hidden, 4, type);
        }
    }
    team_barrier(team);
}

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

/* out[t] = Σ_slot weight · down[row of (t, slot)], slots in order (each thread its share of
 * the tokens). */
static void combine(const struct team *team, const float *down, const struct routing *r,
                    const float *weights, int64_t num_tokens, int64_t topk, int64_t hidden,
                    float *out) {
    int64_t lo, hi;
    team_share(team, num_tokens, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
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

/* The rows of x (bf16) gathered by expert into [routed, H] at `down`, each thread its share. */
static void gather_rows(const struct team *team, const struct experts_call *c) {
    const struct routing *r = c->r;
    uint16_t *xg = (uint16_t *)c->down;
    int64_t lo, hi, h = c->hidden;
    team_share(team, r->routed, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        memcpy(xg + i * h, (const uint16_t *)c->x + r->order[i] / c->topk * h, h * sizeof *xg);
    team_barrier(team);
}

static void experts_region(void *arg, const struct team *team) {
    const struct experts_call *c = arg;
    int tiles = 0;
    if (c->amx) gather_rows(team, c);
    else if (c->act != T_F32)
        widen_shared(team, c->act, c->x, c->num_tokens * c->hidden, (float *)c->xf);
    experts_act(team, c, &tiles);
    experts_down(team, c, &tiles);
    amx_end(&tiles);
    combine(team, c->down, c->r, c->weights, c->num_tokens, c->topk, c->hidden, c->outf);
    if (c->act != T_F32) {
        team_barrier(team);
        narrow_shared(team, c->act, c->outf, c->num_tokens * c->hidden, c->out);
    }
}

/* x [T, H]; ids, weights [T, topk] (global expert ids; this rank holds [start, start + E));
 * w13 packed [E][2I/PANEL][H][PANEL], w2 packed [E][H/PANEL][I][PANEL], both of `type`, with
 * their scales [E][2I/PANEL][ceil(H/group13)][PANEL] and [E][H/PANEL][ceil(I/group2)][PANEL]
 * for fp8 (else NULL); out [T, H]; x and out float32 or bf16 (`act`: bf16 is widened into
 * float32 first and the float32 result narrowed at the end). `work` holds T·topk·(H + I)
 * floats, and 2·T·H more for bf16; the caller keeps it from call to call, because fresh
 * buffers this large are mapped anew by malloc and every first touch of a page faults.
 * Returns 0, or SRT_OUT_OF_MEMORY. */
int srt_fused_experts(int act, const void *x, int64_t num_tokens, int64_t hidden,
                      const int64_t *ids, const float *weights, int64_t topk, int64_t start,
                      int64_t num_experts, int64_t inter, int type, const void *w13,
                      const float *scale13, int64_t group13, const void *w2,
                      const float *scale2, int64_t group2, void *out, float *work) {
    struct routing r;
    if (route(ids, num_tokens * topk, start, num_experts, &r)) {
        free_routing(&r);
        return SRT_OUT_OF_MEMORY;
    }
    struct weights up = {w13, scale13, hidden, scale13 ? group13 : hidden, type};
    struct weights down_w = {w2, scale2, inter, scale2 ? group2 : inter, type};
    /* act [routed, I] | down [routed, H] | bf16: x and out in float32 [T, H] each */
    float *gated = work, *down = gated + num_tokens * topk * inter;
    float *xf = (float *)x, *outf = out;
    if (act != T_F32) xf = down + num_tokens * topk * hidden, outf = xf + num_tokens * hidden;
    int amx = act == T_BF16 && type == T_BF16 && amx_usable(hidden) && amx_usable(inter);
    amx = amx || (act == T_BF16 && type == T_FP8 && scale13 && scale2 &&
                  fp8_amx_usable(hidden, group13) && fp8_amx_usable(inter, group2));
    struct experts_call c = {act, amx, x, xf, num_tokens, hidden, topk, weights, &r, &up,
                             &down_w, inter, gated, down, outf, out};
    team_run(experts_region, &c, 1);
    free_routing(&r);
    return 0;
}

