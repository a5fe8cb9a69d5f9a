/* One MoE layer's routed experts on the host, in one call:
 *
 *   out[t] += sum over (t, e, w) in the pairs of  w * down_e( silu(gate_e x_t) * up_e x_t )
 *
 * Weights stay in the pack's blob layout (int8: codes [R, C] + fp32 scale per row; int4: two
 * codes per byte, low nibble = even column, fp16 scale per (row, group of G columns); Q8_0 and
 * the GGUF K-quants and IQ4_XS as the file stores them, kquants.h).
 * Activations are quantised per block of 32 to int8 with one fp32 scale (llama.cpp's q8_0), so
 * every dot product is an integer dot product: AVX2 maddubs, or dpbusd where the CPU has
 * AVX-VNNI / AVX512-VNNI, chosen at run time (the bodies: dots.h, panels.h, kquants.h, ktiles.h,
 * kpanels.h, kdecoded.h). The file is built
 * without -march=native: each SIMD body carries its own target attribute, so one build runs on
 * any x86-64 (and a portable body serves other CPUs).
 *
 * Each expert's weights are read once per call whatever the number of its tokens (prefill
 * chunks and verify windows are GEMMs, not T GEMVs). Work is split over a persistent pthread
 * pool by (expert, block of weight rows); results are summed in the caller's expert order, so
 * the output does not depend on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define QK 32                      /* activation block */
#define ROWS_PER_TASK 16          /* the smallest task; larger when there are many rows */
#define TASKS_PER_THREAD 8         /* enough to balance, few enough that claiming costs nothing */

typedef struct {
    const void *gu, *gu_scale, *dn, *dn_scale;
    int64_t panels;               /* 1: an int4 expert held in panels (quant 5 for both matrices: panels.h) */
} expert_ptrs;

/* ---- fp16 -> fp32 (scales) ------------------------------------------------------------ */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) f = sign;
        else {                                         /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) f = sign | 0x7f800000 | (man << 13);
    else f = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float out;
    memcpy(&out, &f, 4);
    return out;
}

/* ---- activation quantisation: x [n] -> q [n] int8, s [n / QK] scales, sum [n / QK] -------
 * order (where the int4 codes need it; 0 elsewhere): 1 stores each block as its 16 even then its
 * 16 odd elements, the order of the codes once a byte's low and high nibbles are split. The
 * block sums let an int4 dot use the unsigned nibble directly: sum (c - 8) x = sum c x - 8 sum x. */
static void quantize_row(const float *x, int64_t n, int8_t *q, float *s, int32_t *sum, int order) {
    const int64_t nb = n / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;   /* no NaN here */
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        int8_t *first = q + b * QK;
        int32_t total = 0;
        s[b] = d;
        for (int i = 0; i < QK; i++) {
            const int8_t c = (int8_t)lrintf(xb[i] * id);
            first[order ? (i & 1) * 16 + i / 2 : i] = c;
            total += c;
        }
        sum[b] = total;
    }
}

/* How far ahead of its reads a matrix streamed once (a decode step's) asks for its bytes: the
 * stored int4 panels' tiles (panels.h) and the rows read one at a time (matrix_rows). The hardware
 * prefetcher alone had run too close behind them (bench/results/prefetch-panels-round38-avx512.txt). */
#define STREAM_LEAD 4096

/* the `bytes` at p's STREAM_LEAD on asked for, a line each */
static inline void read_ahead(const void *p, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch((const char *)p + STREAM_LEAD + l, 0, 3);
}

#include "dots.h"
#include "panels.h"
#include "ktiles.h"
#include "kpanels.h"
#include "kdecoded.h"

static dot_fn dot_q8 = dot_q8_portable, dot_q4 = dot_q4_portable, dot_q8g = dot_q8g_portable;
/* the GGUF block types a row at a time, only where there are no SIMD tiles (ktiles.h) */
static dot_fn dot_q4k = dot_q4k_portable, dot_q5k = dot_q5k_portable, dot_q6k = dot_q6k_portable,
              dot_iq4xs = dot_iq4xs_portable, dot_mxfp4 = dot_mxfp4_portable;
