/* Gated DeltaNet's decode step on the host, in one call: what models/qwen3_5_moe.py's delta_net
 * does between in_proj and out_proj for one token (Qwen3.5 / 3.6-MoE, Qwen3-Next), with
 * models/deltanet.py's recurrence (included by moe.c, after rows.h):
 *
 *   qkv = silu(causal conv of [conv window | mixed])     the window shifted by one, in place
 *   per value head h (key head h / (Hv / Hk)):
 *     q = l2norm(q) / sqrt(Dk),  k = l2norm(k),  beta = sigmoid(b_h),
 *     decay = exp(-exp(A_log_h) softplus(a_h + dt_bias_h))
 *     S = decay S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q     (S [Dk, Dv], fp32)
 *     out_h = RMSNorm(o) * norm_w * silu(z_h)
 *
 * Op by op this was ~20 torch operations a layer, and the state (Dk Dv floats a head: 2 MiB a
 * layer at Qwen3.6's 32 heads of 128 x 128) went through memory six times (scaled, read, an
 * outer product the size of the state, added, read). Here each head's state is read once and
 * written once: a block of its columns at a time (all 128 on AVX512: 24 of its 32 registers
 * hold S^T k, delta and o; 32 on AVX2, in 8-float vectors; 16 portable), rows in order, so the second pass (update,
 * output) reads what the first (S^T k) left in L1 / L2. Heads, and the conv's channels in
 * blocks, go over the pool.
 */

typedef struct {
    int64_t hk, hv, dk, dv, kernel;      /* key / value heads, their dims, the conv's taps */
    const float *conv_w;                 /* [C, kernel], C = 2 Hk Dk + Hv Dv */
    const float *a_log, *dt_bias;        /* [Hv] */
    const float *norm_w;                 /* [Dv] */
    float eps;                           /* the gated RMSNorm's */
} delta_weights;

typedef struct {
    const delta_weights *W;
    const float *proj;                   /* in_proj's output: mixed [C], z [Hv Dv], b [Hv], a [Hv] */
    float *conv, *qkv;                   /* the conv window [C, kernel - 1]; qkv [C] after the conv */
    const float *z, *b, *a;
    float *s, *out;                      /* s [Hv, Dk, Dv]; out [Hv Dv] */
} delta_args;

#define CONV_BLOCK 512                   /* channels a conv task */

#define DELTA_MAX_DIM 512                /* head dims a step takes (Qwen3.5 / Next: 128) */

/* channel c of the causal conv (before its SiLU): its window [kernel - 1] and the new input, then
 * the window shifted; Qwen3.5 / Next's 4 taps unrolled */
static inline float conv_channel(float *window, const float *w, int64_t kernel, float x) {
    if (kernel == 4) {
        const float y = w[0] * window[0] + w[1] * window[1] + w[2] * window[2] + w[3] * x;
        window[0] = window[1], window[1] = window[2], window[2] = x;
        return y;
    }
    float y = w[kernel - 1] * x;
    for (int64_t j = 0; j < kernel - 1; j++) y += w[j] * window[j];
    for (int64_t j = 0; j + 2 < kernel; j++) window[j] = window[j + 1];
    window[kernel - 2] = x;
    return y;
}

