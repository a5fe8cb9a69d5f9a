/* Writing one row of a KV store on the host as runtime/kv_codecs.py's put writes it (included by
 * moe.c after kv.h, whose kv_rows it writes; step.h and mla.h write their decode step's row with it):
 *
 *   codec 0 fp32, 1 fp16, 2 bf16     the values, rounded to nearest even as torch's .to()
 *   codec 3 int8                     a scale of max|x| / 127, codes rounded half to even
 *   codec 4 q4                       turned (kv_turn), 4-bit codes, a fp16 scale per 32 values
 */

/* row pos of head h of a store written from x [n], as its codec's put writes it
 * (runtime/kv_codecs.py): 0 fp32, 1 fp16, 2 bf16, 3 int8 (a scale of max|x| / 127, codes rounded
 * half to even), 4 q4 (kv_write_q4). Its callers check kv_writes first. */
static void kv_write_q4(const kv_rows *r, int64_t row, const float *x);

/* fp32 -> bf16, to nearest even; a NaN stays a (quiet) NaN */
static uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static void kv_write_row(const kv_rows *r, int64_t h, int64_t pos, const float *x) {
    const int64_t row = h * r->capacity + pos;
    if (r->codec == 0) {
        memcpy((float *)r->x + row * r->n, x, sizeof(float) * r->n);
        return;
    }
    if (r->codec == 4) {
        kv_write_q4(r, row, x);
        return;
    }
    if (r->codec == 1 || r->codec == 2) {           /* fp16, bf16: to nearest even, as torch's .to() */
        uint16_t *out = (uint16_t *)r->x + row * r->n;
        for (int64_t i = 0; i < r->n; i++) out[i] = r->codec == 1 ? float_to_half(x[i]) : float_to_bf16(x[i]);
        return;
    }
    float top = 0.0f;
    for (int64_t i = 0; i < r->n; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float scale = (top > 1e-8f ? top : 1e-8f) / 127.0f;
    int8_t *codes = (int8_t *)r->x + row * r->n;
    for (int64_t i = 0; i < r->n; i++) {
        const float c = nearbyintf(x[i] / scale);
        codes[i] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
    }
    ((float *)r->s)[row] = scale;
}

/* whether kv_write_row writes this store: fp32, fp16, bf16 rows, int8 with their scales, q4 with its rotation */
static int kv_writes(const kv_rows *r) {
    return r->codec <= 2 || (r->codec == 3 && r->s) || (r->codec == 4 && r->s && r->rot && r->n % 32 == 0);
}

/* y = x R for q4's rotation R [n, n] (runtime/kv_codecs.py rotation_matrix). Where n is a power of
 * two R is Sylvester's Hadamard matrix / sqrt(n), so y is the fast Walsh-Hadamard transform of x
 * scaled (n log n additions: a decode step turns a query and an output of 32 heads of 128, which
 * the matrix product took ~0.4 ms to do); other n: the product, each y[j] summed over i in order.
 * R is symmetric in the first case; `back` (y = x R^T) is for the second. */
static void kv_turn(const float *x, float *y, int64_t n, const float *rot, int back) {
    if ((n & (n - 1)) == 0) {
        memcpy(y, x, sizeof(float) * n);
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b, y[j + h] = a - b;
                }
        const float scale = (float)(1.0 / sqrt((double)n));
        for (int64_t j = 0; j < n; j++) y[j] *= scale;
        return;
    }
    for (int64_t j = 0; j < n; j++) y[j] = 0.0f;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) y[j] += x[i] * (back ? rot[j * n + i] : rot[i * n + j]);
}

/* a q4 row: x turned by the rotation (kv_turn), then each group of 32 scaled by
 * max|y| / 7 (at least 1e-8), codes rounded half to even, clamped to -8..7, stored + 8 two a byte,
 * the even value in the low nibble; the scale kept as fp16 (the codes use the fp32 one) */
static void kv_write_q4(const kv_rows *r, int64_t row, const float *x) {
    const int64_t n = r->n;
    float y[n];
    kv_turn(x, y, n, r->rot, 0);
    uint8_t *codes = (uint8_t *)r->x + row * (n / 2);
    uint16_t *scales = (uint16_t *)r->s + row * (n / 32);
    for (int64_t g = 0; g < n / 32; g++) {
        float top = 0.0f;
        for (int i = 0; i < 32; i++) top = fabsf(y[32 * g + i]) > top ? fabsf(y[32 * g + i]) : top;
        float scale = top / 7.0f;
        scale = scale > 1e-8f ? scale : 1e-8f;
        for (int i = 0; i < 32; i += 2) {
            float a = nearbyintf(y[32 * g + i] / scale), b = nearbyintf(y[32 * g + i + 1] / scale);
            a = a > 7.0f ? 7.0f : a < -8.0f ? -8.0f : a;
            b = b > 7.0f ? 7.0f : b < -8.0f ? -8.0f : b;
            codes[16 * g + i / 2] = (uint8_t)((int)(a + 8.0f) | ((int)(b + 8.0f) << 4));
        }
        scales[g] = float_to_half(scale);
    }
}

/* x [K, T, n] written as rows pos[0..T) of each of a store's K heads (its codec's put): a decode
 * step's q4 row taken op by op goes through here (runtime/kv_codecs.py), so it is coded as the
 * one-call step codes it. Returns -1 for a store it does not write. */
int moe_kv_put(const kv_rows *r, int64_t K, int64_t T, const int64_t *pos, const float *x) {
    if (!kv_writes(r)) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= r->capacity) return -1;
    for (int64_t h = 0; h < K; h++)
        for (int64_t t = 0; t < T; t++) kv_write_row(r, h, pos[t], x + (h * T + t) * r->n);
    return 0;
}