#define SET_KQUANTS(SUFFIX) (ktiles = ktiles_##SUFFIX, kpanels = kpanels_##SUFFIX, kdecoded = kdecoded_##SUFFIX)
static const char *isa = "portable";

/* The best the CPU has, or at most MOEFIT_ISA (portable, avx2, avx-vnni): how the tests run
 * every path on one machine. */
static void pick_isa(void) {
#if defined(__x86_64__)
    const char *cap = getenv("MOEFIT_ISA");
    if (cap && !strcmp(cap, "portable")) return;
    const int below_512 = cap && (!strcmp(cap, "avx2") || !strcmp(cap, "avx-vnni"));
    const int below_vnni = cap && !strcmp(cap, "avx2");
    __builtin_cpu_init();
    if (!below_512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw")) {
        dot_q8 = dot_q8_vnni512, dot_q4 = dot_q4_vnni256, dot_q8g = dot_q8g_vnni512, isa = "avx512-vnni";
        panel_tiles = panel_tiles_vnni256, int4_panels = 1;
        SET_KQUANTS(vnni256);
        return;
    }
#ifdef HAVE_AVXVNNI
    if (!below_vnni && __builtin_cpu_supports("avxvnni")) {
        dot_q8 = dot_q8_avxvnni, dot_q4 = dot_q4_avxvnni, dot_q8g = dot_q8g_avxvnni, isa = "avx-vnni";
        panel_tiles = panel_tiles_avxvnni, int4_panels = 1;
        SET_KQUANTS(avxvnni);
        return;
    }
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        dot_q8 = dot_q8_avx2, dot_q4 = dot_q4_avx2, dot_q8g = dot_q8g_avx2, isa = "avx2";
        int4_panels = 1;
        SET_KQUANTS(avx2);
    }
#endif
}

/* once: every layer call asks, and a second thread's first call waits for the first's choice (it
 * had gone on with the portable bodies while the first was still choosing) */
static void choose_isa(void) {
    static pthread_once_t chosen = PTHREAD_ONCE_INIT;
    pthread_once(&chosen, pick_isa);
}

#include "pool.h"
#include "scratch.h"

/* quantize_row over T rows of n, the rows split over the pool (a prompt's 128 x 2048 took ~3 % of
 * its time on the calling thread alone) */
typedef struct {
    const float *x;
    int64_t n;
    int8_t *q;
    float *s;
    int32_t *sum;
    int order;
} quant_rows;

static void quantize_task(void *ctx, int64_t t) {
    const quant_rows *Q = ctx;
    quantize_row(Q->x + t * Q->n, Q->n, Q->q + t * Q->n, Q->s + t * (Q->n / QK), Q->sum + t * (Q->n / QK), Q->order);
}

static void quantize_rows(const float *x, int64_t T, int64_t n, int8_t *q, float *s, int32_t *sum, int order) {
    quant_rows Q = {x, n, q, s, sum, order};
    parallel(quantize_task, &Q, T);
}

/* The order quantize_row stores activations in for a matrix of `quant`: int4's, in rows or in
 * stored panels, 1 (the panel tiles and every int4 row body read it). */
static int int4_order(int quant) { return quant == 4 || quant == 5; }

int moe_int4_panels(void) {
    choose_isa();
    return int4_panels;
}

/* Raised whenever an exported function's arguments change: kernels/__init__.py refuses a library
 * built from other sources (an install not rebuilt after an update) rather than call it wrongly. */
int moe_abi(void) { return 9; }

const char *moe_isa(void) {
    choose_isa();
    return isa;
}

#include "rows.h"

/* ---- one layer ------------------------------------------------------------------------- */
/* gpt-oss's experts: gate_up = W x + b (gate columns, then up), gate clamped above at limit, up
 * clamped to [-limit, limit], h = (up + 1) * gate * sigmoid(alpha * gate), down = W h + b. */
