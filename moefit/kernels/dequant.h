/* One quantised matrix as fp32 rows, over the pool (included by moe.c): a prompt's product of
 * many tokens then runs as torch's fp32 GEMM, which outpaces the integer dots there (the measure
 * and the threshold: GEMM_TOKENS in pack/quant.py). Each weight is its code times its scale in
 * fp32, as pack/quant.py's dequantize computes it, so the two agree bit for bit. */
typedef struct {
    const void *w, *scales;
    int quant;
    int64_t R, C, group, chunk;
    float *out;
} dequant_args;

static void dequant_task(void *ctx, int64_t task) {
    const dequant_args *D = ctx;
    for (int64_t r = task * D->chunk; r < (task + 1) * D->chunk && r < D->R; r++) {
        float *o = D->out + r * D->C;
        if (D->quant == 8) {
            const int8_t *c = (const int8_t *)D->w + r * D->C;
            const float s = ((const float *)D->scales)[r];
            for (int64_t i = 0; i < D->C; i++) o[i] = (float)c[i] * s;
            continue;
        }
        const int64_t group = D->quant == 9 ? QK : D->group;
        const uint16_t *s = (const uint16_t *)D->scales + r * (D->C / group);
        for (int64_t g = 0; g < D->C / group; g++) {
            const float sc = half_to_float(s[g]);
            float *og = o + g * group;
            if (D->quant == 9) {
                const int8_t *c = (const int8_t *)D->w + r * D->C + g * group;
                for (int64_t i = 0; i < group; i++) og[i] = (float)c[i] * sc;
            } else {                                       /* int4: low nibble the even column, + 8 */
                const uint8_t *c = (const uint8_t *)D->w + (r * D->C + g * group) / 2;
                for (int64_t i = 0; i < group / 2; i++)
                    og[2 * i] = (float)((c[i] & 15) - 8) * sc, og[2 * i + 1] = (float)((c[i] >> 4) - 8) * sc;
            }
        }
    }
}

/* out [R, C] fp32 = W of `quant` (8 int8, 9 Q8_0, 4 int4 with fp16 scales per `group` columns),
 * each weight code times its scale in fp32, as pack/quant.py's dequantize computes it. */
int moe_dequant(const void *w, const void *scales, int quant, int64_t R, int64_t C, int64_t group, float *out) {
    if ((quant != 4 && quant != 8 && quant != 9) || (quant == 4 && (group % 2 || C % group)) || (quant == 9 && C % QK))
        return -1;
    dequant_args D = {w, scales, quant, R, C, group, 64, out};
    parallel(dequant_task, &D, (R + D.chunk - 1) / D.chunk);
    return 0;
}