#define DELTA_BODIES(ISA, TARGET)                                                                   \
    /* z sigmoid(z) for 16 lanes in place, times o r w where o is given; sigmoid from e = exp(-|z|) \
     * (exp16's range); VT vectors of VW lanes (VTI: their int32 lanes) */                        \
    TARGET static inline void silu16_##ISA(float *out, const float *o, float r, const float *w, const float *z) { \
        float e[16];                                                                                \
        for (int j = 0; j < 16; j += VW) {                                                          \
            const VT zv = LOADV(VT, z + j), zero = {0};                                             \
            const VTI neg = zv < zero;                                                              \
            STOREV(VT, e + j, (VT)((VTI)zv & ~neg) * -1.0f + (VT)((VTI)zv & neg));                  \
        }                                                                                           \
        exp16_##ISA(e);                                                                             \
        for (int j = 0; j < 16; j += VW) {                                                          \
            const VT zv = LOADV(VT, z + j), ev = LOADV(VT, e + j), zero = {0}, one = zero + 1.0f;   \
            const VTI neg = zv < zero;                                                              \
            const VT sig = (VT)(((VTI)(one / (one + ev)) & ~neg) | ((VTI)(ev / (one + ev)) & neg)); \
            STOREV(VT, out + j, o ? LOADV(VT, o + j) * r * LOADV(VT, w + j) * zv * sig : zv * sig); \
        }                                                                                           \
    }                                                                                               \
    /* columns c .. c + VW nv of one head's state: pred = S^T k (decayed), delta, S updated, o */  \
    TARGET static inline __attribute__((always_inline)) void delta_columns_##ISA(float *S, int64_t dk, \
            int64_t dv, int64_t c, int nv, const float *q, const float *k, const float *v, float decay, \
            float beta, float *o) {                                                                 \
        VT p[NV], d[NV], acc[NV];                                                                   \
        for (int u = 0; u < nv; u++) p[u] = acc[u] = (VT){0};                                       \
        for (int64_t i = 0; i < dk; i++)                                                            \
            for (int u = 0; u < nv; u++) p[u] += LOADV(VT, S + i * dv + c + VW * u) * k[i];         \
        for (int u = 0; u < nv; u++) d[u] = (LOADV(VT, v + c + VW * u) - p[u] * decay) * beta;      \
        for (int64_t i = 0; i < dk; i++)                                                            \
            for (int u = 0; u < nv; u++) {                                                          \
                const VT row = LOADV(VT, S + i * dv + c + VW * u) * decay + d[u] * k[i];            \
                STOREV(VT, S + i * dv + c + VW * u, row);                                           \
                acc[u] += row * q[i];                                                               \
            }                                                                                       \
        for (int u = 0; u < nv; u++) STOREV(VT, o + c + VW * u, acc[u]);                            \
    }                                                                                               \
    /* channels CONV_BLOCK b .. of the conv, and their SiLU */                                      \
    TARGET static void conv_task_##ISA(void *ctx, int64_t blk) {                                    \
        const delta_args *A = ctx;                                                                  \
        const int64_t C = 2 * A->W->hk * A->W->dk + A->W->hv * A->W->dv, K = A->W->kernel;          \
        const int64_t c0 = blk * CONV_BLOCK, c1 = c0 + CONV_BLOCK < C ? c0 + CONV_BLOCK : C;        \
        for (int64_t c = c0; c < c1; c++)                                                           \
            A->qkv[c] = conv_channel(A->conv + c * (K - 1), A->W->conv_w + c * K, K, A->proj[c]);   \
        for (int64_t c = c0; c < c1; c += 16) silu16_##ISA(A->qkv + c, NULL, 0.0f, NULL, A->qkv + c); \
    }                                                                                               \
    TARGET static void delta_head_##ISA(void *ctx, int64_t h) {                                     \
        const delta_args *A = ctx;                                                                  \
        const delta_weights *W = A->W;                                                              \
        const int64_t dk = W->dk, dv = W->dv, kh = h / (W->hv / W->hk);                             \
        const float *q = A->qkv + kh * dk, *k = A->qkv + (W->hk + kh) * dk;                         \
        const float *v = A->qkv + 2 * W->hk * dk + h * dv;                                          \
        float qn[DELTA_MAX_DIM], kn[DELTA_MAX_DIM], o[DELTA_MAX_DIM];                               \
        const float rq = 1.0f / sqrtf(dot16_##ISA(q, q, dk) + 1e-6f) / sqrtf((float)dk);            \
        const float rk = 1.0f / sqrtf(dot16_##ISA(k, k, dk) + 1e-6f);                               \
        for (int64_t i = 0; i < dk; i++) qn[i] = q[i] * rq, kn[i] = k[i] * rk;                      \
        const float x = A->a[h] + W->dt_bias[h], soft = x > 20.0f ? x : log1pf(expf(x));            \
        const float decay = expf(-expf(W->a_log[h]) * soft), beta = 1.0f / (1.0f + expf(-A->b[h])); \
        float *S = A->s + h * dk * dv;                                                              \
        int64_t c = 0;                                                                              \
        for (; c + VW * NV <= dv; c += VW * NV) delta_columns_##ISA(S, dk, dv, c, NV, qn, kn, v, decay, beta, o); \
        for (; c < dv; c += VW) delta_columns_##ISA(S, dk, dv, c, 1, qn, kn, v, decay, beta, o);   \
        const float r = 1.0f / sqrtf(dot16_##ISA(o, o, dv) / (float)dv + W->eps);                   \
        const float *z = A->z + h * dv;                                                             \
        for (int64_t j = 0; j < dv; j += 16) silu16_##ISA(A->out + h * dv + j, o + j, r, W->norm_w + j, z + j); \
    }

/* The state's columns in vectors of VT (VW floats: the instruction set's own register, AVX512's 16,
 * AVX2's 8, plain x86-64's 4; GCC lowered 16-float vectors on AVX2 through the stack, measured 1.15 ms
 * a layer against 0.14 now, in cache); NV: vectors a pass keeps in registers (three arrays of them) */
#if defined(__x86_64__)
#define VT v16
#define VTI v16i
#define VW 16
#define NV 8
DELTA_BODIES(avx512, __attribute__((target("avx512f,fma"))))
#undef VT
#undef VTI
#undef VW
#undef NV
#define VT v8
#define VTI v8i
#define VW 8
#define NV 4
DELTA_BODIES(avx2, __attribute__((target("avx2,fma"))))
#undef VT
#undef VTI
#undef VW
#undef NV
#endif
#define VT v4
#define VTI v4i
#define VW 4
#define NV 4
DELTA_BODIES(plain, PLAIN)
#undef VT
#undef VTI
#undef VW
#undef NV

/* One token: proj [C + Hv Dv + 2 Hv] is in_proj's output (mixed q|k|v before the conv, z, b, a);
 * conv [C, kernel - 1] and s [Hv, Dk, Dv] are the layer's state, updated in place; out [Hv Dv]
 * goes to out_proj. Returns -1 for shapes it does not take (head dims not multiples of 16 or
 * above DELTA_MAX_DIM, value heads not a multiple of key heads, a conv of fewer than 2 taps). */
int moe_delta_step(const delta_weights *W, const float *proj, float *conv, float *s, float *out) {
    if (W->dk % 16 || W->dv % 16 || W->dk > DELTA_MAX_DIM || W->dv > DELTA_MAX_DIM || W->hv % W->hk || W->kernel < 2)
        return -1;
    choose_rows_isa();
    const int64_t C = 2 * W->hk * W->dk + W->hv * W->dv;
    float *qkv = malloc(sizeof(float) * C);
    const float *z = proj + C, *b = z + W->hv * W->dv;
    delta_args A = {W, proj, conv, qkv, z, b, b + W->hv, s, out};
    task_fn conv_task = conv_task_plain, head = delta_head_plain;
#if defined(__x86_64__)
    if (!strncmp(isa, "avx512", 6)) conv_task = conv_task_avx512, head = delta_head_avx512;
    else if (strcmp(isa, "portable")) conv_task = conv_task_avx2, head = delta_head_avx2;
#endif
    parallel(conv_task, &A, (C + CONV_BLOCK - 1) / CONV_BLOCK);
    parallel(head, &A, W->hv);
    free(qkv);
    return 0;
}

/* ---- the sublayer as a block ------------------------------------------------------------------
 * A decode step's whole DeltaNet sublayer in one call, as step.h's block for a GQA layer: x [E] the
 * residual stream, RMS-normed by the layer's input norm; in_proj (moe_linear) -> proj; the step
 * above; out_proj (moe_linear) -> y; out [E] = x + y and h [E] its post-attention norm (rows.h's
 * rms_row, as moe_rms_norm): the numbers of the calls it replaces. */
typedef struct {
    int64_t E, P;                        /* hidden size; in_proj's rows, C + Hv Dv + 2 Hv */
    int in_quant, out_quant;             /* in_proj [P, E] and out_proj [E, Hv Dv] as moe_linear takes them */
    int64_t in_group, out_group;
    const void *in_w, *in_scales, *out_w, *out_scales;
    const float *in_norm, *post_norm;    /* [E] */
    float eps;                           /* the model's */
} delta_block;

/* Returns -1, before anything is changed, for shapes it (or the step) does not take. */
int moe_delta_block(const delta_weights *W, const delta_block *B, const float *x, float *conv, float *s, float *out,
                    float *h) {
    const int64_t C = 2 * W->hk * W->dk + W->hv * W->dv, V = W->hv * W->dv;
    if (W->dk % 16 || W->dv % 16 || W->dk > DELTA_MAX_DIM || W->dv > DELTA_MAX_DIM || W->hv % W->hk ||
        W->kernel < 2 || B->E % 16 || B->P != C + V + 2 * W->hv || !linear_takes(B->E, B->in_quant, B->in_group) ||
        !linear_takes(V, B->out_quant, B->out_group))
        return -1;
    float *normed = malloc(sizeof(float) * B->E), *proj = malloc(sizeof(float) * B->P), *o = malloc(sizeof(float) * V);
    choose_rows_isa();
    rms_row(x, B->E, B->in_norm, B->eps, normed);
    int rc = moe_linear(normed, 1, B->E, B->P, B->in_quant, B->in_group, B->in_w, B->in_scales, proj);
    if (rc == 0) rc = moe_delta_step(W, proj, conv, s, o);
    if (rc == 0) rc = moe_linear(o, 1, V, B->E, B->out_quant, B->out_group, B->out_w, B->out_scales, out);
    if (rc == 0) {
        for (int64_t i = 0; i < B->E; i++) out[i] += x[i];
        rms_row(out, B->E, B->post_norm, B->eps, h);
    }
    free(normed), free(proj), free(o);
    return rc;
}