typedef struct {
    float alpha, limit;
    const float *const *gu_bias;        /* [n_exp] -> [2I] */
    const float *const *dn_bias;        /* [n_exp] -> [E] */
} act_params;

typedef struct {
    int64_t E, I, group, n_exp;
    int quant, quant_dn;                /* gate_up's and down's (a GGUF file may mix Q4_K and Q6_K) */
    const expert_ptrs *ex;
    const int64_t *start;               /* [n_exp + 1] into rows / weights */
    const int32_t *rows;                /* token row of each pair */
    const float *weights;
    const int8_t *xq;                   /* [T, E] */
    const float *xs;                    /* [T, E / QK] */
    const int32_t *xsum;                /* [T, E / QK] */
    float *h;                           /* [pairs, 2I] gate_up outputs, then act in [:, :I] */
    int8_t *hq;                         /* [pairs, I] */
    float *hs;                          /* [pairs, I / QK] */
    int32_t *hsum;                      /* [pairs, I / QK] */
    float *y;                           /* [pairs, E] down outputs */
    int64_t *task_expert, *task_row;    /* task -> (expert, first weight row) */
    int64_t chunk;                      /* weight rows a task */
    const act_params *act;              /* NULL: SwiGLU; else gpt-oss's biases and clamped gate */
} layer;

/* quant: 8 int8 (a scale per row), 4 int4 (fp16 per group), 5 int4 stored in panels of 8 rows
 * (panels.h; one matrix only, where int4_panels), 9 Q8_0 (int8, fp16 per 32), and the
 * GGUF block types of kquants.h: 10 Q4_K, 11 Q5_K, 12 Q6_K, 13 IQ4_XS, 14 MXFP4 (no separate scales) */
static dot_fn dot_for(int quant) {
    switch (quant) {
    case 8: return dot_q8;
    case 9: return dot_q8g;
    case 10: return dot_q4k;
    case 11: return dot_q5k;
    case 12: return dot_q6k;
    case 13: return dot_iq4xs;
    case 14: return dot_mxfp4;
    default: return dot_q4;                                    /* 4, and 5's rows past its panels */
    }
}

static size_t row_bytes(int quant, int64_t cols) {
    if (quant >= 10) return block_row_bytes(quant, cols);
    return quant == 4 || quant == 5 ? (size_t)cols / 2 : (size_t)cols;
}

/* whether the kernel takes `quant` for rows of `cols` inputs */
static int takes(int quant, int64_t cols, int64_t group) {
    if (cols % QK) return 0;
    if (quant == 4) return group % QK == 0;
    if (quant == 9) return group == QK;
    if (quant >= 10 && quant <= 13) return cols % QK_K == 0;
    if (quant == 14) return 1;                                                   /* MXFP4: blocks of 32 */
    return quant == 8;
}

static int64_t task_rows(int64_t rows) {
    const int64_t want = (rows + pool.threads * TASKS_PER_THREAD - 1) / (pool.threads * TASKS_PER_THREAD);
    return want <= ROWS_PER_TASK ? ROWS_PER_TASK : (want + ROWS_PER_TASK - 1) / ROWS_PER_TASK * ROWS_PER_TASK;
}

static const void *scale_of(int quant, const void *scales, int64_t row, int64_t cols, int64_t group) {
    if (quant >= 10) return NULL;                                                  /* inside the blocks */
    return quant == 8 ? (const void *)((const float *)scales + row)
                      : (const void *)((const uint16_t *)scales + row * (cols / group));   /* 4, 5, and 9 (group 32) */
}

/* Rows [r0, r1) of a matrix against the activation rows of A: int4 in panels where the CPU's body
 * takes them (panels.h), the GGUF blocks in their tiles, the rest a row at a time. Such a row's
 * dots first ask for the bytes STREAM_LEAD on, a line each (the hardware prefetcher alone read an
 * int8 matrix at 69-81 % of the read bandwidth, 4 KiB ahead 79-86 %; Sapphire Rapids, two threads). */
