/* One quantised matrix as fp32 rows, over the pool (included by moe.c): a prompt's product of
 * many tokens then runs as torch's fp32 GEMM, which outpaces the integer dots there (the measures
 * and thresholds: GEMM_TOKENS in pack/quant.py for dense matrices; for an expert's, the rows where
 * the two cross on the machine, experts/costs.py crossover). Each weight is computed as pack/quant.py's dequantize (kblocks.py for the GGUF
 * blocks) computes it, so the two agree bit for bit. */
typedef struct {
    const void *w, *scales;
    int quant;
    int64_t R, C, group, chunk;
    float *out;
} dequant_args;

/* byte j of int4 row r: in rows, or (quant 5, rows past the last whole panel excepted) in a panel
 * of panels.h, codes [blocks][4 quads][8 rows][4 bytes] */
static inline uint8_t int4_byte(const dequant_args *D, int in_panel, int64_t r, int64_t j) {
    const uint8_t *w = D->w;
    if (!in_panel) return w[r * (D->C / 2) + j];
    return w[r / PANEL * PANEL * (D->C / 2) + j / 16 * 128 + j % 16 / 4 * 32 + r % PANEL * 4 + j % 4];
}

/* one row of GGUF blocks (kquants.h's layouts) as fp32, in pack/kblocks.py's order of operations:
 * the block's scale products first (d sc, dmin m), then code times scale, minus the offset */
static void dequant_q45k_row(const uint8_t *w, int64_t C, int fifth, float *o) {
    for (int64_t sb = 0; sb < C / QK_K; sb++, o += QK_K) {
        const uint8_t *blk = w + sb * (fifth ? 176 : 144), *qh = blk + 16, *codes = blk + (fifth ? 48 : 16);
        const float d = f16(blk), dmin = f16(blk + 2);
        for (int j = 0; j < 8; j++) {
            float sc, m;
            k4_scale_min(j, blk + 4, &sc, &m);
            const float ds = d * sc, dm = dmin * m;
            for (int i = 0; i < 32; i++) {
                int c = (codes[(j / 2) * 32 + i] >> (4 * (j & 1))) & 15;
                if (fifth) c |= ((qh[i] >> j) & 1) << 4;
                o[32 * j + i] = (float)c * ds - dm;
            }
        }
    }
}

static void dequant_q6k_row(const uint8_t *w, int64_t C, float *o) {
    for (int64_t sb = 0; sb < C / QK_K; sb++, o += QK_K) {
        const uint8_t *blk = w + sb * 210;
        const float d = f16(blk + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half;
            for (int k = 0; k < 8; k++) {                  /* elements 16k + l of this half, one scale */
                const float s = d * (float)sc[k];
                const uint8_t *lo = ql + 16 * (k & 1) + 32 * ((k >> 1) & 1), *hi = qh + 16 * (k & 1);
                float *ok = o + 128 * half + 16 * k;
                for (int l = 0; l < 16; l++)
                    ok[l] = (float)((((lo[l] >> (4 * (k >> 2))) & 15) | (((hi[l] >> (2 * (k >> 1))) & 3) << 4)) - 32) * s;
            }
        }
    }
}

/* IQ4_XS (a super-block of 8 sub-blocks) and MXFP4 (blocks of 32): table values times the scale */
static void dequant_table_row(int quant, const uint8_t *w, int64_t C, float *o) {
    for (int64_t b = 0; b < C / QK; b++, o += QK) {
        const uint8_t *blk = quant == 14 ? w + b * 17 : w + (b / 8) * 136, *codes;
        float scale;
        if (quant == 14)
            scale = e8m0_half(blk[0]), codes = blk + 1;
        else
            scale = f16(blk) * iq4_scale(blk, b % 8), codes = blk + 8 + 16 * (b % 8);
        const int8_t *table = quant == 14 ? MXFP4X2 : IQ4NL;
        for (int i = 0; i < 16; i++)
            o[i] = (float)table[codes[i] & 15] * scale, o[16 + i] = (float)table[codes[i] >> 4] * scale;
    }
}

