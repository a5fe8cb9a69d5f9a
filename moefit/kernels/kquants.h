/* llama.cpp's K-quants and IQ4_XS, multiplied as the GGUF file stores them (included by moe.c).
 *
 * A row is super-blocks of 256 weights; each 32 of them meets one activation block of moe.c's
 * quantize_row (int8 codes x, one fp32 scale s, their sum), in natural order:
 *
 *   Q4_K  144 bytes: d, dmin (fp16), 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks,
 *         128 bytes of 4-bit codes (32 bytes per pair of sub-blocks: low nibbles the first,
 *         high the second);            w = d sc q - dmin m,  q in 0..15
 *   Q5_K  176 bytes: Q4_K's, and 32 bytes of fifth bits (bit j of byte i: element i of
 *         sub-block j);                w = d sc q - dmin m,  q in 0..31
 *   Q6_K  210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16
 *         weights), d (fp16);          w = d sc (q - 32),    q in 0..63
 *   IQ4_XS 136 bytes: d (fp16), 6-bit scales (2 high bits in a uint16, 4 low in 4 bytes), 128
 *         bytes of 4-bit indices (per sub-block: low nibbles elements 0-15, high 16-31) into a
 *         non-linear table;            w = d (ls - 32) table[q]
 *   MXFP4 17 bytes a block of 32 (gpt-oss): an e8m0 exponent e, 16 bytes of e2m1 codes as IQ4_XS
 *         orders them;                 w = 2^(e - 128) doubled_e2m1[q]  (the doubled values are integers)
 *
 * so a sub-block's dot is sum q x over the integers, scaled once: d sc s (sum q x) - dmin m s
 * (sum x). Here: the portable bodies, a row at a time, and the helpers of the SIMD ones, which
 * take a few tokens a row (ktiles.h).
 */
#define QK_K 256

static const int8_t IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* bytes of a row of `cols` weights (14: MXFP4, blocks of 32; the others super-blocks of 256) */
static size_t block_row_bytes(int quant, int64_t cols) {
    if (quant == 14) return (size_t)(cols / 32) * 17;
    return (size_t)(cols / QK_K) * (quant == 10 ? 144 : quant == 11 ? 176 : quant == 12 ? 210 : 136);
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min, from the 12 packed bytes */
static inline void k4_scale_min(int j, const uint8_t *s, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63), *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static inline float iq4_scale(const uint8_t *blk, int ib) {
    const uint16_t high = (uint16_t)(blk[2] | (blk[3] << 8));
    const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4);
    return (float)(ls - 32);
}

static inline float f16(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* MXFP4's scale 2^(e - 128) from its bits (ldexpf is a call per block) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- portable bodies ----------------------------------------------------------------- */
static float dot_q45k_portable(const uint8_t *w, const int8_t *q, const float *qs, const int32_t *qsum, int64_t n,
                               int fifth) {
    const int bytes = fifth ? 176 : 144;
    float acc = 0.0f;
    for (int64_t sb = 0; sb < n / QK_K; sb++) {
        const uint8_t *blk = w + sb * bytes, *qh = blk + 16, *codes = blk + (fifth ? 48 : 16);
        const float d = f16(blk), dmin = f16(blk + 2);
        for (int j = 0; j < 8; j++) {
            float sc, m;
            k4_scale_min(j, blk + 4, &sc, &m);
            const int64_t b = sb * 8 + j;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) {
                int c = (codes[(j / 2) * 32 + i] >> (4 * (j & 1))) & 15;
                if (fifth) c |= ((qh[i] >> j) & 1) << 4;
                isum += c * q[b * QK + i];
            }
            acc += qs[b] * (d * sc * (float)isum - dmin * m * (float)qsum[b]);
        }
    }
    return acc;
}

static float dot_q4k_portable(const void *w, const void *ws, const int8_t *q, const float *qs, const int32_t *qsum,
                              int64_t n, int64_t group) {
    (void)ws, (void)group;
    return dot_q45k_portable(w, q, qs, qsum, n, 0);
}