static void matrix_rows(int quant, const void *w, const void *scales, int64_t cols, int64_t group, int64_t r0,
                        int64_t r1, const act_rows *A) {
#if defined(__x86_64__)
    if (quant == 4 && int4_panels) r0 = int4_panel_rows(w, scales, cols, group, r0, r1, A);
    if (quant >= 10 && ktiles) {
        kquant_rows(quant, w, cols, r0, r1, A);
        return;
    }
#endif
    const dot_fn dot = dot_for(quant);
    const int64_t nb = cols / QK, bytes = row_bytes(quant, cols);
    for (int64_t r = r0; r < r1; r++) {
        const void *wr = (const char *)w + r * bytes, *ws = scale_of(quant, scales, r, cols, group);
        read_ahead(wr, bytes);
        for (int64_t i = 0; i < A->n; i++) {
            const int64_t row = A->row ? A->row[i] : i;
            A->y[i * A->y_stride + r] = dot(wr, ws, A->q + row * cols, A->s + row * nb, A->sum + row * nb, cols, group);
        }
    }
}

/* matrix_rows for a matrix of `rows` rows stored as `quant`: 5 is int4 whose first rows - rows % 8
 * rows are panels (kernels.to_panels; r0 a whole panel), the rows past them int4 rows. */
static void stored_rows(int quant, const void *w, const void *scales, int64_t rows, int64_t cols, int64_t group,
                        int64_t r0, int64_t r1, const act_rows *A) {
    if (quant != 5) {
        matrix_rows(quant, w, scales, cols, group, r0, r1, A);
        return;
    }
    const int64_t panels_end = rows - rows % PANEL, r = r1 < panels_end ? r1 : panels_end;
#if defined(__x86_64__)
    int4_stored_panel_rows(w, scales, cols, group, r0, r, A);
#endif
    matrix_rows(4, w, scales, cols, group, r > r0 ? r : r0, r1, A);
}

static void gate_up_task(void *ctx, int64_t task) {
    const layer *L = ctx;
    const int64_t e = L->task_expert[task], r0 = L->task_row[task], first = L->start[e];
    const int64_t r1 = r0 + L->chunk < 2 * L->I ? r0 + L->chunk : 2 * L->I;
    const act_rows A = {L->xq, L->xs, L->xsum, L->rows + first, L->h + first * 2 * L->I, 2 * L->I,
                        L->start[e + 1] - first};
    stored_rows(L->ex[e].panels ? 5 : L->quant, L->ex[e].gu, L->ex[e].gu_scale, 2 * L->I, L->E, L->group, r0, r1, &A);
    if (L->act)
        for (int64_t i = 0; i < A.n; i++)
            for (int64_t r = r0; r < r1; r++) A.y[i * A.y_stride + r] += L->act->gu_bias[e][r];
}

