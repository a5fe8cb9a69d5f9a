/* Weights quantised natively (included by moe.c): pack/quant.py's quantize, the same codes and
 * scales bit for bit, a row per task over the pool. A pack's experts and --dense-quant's matrices
 * at load went through five torch passes each (abs, amax, divide, round, clamp) on one thread:
 * 25 of a 35 s start for an 8-layer Qwen3.6 with a 151936-token vocabulary.
 *
 *   int8   a scale per row: s = max(amax, 1e-12) / 127 (fp32), codes round(w / s) in [-127, 127]
 *   int4   an fp16 scale per group: s = fp16(max(amax, 1e-12) / 7), codes round(w / s) in [-7, 7],
 *          stored + 8, two a byte, the even column in the low nibble
 *   Q8_0   an fp16 scale per 32: d = fp16(amax / 127), codes round(w * (d > 0 ? 1 / d : 0))
 *
 * round is to nearest, ties to even (torch.round), in fp32 as torch divides; a code of NaN
 * (0 / 0: an int4 group of zeros, whose scale is 0 in fp16) is 0, as torch converts it here. */

/* fp32 -> fp16, to nearest even, subnormals and overflow as IEEE (torch's .to(float16)) */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffff;
    if (x >= 0x7f800000) return sign | (x > 0x7f800000 ? 0x7e00 : 0x7c00);   /* NaN, inf */
    if (x >= 0x477ff000) return sign | 0x7c00;                              /* rounds past 65504 */
    if (x < 0x38800000) {                                                    /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &x, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);                  /* units of 2^-24, exact */
    }
    uint32_t h = (x - 0x38000000) >> 13;
    const uint32_t rest = x & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;                  /* a carry bumps the exponent */
    return sign | (uint16_t)h;
}

static float max_abs(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

static int code_of(float q, float lim) {
    if (q != q) return 0;
    return (int)(q < -lim ? -lim : (q > lim ? lim : q));
}

static void quantize_int8(const float *w, int64_t n, int8_t *codes, float *scale) {
    const float s = fmaxf(max_abs(w, n), 1e-12f) / 127.0f;
    for (int64_t i = 0; i < n; i++) codes[i] = (int8_t)code_of(nearbyintf(w[i] / s), 127.0f);
    *scale = s;
}

static void quantize_int4(const float *w, int64_t n, int64_t group, uint8_t *codes, uint16_t *scales) {
    for (int64_t g = 0; g < n / group; g++) {
        const float *x = w + g * group;
        scales[g] = float_to_half(fmaxf(max_abs(x, group), 1e-12f) / 7.0f);
        const float s = half_to_float(scales[g]);
        for (int64_t i = 0; i < group; i += 2) {
            const int lo = code_of(nearbyintf(x[i] / s), 7.0f) + 8, hi = code_of(nearbyintf(x[i + 1] / s), 7.0f) + 8;
            codes[(g * group + i) / 2] = (uint8_t)(lo | hi << 4);
        }
    }
}

static void quantize_q8_0(const float *w, int64_t n, int8_t *codes, uint16_t *scales) {
    for (int64_t g = 0; g < n / QK; g++) {
        const float *x = w + g * QK;
        scales[g] = float_to_half(max_abs(x, QK) / 127.0f);
        const float d = half_to_float(scales[g]), inv = d > 0 ? 1.0f / d : 0.0f;
        for (int64_t i = 0; i < QK; i++) codes[g * QK + i] = (int8_t)code_of(nearbyintf(x[i] * inv), 127.0f);
    }
}

typedef struct {
    const void *w;
    int dtype, quant;                  /* dtype: 0 fp32, 1 fp16, 2 bf16; quant: 8, 4 or 9 */
    int64_t rows, cols, group, chunk;
    void *codes, *scales;
    _Atomic int failed;                /* a task could not have its row buffer */
} weight_rows;

static void as_float(const void *w, int dtype, int64_t n, float *out) {
    if (dtype == 0) memcpy(out, w, (size_t)n * 4);
    for (int64_t i = 0; dtype == 1 && i < n; i++) out[i] = half_to_float(((const uint16_t *)w)[i]);
    for (int64_t i = 0; dtype == 2 && i < n; i++) {
        const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

static void weight_task(void *ctx, int64_t task) {
    weight_rows *W = ctx;
    float *row = malloc(sizeof(float) * W->cols);
    if (!row) {
        atomic_store(&W->failed, 1);
        return;
    }
    const int64_t n = W->cols, width = W->dtype ? 2 : 4, groups = W->quant == 8 ? 1 : n / W->group;
    for (int64_t r = task * W->chunk; r < (task + 1) * W->chunk && r < W->rows; r++) {
        as_float((const char *)W->w + r * n * width, W->dtype, n, row);
        if (W->quant == 8) quantize_int8(row, n, (int8_t *)W->codes + r * n, (float *)W->scales + r);
        else if (W->quant == 4) quantize_int4(row, n, W->group, (uint8_t *)W->codes + r * n / 2, (uint16_t *)W->scales + r * groups);
        else quantize_q8_0(row, n, (int8_t *)W->codes + r * n, (uint16_t *)W->scales + r * groups);
    }
    free(row);
}

/* w [rows, cols] in dtype -> codes and scales as pack/layout.py lays them out; -1 where the
 * shape or quant is not one of these. */
int moe_quantize(const void *w, int dtype, int64_t rows, int64_t cols, int quant, int64_t group, void *codes,
                 void *scales) {
    if (dtype < 0 || dtype > 2 || (quant != 8 && quant != 4 && quant != 9) || cols <= 0 ||
        (quant == 4 && (group <= 0 || group % 2 || cols % group)) || (quant == 9 && cols % QK)) return -1;
    weight_rows W = {w, dtype, quant, rows, cols, quant == 9 ? QK : group, 1 + rows / (pool.threads * TASKS_PER_THREAD),
                     codes, scales, 0};
    parallel(weight_task, &W, (rows + W.chunk - 1) / W.chunk);
    return atomic_load(&W.failed) ? -1 : 0;
}
