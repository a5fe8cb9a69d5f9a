/* One position's attention on the host in one call (a decode step of a GQA layer whose cache is
 * rows on the host in any of kv_codecs' codecs):
 *
 *   qkv = W x (+ bias)                    the fused projection, quantised (moe_linear)
 *   q, k = their heads RMS-normed (QK-norm, when given) and rotated (RoPE on the first `rot`)
 *   the cache's row `slot` = k, v         written in place, coded as the state's write would
 *   out [H, Dv] = softmax(q . k * scale) . v over the cache's runs of rows: the whole context
 *                                         (one run from 0), or a window's positions in a ring
 *                                         (one run of slots or two, merged by log-sum-exp)
 *   out *= sigmoid(lse - sink)            gpt-oss's attention sinks: a virtual key per head
 *   out *= sigmoid(gate)                  gated heads (Qwen3.5 / Next): each head's query is
 *                                         followed by its output gate in the projection
 *   y = O out (+ bias)                    the output projection, when the layer's is quantised
 *                                         too (moe_linear, as its own call would: the same numbers)
 *
 * As a block (h given), x is the residual stream rather than the attention's input: it is RMS-normed
 * by the layer's input norm first, and the call gives x + y and that sum's post-attention norm h,
 * with rows.h's rms_row as moe_rms_norm applies it: the numbers of the three calls it replaces.
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
    const float *sinks;                 /* [H] or NULL */
    int o_quant;                        /* the output projection [O, H Dv] as moe_linear takes it, */
    int64_t o_group, O;                 /* when o_w is given: out is then y [O] */
    const void *o_w, *o_scales;
    const float *o_bias;                /* [O] or NULL */
    const float *in_norm, *post_norm;   /* [E] the layer's two RMSNorms (the model's eps: `eps`), for a block */
} attention_step;

/* q [H, D] against the runs of rows (offset, count) of the caches -> out [H, Dv] and lse [H] */
static int attend_runs(const attention_step *A, const float *q, const kv_rows *k_cache, const kv_rows *v_cache,
                       const int64_t *runs, int64_t n_runs, float *out, float *lse) {
    float *o = malloc(sizeof(float) * A->H * A->Dv), *l = malloc(sizeof(float) * A->H);
    int rc = 0;
    for (int64_t r = 0; rc == 0 && r < n_runs; r++) {
        const kv_rows kr = kv_rows_from(k_cache, runs[2 * r]), vr = kv_rows_from(v_cache, runs[2 * r]);
        rc = moe_attend_stored(q, A->K, A->H / A->K, runs[2 * r + 1], &kr, &vr, A->scale, r ? o : out, r ? l : lse);
        for (int64_t h = 0; rc == 0 && r && h < A->H; h++) {      /* merged by log-sum-exp */
            const float top = lse[h] > l[h] ? lse[h] : l[h], a = expf(lse[h] - top), b = expf(l[h] - top);
            for (int64_t c = 0; c < A->Dv; c++)
                out[h * A->Dv + c] = (out[h * A->Dv + c] * a + o[h * A->Dv + c] * b) / (a + b);
            lse[h] = top + logf(a + b);
        }
    }
    free(o), free(l);
    return rc;
}

/* whether kv_write_row writes a row of this cache at `slot` (kv_write.h's kv_writes) */
static int writes_slot(const kv_rows *c, int64_t slot) {
    return kv_writes(c) && slot < c->capacity;
}

/* rows [m][n] turned in place by rot [n, n] (kv.h's kv_turn): y = x rot, or with `back` y = x rot^T
 * (q4's rows are stored turned: the query is turned as they are, the output turned back). The
 * op-by-op path turns a decode step's host rows through here too (moe_turn_rows), so both agree. */
static void turn_rows(float *x, int64_t m, int64_t n, const float *rot, int back) {
    float y[n];
    for (int64_t r = 0; r < m; r++) {
        kv_turn(x + r * n, y, n, rot, back);
        memcpy(x + r * n, y, sizeof(float) * n);
    }
}

int moe_turn_rows(float *x, int64_t m, int64_t n, const float *rot, int back) {
    turn_rows(x, m, n, rot, back);
    return 0;
}

/* whether step() takes these caches: K heads of D and Dv values, row `slot` written in both */
static int takes_caches(const attention_step *A, const kv_rows *k, const kv_rows *v, int64_t slot) {
    return writes_slot(k, slot) && writes_slot(v, slot) && k->n == A->D && v->n == A->Dv &&
           k->capacity == v->capacity;
}

/* out [O] = O heads (+ bias): the layer's output projection, moe_linear's numbers */
static int project(const attention_step *A, const float *heads, float *out) {
    const int rc = moe_linear(heads, 1, A->H * A->Dv, A->O, A->o_quant, A->o_group, A->o_w, A->o_scales, out);
    for (int64_t i = 0; rc == 0 && A->o_bias && i < A->O; i++) out[i] += A->o_bias[i];
    return rc;
}