static void act_task(void *ctx, int64_t p) {
    const layer *L = ctx;
    float *g = L->h + p * 2 * L->I, *u = g + L->I;
    if (L->act) {
        const float a = L->act->alpha, lim = L->act->limit;
        for (int64_t i = 0; i < L->I; i++) {
            const float gi = g[i] < lim ? g[i] : lim, ui = u[i] < -lim ? -lim : (u[i] > lim ? lim : u[i]);
            g[i] = (ui + 1.0f) * gi / (1.0f + expf(-a * gi));
        }
    } else {
        for (int64_t i = 0; i < L->I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    quantize_row(g, L->I, L->hq + p * L->I, L->hs + p * (L->I / QK), L->hsum + p * (L->I / QK), int4_order(L->quant_dn));
}

static void down_task(void *ctx, int64_t task) {
    const layer *L = ctx;
    const int64_t e = L->task_expert[task], r0 = L->task_row[task], first = L->start[e];
    const int64_t r1 = r0 + L->chunk < L->E ? r0 + L->chunk : L->E;
    const act_rows A = {L->hq + first * L->I, L->hs + first * (L->I / QK), L->hsum + first * (L->I / QK), NULL,
                        L->y + first * L->E, L->E, L->start[e + 1] - first};
    stored_rows(L->ex[e].panels ? 5 : L->quant_dn, L->ex[e].dn, L->ex[e].dn_scale, L->E, L->I, L->group, r0, r1, &A);
    if (L->act)
        for (int64_t i = 0; i < A.n; i++)
            for (int64_t r = r0; r < r1; r++) A.y[i * A.y_stride + r] += L->act->dn_bias[e][r];
}

static int64_t plan_tasks(layer *L, int64_t rows) {
    L->chunk = task_rows(rows * L->n_exp);
    const int64_t per = (rows + L->chunk - 1) / L->chunk;
    int64_t n = 0;
    for (int64_t e = 0; e < L->n_exp; e++)
        for (int64_t k = 0; k < per; k++) L->task_expert[n] = e, L->task_row[n++] = k * L->chunk;
    return n;
}

/* Returns 0, or -1 when the shapes are not supported (the caller uses its portable path).
 * quant: gate_up's code, and down's in bits 8-15 when it differs. act: NULL for SwiGLU experts,
 * else gpt-oss's (moe_layer_act). */
static int run_layer(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
                     const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
                     float *out, const act_params *act) {
    const int q_gu = quant & 0xff, q_dn = (quant >> 8) ? (quant >> 8) : q_gu;
    if (!takes(q_gu, E, group) || !takes(q_dn, I, group)) return -1;
    choose_isa();
    for (int64_t e = 0; e < n_exp; e++)                     /* panels: int4 where the body has them (HostPanels) */
        if (ex[e].panels && !(int4_panels && q_gu == 4 && q_dn == 4)) return -1;
    const int64_t pairs = start[n_exp], most_rows = 2 * I > E ? 2 * I : E;
    layer L = {E, I, group, n_exp, q_gu, q_dn, ex, start, rows, weights};
    L.act = act;
    const int64_t max_tasks = n_exp * ((most_rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
    const size_t sizes[] = {T * E, 4 * T * (E / QK), 4 * T * (E / QK), 4 * pairs * 2 * I, pairs * I,   /* as below */
                            4 * pairs * (I / QK), 4 * pairs * E, 4 * pairs * (I / QK), 8 * max_tasks, 8 * max_tasks};
    void *part[10], *block = scratch_parts(sizes, 10, part);
    if (!block) return -1;
    L.xq = part[0], L.xs = part[1], L.xsum = part[2], L.h = part[3], L.hq = part[4];
    L.hs = part[5], L.y = part[6], L.hsum = part[7], L.task_expert = part[8], L.task_row = part[9];
    quantize_rows(x, T, E, (int8_t *)L.xq, (float *)L.xs, (int32_t *)L.xsum, int4_order(q_gu));
    parallel(gate_up_task, &L, plan_tasks(&L, 2 * I));
    parallel(act_task, &L, pairs);
    parallel(down_task, &L, plan_tasks(&L, E));
    for (int64_t p = 0; p < pairs; p++) {        /* fixed order: the caller's expert order */
        float *o = out + (int64_t)rows[p] * E;
        const float w = weights[p], *y = L.y + p * E;
        for (int64_t c = 0; c < E; c++) o[c] += w * y[c];
    }
    scratch_give(block);
    return 0;
}

int moe_layer(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
              const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
              float *out) {
    return run_layer(x, T, E, I, quant, group, n_exp, ex, start, rows, weights, out, NULL);
}

/* moe_layer for gpt-oss's experts: biases per expert (gu_bias[i], dn_bias[i] for the i-th
 * expert of this call), and the clamped, alpha-scaled gate. */
int moe_layer_act(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
                  const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
                  float *out, float alpha, float limit, const float *const *gu_bias, const float *const *dn_bias) {
    const act_params act = {alpha, limit, gu_bias, dn_bias};
    return run_layer(x, T, E, I, quant, group, n_exp, ex, start, rows, weights, out, &act);
}

#include "posted.h"

#include "linear.h"
#include "weights.h"
#include "dequant.h"
#include "kv.h"
#include "kv_write.h"
#include "step.h"
#include "mla.h"
#include "delta.h"
