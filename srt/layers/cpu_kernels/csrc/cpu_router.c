/* The router's choice of experts (srt_select_experts) and the KV cache's write
 * (srt_store_kv): the two steps of a MoE layer's decode that PyTorch ran as a dozen small ops
 * (softmax, topk, gather, sum, divide; an index_put_ per cache). On a decode step each of those
 * ops found its own code and data evicted by the weights streamed since the last one and cost
 * 10-50 µs; here each step is one call.
 *
 * srt_select_experts computes what srt.layers.moe.topk.select_experts does, per token:
 *   1. scores = softmax (or sigmoid) of its logits, in float32 (bf16 logits widen exactly);
 *   2. choice = scores + bias, where a correction bias is given (DeepSeek-V3's noaux_tc);
 *   3. with expert groups, only the experts of the topk_group best groups stay in the choice
 *      (a group scores the sum of its two best choices with a bias, its best one without);
 *   4. the top_k best choices, best first, the lower id first among equals;
 *   5. their scores as weights, divided by (their sum + 1e-20) when renormalized, then
 *      multiplied by the routed scaling factor;
 * and adds one per choice to counts[id] and window[id] where they are given (the expert-
 * distribution recorder's rows). Tokens are independent: a token's choice does not depend on
 * its batch. */

#include "cpu_kernels.h"

#include <float.h>

struct router_call {
    int act, sigmoid, renormalize;
    const void *logits;
    int64_t experts, ld;
    const float *bias;
    int64_t top_k, groups, topk_group;
    float scaling;
    float *weights;
    int64_t *ids;
    int64_t tokens;
};

/* The index of the largest of v[0:n] not yet taken (taken[i] != 0), the lower index first
 * among equals; a NaN counts as largest, as in torch.topk. -1 when every one is taken. */
static int64_t best_free(const float *v, const char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || (v[i] != v[i] && v[best] == v[best]) || v[i] > v[best]) best = i;
    }
    return best;
}

/* Step 3: the experts outside the topk_group best groups get -inf in `choice`. */
static void mask_groups(const struct router_call *c, float *choice) {
    int64_t size = c->experts / c->groups;
    float group_score[c->groups];
    char taken[c->experts > c->groups ? c->experts : c->groups];
    for (int64_t g = 0; g < c->groups; g++) {
        const float *v = choice + g * size;
        memset(taken, 0, size);
        int64_t first = best_free(v, taken, size);
        if (c->bias && size > 1) {
            taken[first] = 1;
            group_score[g] = v[first] + v[best_free(v, taken, size)];
        } else group_score[g] = v[first];
    }
    memset(taken, 0, c->groups);
    for (int64_t j = 0; j < c->topk_group; j++) taken[best_free(group_score, taken, c->groups)] = 1;
    for (int64_t g = 0; g < c->groups; g++)
        if (!taken[g])
            for (int64_t e = 0; e < size; e++) choice[g * size + e] = -INFINITY;
}

static void route_token(const struct router_call *c, int64_t t) {
    int64_t n = c->experts;
    float scores[n], choice[n];
    char taken[n];
    for (int64_t e = 0; e < n; e++) scores[e] = get_act(c->act, c->logits, t * c->ld + e);
    if (c->sigmoid) {
        for (int64_t e = 0; e < n; e++) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    } else {
        float max = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < n; e++) max = scores[e] > max ? scores[e] : max;
        for (int64_t e = 0; e < n; e++) sum += scores[e] = expf(scores[e] - max);
        for (int64_t e = 0; e < n; e++) scores[e] /= sum;
    }
    for (int64_t e = 0; e < n; e++) choice[e] = c->bias ? scores[e] + c->bias[e] : scores[e];
    if (c->groups > 1 && c->topk_group > 0) mask_groups(c, choice);
    memset(taken, 0, n);
    float *w = c->weights + t * c->top_k, sum = 0.0f;
    int64_t *ids = c->ids + t * c->top_k;
    for (int64_t j = 0; j < c->top_k; j++) {
        ids[j] = best_free(choice, taken, n);
        taken[ids[j]] = 1;
        sum += w[j] = scores[ids[j]];
    }
    for (int64_t j = 0; j < c->top_k; j++) {
        if (c->renormalize) w[j] = w[j] / (sum + 1e-20f);
        if (c->scaling != 1.0f) w[j] *= c->scaling;
    }
}

static void route_region(void *arg, const struct team *team) {
    const struct router_call *c = arg;
    int64_t lo, hi;
    team_share(team, c->tokens, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) route_token(c, t);
}

void srt_select_experts(int act, const void *logits, int64_t tokens, int64_t experts, int64_t ld,
                        const float *bias, int sigmoid, int64_t top_k, int64_t groups,
                        int64_t topk_group, int renormalize, float scaling, float *weights,
                        int64_t *ids, int64_t *counts, int64_t *window) {
    struct router_call c = {act, sigmoid, renormalize, logits, experts, ld, bias, top_k, groups,
                            topk_group, scaling, weights, ids, tokens};
    team_run(route_region, &c, tokens * experts * top_k >= 16384);
    for (int64_t i = 0; i < tokens * top_k; i++) {
        if (counts) counts[ids[i]]++;
        if (window) window[ids[i]]++;
    }
}

/* srt_store_kv: token t's keys (k_row elements at k + t · k_ld) into slot loc[t] of the key
 * cache (slot s at k_cache + s · k_stride), and its values likewise (v NULL: MLA's cache, whose
 * values are the keys' first columns). Every slot is checked before anything is written. */
struct store_call {
    int64_t tokens, size;
    const int64_t *loc;
    const char *src[2];
    char *dst[2];
    int64_t ld[2], row[2], stride[2];
};

static void store_region(void *arg, const struct team *team) {
    const struct store_call *c = arg;
    int64_t lo, hi;
    team_share(team, c->tokens, &lo, &hi);
    for (int i = 0; i < 2; i++)
        if (c->src[i])
            for (int64_t t = lo; t < hi; t++)
                memcpy(c->dst[i] + c->loc[t] * c->stride[i] * c->size,
                       c->src[i] + t * c->ld[i] * c->size, c->row[i] * c->size);
}

int srt_store_kv(int type, int64_t tokens, const int64_t *loc, int64_t num_slots, const void *k,
                 int64_t k_ld, int64_t k_row, void *k_cache, int64_t k_stride, const void *v,
                 int64_t v_ld, int64_t v_row, void *v_cache, int64_t v_stride) {
    for (int64_t t = 0; t < tokens; t++)
        if (loc[t] < 0 || loc[t] >= num_slots) return SRT_BAD_SLOT;
    struct store_call c = {tokens, type == T_F32 ? 4 : 2, loc, {k, v}, {k_cache, v_cache},
                           {k_ld, v_ld}, {k_row, v_row}, {k_stride, v_stride}};
    team_run(store_region, &c, tokens * (k_row + (v ? v_row : 0)) >= 65536);
    return 0;
}