/* whether the call can be a block: the projection in it, back to the hidden size, and both norms */
static int takes_block(const attention_step *A) {
    return A->o_w && A->O == A->E && A->E % 16 == 0 && A->in_norm && A->post_norm;
}

/* x [E] of one position (cos, sin its RoPE rows [rot]); the caches [K, capacity, D] and [K, capacity,
 * Dv] (rows of any codec kv.h writes; q4's query turned as its keys, its output back), row `slot`
 * written and the runs [n_runs][offset, count] attended -> out [H, Dv], or with the output
 * projection out [O]. With h, a block: x the residual stream, out [E] = x + y, h [E] its
 * post-attention norm. Returns -1, before writing anything, for shapes it does not take. */
int moe_attention_step(const attention_step *A, const float *x, const float *cos, const float *sin, int64_t rot,
                       const kv_rows *k_cache, const kv_rows *v_cache, int64_t slot, const int64_t *runs,
                       int64_t n_runs, float *out, float *h) {
    const int64_t q_width = A->H * A->D * (A->gated ? 2 : 1), width = q_width + A->K * A->D + A->K * A->Dv;
    if (A->D % 16 || A->Dv % 16 || rot % 2 || rot > A->D || !takes_caches(A, k_cache, v_cache, slot) ||
        A->H % A->K || A->H / A->K > 16 || (A->gated && A->Dv != A->D) || n_runs < 1 || n_runs > 2 ||
        (A->o_w && !linear_takes(A->H * A->Dv, A->o_quant, A->o_group)) || (h && !takes_block(A)))
        return -1;
    for (int64_t r = 0; r < n_runs; r++)
        if (runs[2 * r] < 0 || runs[2 * r + 1] < 1 || runs[2 * r] + runs[2 * r + 1] > k_cache->capacity) return -1;
    float *qkv = malloc(sizeof(float) * width), *q = malloc(sizeof(float) * A->H * A->D),
          *k = malloc(sizeof(float) * A->K * A->D), *lse = malloc(sizeof(float) * A->H);
    float *heads = A->o_w ? malloc(sizeof(float) * A->H * A->Dv) : out;        /* the heads' output */
    float *normed = h ? malloc(sizeof(float) * A->E) : NULL;                   /* a block's input norm */
    choose_rows_isa();
    if (h) rms_row(x, A->E, A->in_norm, A->eps, normed);
    int rc = moe_linear(h ? normed : x, 1, A->E, width, A->quant, A->group, A->w, A->scales, qkv);
    if (rc == 0) {
        if (A->bias)
            for (int64_t i = 0; i < width; i++) qkv[i] += A->bias[i];
        const float *v = qkv + q_width + A->K * A->D;
        head_rows_to(qkv, 1, A->H, A->D, width, A->D * (A->gated ? 2 : 1), A->q_norm, A->eps, cos, sin, rot, q, A->D);
        head_rows_to(qkv + q_width, 1, A->K, A->D, width, A->D, A->k_norm, A->eps, cos, sin, rot, k, A->D);
        for (int64_t h = 0; h < A->K; h++) {
            kv_write_row(k_cache, h, slot, k + h * A->D);
            kv_write_row(v_cache, h, slot, v + h * A->Dv);
        }
        if (k_cache->codec == 4) turn_rows(q, A->H, A->D, k_cache->rot, 0);
        rc = attend_runs(A, q, k_cache, v_cache, runs, n_runs, heads, lse);
        if (rc == 0 && v_cache->codec == 4) turn_rows(heads, A->H, A->Dv, v_cache->rot, 1);
        for (int64_t h = 0; rc == 0 && A->sinks && h < A->H; h++)
            for (int64_t c = 0; c < A->Dv; c++) heads[h * A->Dv + c] *= 1.0f / (1.0f + expf(A->sinks[h] - lse[h]));
        for (int64_t h = 0; rc == 0 && A->gated && h < A->H; h++)
            for (int64_t c = 0; c < A->Dv; c++) {
                const float g = qkv[h * 2 * A->D + A->D + c];
                heads[h * A->Dv + c] *= 1.0f / (1.0f + expf(-g));
            }
        if (rc == 0 && A->o_w) rc = project(A, heads, out);
        if (rc == 0 && h) {                                       /* the residual, and the next norm */
            for (int64_t i = 0; i < A->E; i++) out[i] += x[i];
            rms_row(out, A->E, A->post_norm, A->eps, h);
        }
    }
    if (A->o_w) free(heads);
    free(normed);
    free(qkv), free(q), free(k), free(lse);
    return rc;
}
