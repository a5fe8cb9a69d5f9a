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

int moe_linear(const float *x, int64_t T, int64_t C, int64_t R, int quant, int64_t group, const void *w,
               const void *scales, float *y) {
    choose_isa();
    if (C % QK || ((quant == 4 || quant == 5) && group % QK) || (quant == 9 && group != QK) ||
        (quant != 4 && quant != 8 && quant != 9 && !(quant == 5 && int4_panels))) return -1;
    int8_t *xq = malloc(T * C);
    float *xs = malloc(sizeof(float) * T * (C / QK));
    int32_t *xsum = malloc(4 * T * (C / QK));
    quantize_rows(x, T, C, xq, xs, xsum, int4_order(quant));
    linear L = {w, scales, quant, T, R, C, group, xq, xs, xsum, y, task_rows(R)};
    parallel(linear_task, &L, (R + L.chunk - 1) / L.chunk);
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
