/* One position's attention on the host in one call (a decode step of a GQA layer whose cache is
 * plain fp32 rows):
 *
 *   qkv = W x (+ bias)                    the fused projection, quantised (moe_linear)
 *   q, k = their heads RMS-normed (QK-norm, when given) and rotated (RoPE on the first `rot`)
 *   the cache's row `pos` = k, v          written in place, as the state's write would
 *   out [H, Dv] = softmax(q . k[0..pos] * scale) . v[0..pos]     (moe_attend_one)
 *   out *= sigmoid(gate)                  gated heads (Qwen3.5 / Next): each head's query is
 *                                         followed by its output gate in the projection
 *
 * Between these, torch and Python cost more than the work: each operation there runs with cold
 * caches after the matrices streamed through them (measured ~50-100 us a call where a warm loop
 * takes ~10), and a layer's attention was about fifteen of them. */

typedef struct {
    int64_t E, H, K, D, Dv;             /* hidden size, query heads, kv heads, head dims */
    int quant;                          /* the qkv matrix as moe_linear takes it */
    int64_t group;
    const void *w, *scales;
    const float *bias;                  /* [H D + K D + K Dv] or NULL */
    const float *q_norm, *k_norm;       /* [D] or NULL */
    float eps, scale;
    int gated;                          /* q rows [H, 2D]: each head's query, then its gate */
} attention_step;

int moe_attention_step(const attention_step *A, const float *x, int64_t pos, const float *cos, const float *sin,
                       int64_t rot, float *k_cache, float *v_cache, int64_t capacity, float *out) {
    const int64_t q_width = A->H * A->D * (A->gated ? 2 : 1), width = q_width + A->K * A->D + A->K * A->Dv;
    if (A->D % 16 || A->Dv % 16 || rot % 2 || rot > A->D || pos >= capacity || A->H % A->K || A->H / A->K > 16 ||
        (A->gated && A->Dv != A->D))
        return -1;
    float *qkv = malloc(sizeof(float) * width), *q = malloc(sizeof(float) * A->H * A->D);
    int rc = moe_linear(x, 1, A->E, width, A->quant, A->group, A->w, A->scales, qkv);
    if (rc == 0) {
        if (A->bias)
            for (int64_t i = 0; i < width; i++) qkv[i] += A->bias[i];
        const float *k = qkv + q_width, *v = k + A->K * A->D;
        head_rows_to(qkv, 1, A->H, A->D, width, A->D * (A->gated ? 2 : 1), A->q_norm, A->eps, cos, sin, rot, q, A->D);
        head_rows_to(k, 1, A->K, A->D, width, A->D, A->k_norm, A->eps, cos, sin, rot, k_cache + pos * A->D,
                     capacity * A->D);
        for (int64_t h = 0; h < A->K; h++)
            memcpy(v_cache + (h * capacity + pos) * A->Dv, v + h * A->Dv, sizeof(float) * A->Dv);
        rc = moe_attend_one(q, k_cache, v_cache, A->H, A->K, pos + 1, A->D, A->Dv, capacity * A->D,
                            capacity * A->Dv, A->scale, out);
        for (int64_t h = 0; A->gated && h < A->H; h++)
            for (int64_t c = 0; c < A->Dv; c++) {
                const float g = qkv[h * 2 * A->D + A->D + c];
                out[h * A->Dv + c] *= 1.0f / (1.0f + expf(-g));
            }
    }
    free(qkv), free(q);
    return rc;
}
