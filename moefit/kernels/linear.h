/* One quantised matrix (the dense path with --dense-quant, and a prompt's matrices where the
 * integer dots are the fastest way): included by moe.c after the layer code, whose row
 * functions (stored_rows) it shares. */

/* ---- one quantised matrix: y [T, R] = x [T, C] W^T, rows split over the pool ------------- */
typedef struct {
    const void *w, *scales;
    int quant;
    int64_t T, R, C, group;
    const int8_t *xq;
    const float *xs;
    const int32_t *xsum;
    float *y;
    int64_t chunk;
} linear;

static void linear_task(void *ctx, int64_t task) {
    const linear *L = ctx;
    const int64_t r0 = task * L->chunk, r1 = r0 + L->chunk < L->R ? r0 + L->chunk : L->R;
    const act_rows A = {L->xq, L->xs, L->xsum, NULL, L->y, L->R, L->T};
    stored_rows(L->quant, L->w, L->scales, L->R, L->C, L->group, r0, r1, &A);
}

/* whether moe_linear takes a matrix of C columns stored as quant (group: int4's, Q8_0's) */
static int linear_takes(int64_t C, int quant, int64_t group) {
    choose_isa();
    return !(C % QK || ((quant == 4 || quant == 5) && group % QK) || (quant == 9 && group != QK) ||
             (quant != 4 && quant != 8 && quant != 9 && !(quant == 5 && int4_panels)));
}

int moe_linear(const float *x, int64_t T, int64_t C, int64_t R, int quant, int64_t group, const void *w,
               const void *scales, float *y) {
    if (!linear_takes(C, quant, group)) return -1;
    int8_t *xq = malloc(T * C);
    float *xs = malloc(sizeof(float) * T * (C / QK));
    int32_t *xsum = malloc(4 * T * (C / QK));
    quantize_rows(x, T, C, xq, xs, xsum, int4_order(quant));
    linear L = {w, scales, quant, T, R, C, group, xq, xs, xsum, y, task_rows(R)};
    parallel(linear_task, &L, (R + L.chunk - 1) / L.chunk);
    free(xq), free(xs), free(xsum);
    return 0;
}

/* ---- each head its own matrix: y [H, T, R] = x [H, T, C] W_h^T ------------------------------
 * MLA's per-head key and value products (models/deepseek_v3.py): the H matrices [R, C] stacked
 * [H R, C] and quantised as moe_linear takes them, head h's rows meeting head h's activation rows
 * only. A task is a run of one head's rows. */
typedef struct {
    linear L;                           /* R: a head's rows */
    int64_t heads, per_head;            /* tasks a head */
} heads_linear;

static void heads_task(void *ctx, int64_t task) {
    const heads_linear *P = ctx;
    const linear *L = &P->L;
    const int64_t h = task / P->per_head, nb = L->C / QK;
    const int64_t r0 = h * L->R + task % P->per_head * L->chunk, end = (h + 1) * L->R;
    const int64_t r1 = r0 + L->chunk < end ? r0 + L->chunk : end;
    /* output t, global row r -> y [h, t, r - h R]: the base h R (T - 1) floats on */
    const act_rows A = {L->xq + h * L->T * L->C, L->xs + h * L->T * nb, L->xsum + h * L->T * nb, NULL,
                        L->y + h * L->R * (L->T - 1), L->R, L->T};
    stored_rows(L->quant, L->w, L->scales, P->heads * L->R, L->C, L->group, r0, r1, &A);
}

/* Returns -1 where moe_linear would, or for R not a multiple of 16 (a panel's rows stay in one head). */
int moe_linear_heads(const float *x, int64_t H, int64_t T, int64_t C, int64_t R, int quant, int64_t group,
                     const void *w, const void *scales, float *y) {
    choose_isa();
    if (C % QK || R % 16 || ((quant == 4 || quant == 5) && group % QK) || (quant == 9 && group != QK) ||
        (quant != 4 && quant != 8 && quant != 9 && !(quant == 5 && int4_panels))) return -1;
    int8_t *xq = malloc(H * T * C);
    float *xs = malloc(sizeof(float) * H * T * (C / QK));
    int32_t *xsum = malloc(4 * H * T * (C / QK));
    quantize_rows(x, H * T, C, xq, xs, xsum, int4_order(quant));
    /* a head a task where there are heads enough for the pool: a task of a few rows of short
     * matrices ran at half the bandwidth (GLM-4.7-Flash's W_uk^T, 20 heads of 512 x 192: 92 -> 44 us) */
    const int64_t chunk = H >= 2 * pool.threads ? R : task_rows(R);
    heads_linear P = {{w, scales, quant, T, R, C, group, xq, xs, xsum, y, chunk}, H, 0};
    P.per_head = (R + P.L.chunk - 1) / P.L.chunk;
    parallel(heads_task, &P, H * P.per_head);
    free(xq), free(xs), free(xsum);
    return 0;
}

/* A SwiGLU MLP in one call (a dense layer's, a shared expert's): [g | u] = W_gu x, y [T, E] =
 * W_down (silu(g) * u), both matrices as moe_linear takes them (W_gu [2I, E], W_down [E, I]).
 * torch spent more on the chunk, the silu and the product between them than on the two small
 * products at one token (bench/layer_cost.py). Returns as moe_linear. */
int moe_swiglu(const float *x, int64_t T, int64_t E, int64_t I, int gu_quant, int64_t gu_group, const void *gu,
               const void *gu_scales, int down_quant, int64_t down_group, const void *down, const void *down_scales,
               float *y) {
    float *gate_up = malloc(sizeof(float) * T * 2 * I), *h = malloc(sizeof(float) * T * I);
    int rc = moe_linear(x, T, E, 2 * I, gu_quant, gu_group, gu, gu_scales, gate_up);
    for (int64_t t = 0; rc == 0 && t < T; t++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[t * 2 * I + i];
            h[t * I + i] = g / (1.0f + expf(-g)) * gate_up[t * 2 * I + I + i];
        }
    if (rc == 0) rc = moe_linear(h, T, I, E, down_quant, down_group, down, down_scales, y);
    free(gate_up), free(h);
    return rc;
}
