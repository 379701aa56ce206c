/* A recorded sequence of kernel calls run by one call from Python (srt_run): what a CPU decode
 * graph replays (srt.model_executor.cpu_graph). Through ctypes each call costs 2-3 µs of
 * argument conversion, as much as a small kernel's own work, and a decode step makes a hundred
 * or more; here a program holds them all, each as its kernel's number (srt_program_op) and its
 * arguments as 64-bit words: integers and addresses as they are, a float's bits in the low half.
 * The kernels run in the program's order, as the capture ran them. */

#include "cpu_kernels.h"

typedef int (*thunk)(const int64_t *a);

#define P(i) ((void *)(intptr_t)a[i])
static inline float F(int64_t word) {
    uint32_t bits = (uint32_t)word;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int run_panel_linear(const int64_t *a) {
    srt_panel_linear((int)a[0], P(1), a[2], a[3], (int)a[4], P(5), P(6), a[7], a[8], P(9), P(10));
    return 0;
}

static int run_fused_experts(const int64_t *a) {
    return srt_fused_experts((int)a[0], P(1), a[2], a[3], P(4), P(5), a[6], a[7], a[8], a[9],
                             (int)a[10], P(11), P(12), a[13], P(14), P(15), a[16], P(17), P(18));
}

static int run_rms_norm(const int64_t *a) {
    srt_rms_norm((int)a[0], P(1), a[2], a[3], a[4], a[5], P(6), P(7), P(8), F(a[9]), P(10));
    return 0;
}

static int run_decode_attention(const int64_t *a) {
    return srt_decode_attention((int)a[0], P(1), a[2], a[3], a[4], P(5), a[6], P(7), a[8], a[9],
                                a[10], P(11), a[12], a[13], a[14], a[15], P(16), P(17), F(a[18]),
                                P(19));
}

static int run_extend_attention(const int64_t *a) {
    return srt_extend_attention((int)a[0], P(1), a[2], a[3], a[4], a[5], P(6), a[7], P(8), a[9],
                                a[10], a[11], P(12), a[13], a[14], a[15], a[16], P(17), P(18),
                                P(19), P(20), F(a[21]), P(22));
}

static int run_rope(const int64_t *a) {
    return srt_rope((int)a[0], P(1), a[2], a[3], a[4], a[5], a[6], P(7), P(8), a[9], (int)a[10],
                    P(11));
}

static int run_select_experts(const int64_t *a) {
    srt_select_experts((int)a[0], P(1), a[2], a[3], a[4], P(5), (int)a[6], a[7], a[8], a[9],
                       (int)a[10], F(a[11]), P(12), P(13), P(14), P(15));
    return 0;
}

static int run_store_kv(const int64_t *a) {
    return srt_store_kv((int)a[0], a[1], P(2), a[3], P(4), a[5], a[6], P(7), a[8], P(9), a[10],
                        a[11], P(12), a[13]);
}

/* Two steps a decode graph would otherwise leave to PyTorch, which the recorder puts in its
 * programs (srt.model_executor.cpu_graph): a cast between float32 and bf16, rounded as torch
 * rounds (put_act), and rows gathered by index (an embedding), every index checked first. */
static int run_convert(const int64_t *a) { /* from, src, n, to, dst */
    int from = (int)a[0], to = (int)a[3];
    if (from == to) memcpy(P(4), P(1), a[2] * (from == T_F32 ? 4 : 2));
    else if (to == T_F32) widen_acts(from, P(1), a[2], P(4));
    else narrow_acts(T_BF16, P(1), a[2], P(4));
    return 0;
}

static int run_gather_rows(const int64_t *a) { /* table, rows, row bytes, index, n, dst */
    const int64_t *index = P(3);
    for (int64_t i = 0; i < a[4]; i++)
        if (index[i] < 0 || index[i] >= a[1]) return SRT_BAD_INDEX;
    for (int64_t i = 0; i < a[4]; i++)
        memcpy((char *)P(5) + i * a[2], (const char *)P(0) + index[i] * a[2], a[2]);
    return 0;
}

static const struct {
    const char *name;
    int args;
    thunk run;
} ops[] = {
    {"srt_panel_linear", 11, run_panel_linear},
    {"srt_fused_experts", 19, run_fused_experts},
    {"srt_rms_norm", 11, run_rms_norm},
    {"srt_decode_attention", 20, run_decode_attention},
    {"srt_extend_attention", 23, run_extend_attention},
    {"srt_rope", 12, run_rope},
    {"srt_select_experts", 16, run_select_experts},
    {"srt_store_kv", 14, run_store_kv},
    {"convert", 5, run_convert},
    {"gather_rows", 6, run_gather_rows},
};

#define NUM_OPS ((int64_t)(sizeof ops / sizeof *ops))

/* The number of the kernel called `name` (srt_..., or one of the two steps above) in a program,
 * or -1 if a program cannot call it; *args is set to its number of arguments. */
int64_t srt_program_op(const char *name, int64_t *args) {
    for (int64_t i = 0; i < NUM_OPS; i++)
        if (!strcmp(ops[i].name, name)) {
            *args = ops[i].args;
            return i;
        }
    return -1;
}

/* Runs the program's `length` words: calls, each its op's number then its arguments. Returns 0,
 * or the first nonzero status a kernel returned, the call's index (from 0) in *failed; the calls
 * after it do not run. */
int srt_run(const int64_t *program, int64_t length, int64_t *failed) {
    int64_t call = 0;
    for (int64_t i = 0; i < length; call++) {
        int64_t op = program[i];
        int status = ops[op].run(program + i + 1);
        if (status) {
            *failed = call;
            return status;
        }
        i += 1 + ops[op].args;
    }
    return 0;
}
