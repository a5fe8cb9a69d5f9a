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