static void dequant_task(void *ctx, int64_t task) {
    const dequant_args *D = ctx;
    for (int64_t r = task * D->chunk; r < (task + 1) * D->chunk && r < D->R; r++) {
        float *o = D->out + r * D->C;
        if (D->quant >= 10) {
            const uint8_t *w = (const uint8_t *)D->w + r * block_row_bytes(D->quant, D->C);
            if (D->quant == 10 || D->quant == 11) dequant_q45k_row(w, D->C, D->quant == 11, o);
            else if (D->quant == 12) dequant_q6k_row(w, D->C, o);
            else dequant_table_row(D->quant, w, D->C, o);
            continue;
        }
        if (D->quant == 8) {
            const int8_t *c = (const int8_t *)D->w + r * D->C;
            const float s = ((const float *)D->scales)[r];
            for (int64_t i = 0; i < D->C; i++) o[i] = (float)c[i] * s;
            continue;
        }
        const int64_t group = D->quant == 9 ? QK : D->group, groups = D->C / group;
        const int in_panel = D->quant == 5 && r < D->R - D->R % PANEL;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *s = D->scales;
            const float sc = half_to_float(in_panel ? s[r / PANEL * PANEL * groups + g * PANEL + r % PANEL] : s[r * groups + g]);
            float *og = o + g * group;
            if (D->quant == 9) {
                const int8_t *c = (const int8_t *)D->w + r * D->C + g * group;
                for (int64_t i = 0; i < group; i++) og[i] = (float)c[i] * sc;
            } else {                                       /* int4: low nibble the even column, + 8 */
                for (int64_t i = 0; i < group / 2; i++) {
                    const uint8_t c = int4_byte(D, in_panel, r, g * group / 2 + i);
                    og[2 * i] = (float)((c & 15) - 8) * sc, og[2 * i + 1] = (float)((c >> 4) - 8) * sc;
                }
            }
        }
    }
}

/* out [R, C] fp32 = W of `quant` (8 int8, 9 Q8_0, 4 int4 with fp16 scales per `group` columns, 5 the
 * same in panels; the
 * GGUF blocks 10-14 with their scales inside), each weight as pack/quant.py's dequantize computes it. */
int moe_dequant(const void *w, const void *scales, int quant, int64_t R, int64_t C, int64_t group, float *out) {
    if ((quant != 4 && quant != 5 && (quant < 8 || quant > 14)) || ((quant == 4 || quant == 5) && (group % 2 || C % group)) ||
        (quant == 9 && C % QK) || (quant >= 10 && quant <= 13 && C % QK_K) || (quant == 14 && C % QK))
        return -1;
    dequant_args D = {w, scales, quant, R, C, group, 64, out};
    parallel(dequant_task, &D, (R + D.chunk - 1) / D.chunk);
    return 0;
}

/* ---- a prompt's activations as the dots see them ---------------------------------------- */
typedef struct {
    const float *x;
    int64_t C, rows_a_task, T;
    float *out;
} round_args;

static void q8_round_block(const float *x, float *out) {
    int8_t q[QK];
    float s;
    int32_t sum;
    quantize_row(x, QK, q, &s, &sum, 0);
    for (int i = 0; i < QK; i++) out[i] = (float)q[i] * s;
}

#if defined(__x86_64__)
/* the same arithmetic on 8 lanes: amax, d = amax / 127, codes = round-half-even(x / d), codes * d */
__attribute__((target("avx2,fma"))) static void q8_round_block_avx2(const float *x, float *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f, id = d ? 1.0f / d : 0.0f;
    for (int i = 0; i < 4; i++) {
        const __m256 c = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(c, _mm256_set1_ps(d)));
    }
}
#endif

static void q8_round_task(void *ctx, int64_t task) {
    const round_args *A = ctx;
    void (*block)(const float *, float *) = q8_round_block;
#if defined(__x86_64__)
    if (strcmp(isa, "portable")) block = q8_round_block_avx2;
#endif
    for (int64_t t = task * A->rows_a_task; t < (task + 1) * A->rows_a_task && t < A->T; t++)
        for (int64_t b = 0; b < A->C / QK; b++) block(A->x + t * A->C + b * QK, A->out + t * A->C + b * QK);
}

/* out [T, C] = x with each block of 32 replaced by its int8 codes times their scale, exactly as
 * quantize_row makes them for the dots: a prompt's fp32 GEMM on these gives each token what the
 * integer dots give it, up to fp32 rounding (pack/quant.py's q8_round). -1 for C not whole blocks. */
int moe_q8_round(const float *x, int64_t T, int64_t C, float *out) {
    if (C % QK) return -1;
    choose_isa();
    const int64_t per = T / (pool.threads * TASKS_PER_THREAD) + 1;
    round_args A = {x, C, per, T, out};
    parallel(q8_round_task, &A, (T + per - 1) / per);
    return 0;
}
