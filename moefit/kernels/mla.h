/* One position of MLA's attention on the host in one call (a decode step of models/deepseek_v3.py
 * with its matrices quantised, --dense-quant), to the output projection's input:
 *
 *   c_q = RMSNorm(W_qa x)                 the query's low rank (q_lora_rank; without it c_q = x)
 *   q = W_q c_q  [H, dn + dr]             each head's nope query, then its rope query
 *   q_c[h] = W_uk[h]^T q_nope[h]  [r]     the nope query in the latent, head by head (linear.h)
 *   c, k_r = W_kva x  [r], [dr]           the token's latent, RMS-normed, and its rope key
 *   q_r, k_r rotated                      RoPE on pairs (x0, x1), ... written out de-interleaved,
 *                                         or rotate-half: what the family's `rotate` does
 *   the stores' row pos = k_r, c          fp32 / fp16 / bf16, int8 codes and a scale, or q4 (kv_codecs.py:
 *                                         turned, so q_r and q_c are turned as their store's rows
 *                                         are, and the attention's latent output turned back)
 *   o[h] = W_uv[h] moe_attend_latent([q_c | q_r], the stores' rows 0..pos)[h]    [H, dv]
 *
 * The torch route was about twenty operations between these, each with cold caches after the
 * matrices streamed through (bench/layer_cost.py: ~390 us a layer against GQA's ~75 in one call). */

typedef struct {
    int quant;                          /* as moe_linear takes it */
    int64_t group;
    const void *w, *scales;
} mla_matrix;

typedef struct {
    int64_t E, H, r, dr, dn, dv, q_rank;    /* hidden, heads, latent rank, rope / nope / value dims, query rank */
    mla_matrix q_a, q, kv_a, uk, uv;        /* uk [H r, dn], uv [H dv, r]: each head's, stacked */
    const float *q_norm, *kv_norm;
    float eps, scale;
    int interleaved;                        /* DeepSeek's rope_interleave */
    mla_matrix o;                           /* o_proj [E, H dv], for a block (w NULL: none) */
    const float *in_norm, *post_norm;       /* [E] the layer's two RMSNorms, for a block */
} mla_step;

/* whether the call can be a block (as step.h's): o_proj, and both norms */
static int mla_takes_block(const mla_step *A) {
    return A->o.w && A->in_norm && A->post_norm && A->E % 16 == 0 && linear_takes(A->H * A->dv, A->o.quant, A->o.group);
}

/* x [n] rotated in place by cos, sin [n] (the position's row of the table) */
static void mla_rope(float *x, int64_t n, const float *cos, const float *sin, int interleaved) {
    const int64_t half = n / 2;
    float t[n];
    for (int64_t i = 0; i < half; i++) {
        const float a = interleaved ? x[2 * i] : x[i], b = interleaved ? x[2 * i + 1] : x[i + half];
        t[i] = a * cos[i] - b * sin[i];
        t[i + half] = b * cos[i + half] + a * sin[i + half];
    }
    memcpy(x, t, sizeof(float) * n);
}

static int mla_linear(const mla_matrix *m, const float *x, int64_t cols, int64_t rows, float *y) {
    return moe_linear(x, 1, cols, rows, m->quant, m->group, m->w, m->scales, y);
}

static int mla_heads(const mla_matrix *m, const float *x, int64_t H, int64_t cols, int64_t rows, float *y) {
    return moe_linear_heads(x, H, 1, cols, rows, m->quant, m->group, m->w, m->scales, y);
}