static float dot_q5k_portable(const void *w, const void *ws, const int8_t *q, const float *qs, const int32_t *qsum,
                              int64_t n, int64_t group) {
    (void)ws, (void)group;
    return dot_q45k_portable(w, q, qs, qsum, n, 1);
}

static float dot_q6k_portable(const void *w, const void *ws, const int8_t *q, const float *qs, const int32_t *qsum,
                              int64_t n, int64_t group) {
    (void)ws, (void)group, (void)qsum;
    float acc = 0.0f;
    for (int64_t sb = 0; sb < n / QK_K; sb++) {
        const uint8_t *blk = (const uint8_t *)w + sb * 210;
        const float d = f16(blk + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half;
            for (int k = 0; k < 4; k++) {                      /* elements 32k + l of this half */
                const int64_t b = sb * 8 + half * 4 + k;
                int32_t lo = 0, hi = 0;
                for (int l = 0; l < 32; l++) {
                    const int low = (ql[l + 32 * (k & 1)] >> (4 * (k >> 1))) & 15, high = (qh[l] >> (2 * k)) & 3;
                    const int c = (low | (high << 4)) - 32;
                    if (l < 16) lo += c * q[b * QK + l];
                    else hi += c * q[b * QK + l];
                }
                acc += qs[b] * d * ((float)sc[2 * k] * (float)lo + (float)sc[2 * k + 1] * (float)hi);
            }
        }
    }
    return acc;
}

/* 16 bytes of 4-bit indices (low nibbles elements 0-15, high 16-31) into a 16-entry int8 table,
 * dotted with 32 activations (IQ4_XS's sub-blocks, MXFP4's blocks) */
static inline int32_t table_dot(const int8_t *table, const uint8_t *codes, const int8_t *x) {
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) isum += table[codes[j] & 15] * x[j] + table[codes[j] >> 4] * x[16 + j];
    return isum;
}

static float dot_iq4xs_portable(const void *w, const void *ws, const int8_t *q, const float *qs,
                                const int32_t *qsum, int64_t n, int64_t group) {
    (void)ws, (void)group, (void)qsum;
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {                          /* sub-block b % 8 of super-block b / 8 */
        const uint8_t *blk = (const uint8_t *)w + (b / 8) * 136;
        acc += qs[b] * f16(blk) * iq4_scale(blk, b % 8) * (float)table_dot(IQ4NL, blk + 8 + 16 * (b % 8), q + b * QK);
    }
    return acc;
}

static float dot_mxfp4_portable(const void *w, const void *ws, const int8_t *q, const float *qs,
                                const int32_t *qsum, int64_t n, int64_t group) {
    (void)ws, (void)group, (void)qsum;
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *blk = (const uint8_t *)w + b * 17;
        acc += qs[b] * e8m0_half(blk[0]) * (float)table_dot(MXFP4X2, blk + 1, q + b * QK);
    }
    return acc;
}

#if defined(__x86_64__)
/* an fp16 field by the F16C instruction (the SIMD bodies all have it) */
#define F16C(p) _cvtsh_ss((uint16_t)((p)[0] | ((p)[1] << 8)))

/* ---- for ktiles.h's 256-bit bodies ----------------------------------------------------- */
/* Q4_K / Q5_K's 12 packed bytes -> 8 scales (bytes of out[0..1]) and 8 mins (out[2..3]), all at once */
static inline void k4_unpack(const uint8_t *s, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, s, 12);
    out[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    out[2] = u[1] & 0x3f3f3f3f;
    out[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    out[0] = u[0] & 0x3f3f3f3f;
}

/* 16 where byte i of qh has `bit` set, else 0 */
#define FIFTH_BIT(qh, bit, sixteen) \
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256((qh), (bit)), (bit)), (sixteen))

/* a 16-entry int8 table in both 128-bit lanes (for a shuffle) */
#define TABLE(values) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(values)))
#endif