/* the query [H, r + dr] attention takes: q_c through the heads' W_uk^T, then q_r rotated */
static int mla_query(const mla_step *A, const float *x, const float *cos, const float *sin, float *q_abs) {
    const int64_t in = A->q_rank ? A->q_rank : A->E, width = A->dn + A->dr;
    float *c_q = malloc(sizeof(float) * in), *q = malloc(sizeof(float) * A->H * width),
          *nope = malloc(sizeof(float) * A->H * A->dn), *q_c = malloc(sizeof(float) * A->H * A->r);
    int rc = 0;
    if (A->q_rank) {
        rc = mla_linear(&A->q_a, x, A->E, A->q_rank, c_q);
        if (rc == 0) rms_row(c_q, A->q_rank, A->q_norm, A->eps, c_q);
    } else
        memcpy(c_q, x, sizeof(float) * A->E);
    if (rc == 0) rc = mla_linear(&A->q, c_q, in, A->H * width, q);
    for (int64_t h = 0; rc == 0 && h < A->H; h++) memcpy(nope + h * A->dn, q + h * width, sizeof(float) * A->dn);
    if (rc == 0) rc = mla_heads(&A->uk, nope, A->H, A->dn, A->r, q_c);
    for (int64_t h = 0; rc == 0 && h < A->H; h++) {
        float *row = q_abs + h * (A->r + A->dr);
        memcpy(row, q_c + h * A->r, sizeof(float) * A->r);
        memcpy(row + A->r, q + h * width + A->dn, sizeof(float) * A->dr);
        mla_rope(row + A->r, A->dr, cos, sin, A->interleaved);
    }
    free(c_q), free(q), free(nope), free(q_c);
    return rc;
}

/* x [E] at position pos; cos, sin [dr]; k, v: the layer's rope keys [C, dr] and latents [C, r]
 * (one head, any codec kv.h writes), row pos written -> out [H, dv]. With h, a block (step.h's): x the
 * residual stream, normed by in_norm first; out [E] = x + o_proj(heads) and h [E] its post-attention
 * norm. Returns -1 for shapes or codecs it does not take, before writing anything. */
int moe_mla_step(const mla_step *A, const float *x, int64_t pos, const float *cos, const float *sin,
                 const kv_rows *k, const kv_rows *v, float *out, float *h) {
    for (const kv_rows *s = k; s; s = s == k ? v : NULL)
        if (!kv_writes(s) || pos >= s->capacity) return -1;
    if (k->n != A->dr || v->n != A->r || A->r % QK || A->dn % QK || A->dr % 16 || A->q_rank % 16 || A->dv % 16 ||
        (h && !mla_takes_block(A)))
        return -1;
    choose_rows_isa();
    float *q = malloc(sizeof(float) * A->H * (A->r + A->dr)), *kv = malloc(sizeof(float) * (A->r + A->dr)),
          *latent = malloc(sizeof(float) * A->r), *att = malloc(sizeof(float) * A->H * A->r);
    float *normed = h ? malloc(sizeof(float) * A->E) : NULL, *heads = h ? malloc(sizeof(float) * A->H * A->dv) : out;
    const float *residual = x;
    if (h) rms_row(x, A->E, A->in_norm, A->eps, normed), x = normed;
    int rc = mla_query(A, x, cos, sin, q);
    if (rc == 0) rc = mla_linear(&A->kv_a, x, A->E, A->r + A->dr, kv);
    if (rc == 0) {
        rms_row(kv, A->r, A->kv_norm, A->eps, latent);
        mla_rope(kv + A->r, A->dr, cos, sin, A->interleaved);
        kv_write_row(k, 0, pos, kv + A->r);
        kv_write_row(v, 0, pos, latent);
        for (int64_t h = 0; h < A->H; h++) {                 /* q4 stores: the query in their space */
            float *row = q + h * (A->r + A->dr);
            if (v->codec == 4) turn_rows(row, 1, A->r, v->rot, 0);
            if (k->codec == 4) turn_rows(row + A->r, 1, A->dr, k->rot, 0);
        }
        float *lse = malloc(sizeof(float) * A->H);
        rc = moe_attend_latent(q, 1, A->H, pos + 1, k, v, A->scale, att, lse);
        free(lse);
        if (rc == 0 && v->codec == 4) turn_rows(att, A->H, A->r, v->rot, 1);
    }
    if (rc == 0) rc = mla_heads(&A->uv, att, A->H, A->r, A->dv, heads);
    if (rc == 0 && h) {                                          /* o_proj, the residual, the next norm */
        rc = mla_linear(&A->o, heads, A->H * A->dv, A->E, out);
        for (int64_t i = 0; rc == 0 && i < A->E; i++) out[i] += residual[i];
        if (rc == 0) rms_row(out, A->E, A->post_norm, A->eps, h);
    }
    if (h) free(normed), free(heads);
    free(q), free(kv), free(latent), free(att);
    return rc;
}
