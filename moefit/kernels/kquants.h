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
 * (sum x). Bodies: portable C, and 256-bit ones per instruction set (maddubs, or dpbusd).
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

/* ---- 256-bit bodies: DOT32(u8, s8) -> eight int32 sums, lane i = bytes 4i..4i+3 ---------- */
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

/* A Q4_K / Q5_K super-block's eight sub-block scales as dv (d sc s, one lane each), and its
 * dmin m s (sum x) terms added to off (declares sm, xs, sc, mn, sums, dv where it is used) */
#define K4_SCALES(blk, sb, dv, off)                                                              \
    uint32_t sm[4];                                                                              \
    k4_unpack((blk) + 4, sm);                                                                    \
    const __m256 xs = _mm256_loadu_ps(qs + (sb) * 8);                                            \
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm))); \
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 2)))); \
    const __m256 dv = _mm256_mul_ps(_mm256_mul_ps(sc, xs), _mm256_set1_ps(F16C(blk)));          \
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(qsum + (sb) * 8))); \
    off = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_mul_ps(xs, sums)), _mm256_set1_ps(F16C((blk) + 2)), off)

/* per super-block: its 8 scales and mins unpacked at once; each sub-block's d sc s as one lane of
 * a vector (broadcast by a permute), the dmin m s (sum x) terms in a vector summed at the end */
#define Q45K_BODY(NAME, TARGET, DOT32, FIFTH)                                                    \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group;                                                                   \
        const int bytes = FIFTH ? 176 : 144;                                                     \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);               \
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps(); \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                              \
            const uint8_t *blk = (const uint8_t *)w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16); \
            K4_SCALES(blk, sb, dv, off);                                                         \
            const __m256i qh = FIFTH ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : low;    \
            for (int j = 0; j < 8; j += 2) {                                                     \
                const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 16 * j));         \
                __m256i c0 = _mm256_and_si256(c, low), c1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), low); \
                if (FIFTH) {                                                                     \
                    const __m256i b0 = _mm256_set1_epi8((char)(1 << j)), b1 = _mm256_set1_epi8((char)(2 << j)); \
                    c0 = _mm256_or_si256(c0, FIFTH_BIT(qh, b0, sixteen));                        \
                    c1 = _mm256_or_si256(c1, FIFTH_BIT(qh, b1, sixteen));                        \
                }                                                                                \
                const int64_t b = sb * 8 + j;                                                    \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + b * QK));            \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + (b + 1) * QK));      \
                const __m256 d0 = _mm256_permutevar8x32_ps(dv, _mm256_set1_epi32(j));            \
                const __m256 d1 = _mm256_permutevar8x32_ps(dv, _mm256_set1_epi32(j + 1));        \
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT32(c0, x0)), d0, acc);               \
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT32(c1, x1)), d1, acc1);             \
            }                                                                                    \
        }                                                                                        \
        return hsum8(_mm256_sub_ps(_mm256_add_ps(acc, acc1), off));                              \
    }

#define Q6K_BODY(NAME, TARGET, DOT32)                                                            \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group, (void)qsum;                                                       \
        const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), one = _mm256_set1_epi8(1); \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                              \
            const uint8_t *blk = (const uint8_t *)w + sb * 210;                                  \
            const float d = F16C(blk + 208);                                                      \
            for (int half = 0; half < 2; half++) {                                               \
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));       \
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));  \
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));  \
                const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half;                       \
                const __m256i codes[4] = {                                                       \
                    _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)), \
                    _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)), \
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, top)), \
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),             \
                                    _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};            \
                for (int k = 0; k < 4; k++) {                                                    \
                    const int64_t b = sb * 8 + half * 4 + k;                                     \
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q + b * QK));         \
                    const __m256i isum = _mm256_sub_epi32(DOT32(codes[k], x), _mm256_slli_epi32(DOT32(one, x), 5)); \
                    const float s0 = qs[b] * d * sc[2 * k], s1 = qs[b] * d * sc[2 * k + 1];      \
                    const __m256 scales = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);        \
                    acc[k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scales, acc[k & 1]);   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        return hsum8(_mm256_add_ps(acc[0], acc[1]));                                             \
    }

/* 16 bytes of 4-bit indices (low nibbles elements 0-15, high 16-31) looked up in a 16-entry int8
 * table, dotted with 32 activations: eight int32 sums (IQ4_XS's sub-blocks, MXFP4's blocks) */
#define TABLE_DOT(DOT32, table, bytes, x)                                                        \
    ({                                                                                           \
        const __m256i idx_ = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16((bytes), 4), (bytes)), \
                                              _mm256_set1_epi8(15));                             \
        const __m256i v_ = _mm256_shuffle_epi8((table), idx_);                                   \
        DOT32(_mm256_sign_epi8(v_, v_), _mm256_sign_epi8((x), v_));                              \
    })
#define TABLE(values) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(values)))
#define ACTIVATIONS(b) _mm256_loadu_si256((const __m256i *)(q + (b) * QK))

#define IQ4XS_BODY(NAME, TARGET, DOT32)                                                          \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group, (void)qsum;                                                       \
        const __m256i table = TABLE(IQ4NL);                                                      \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                              \
            const uint8_t *blk = (const uint8_t *)w + sb * 136;                                  \
            const float d = F16C(blk);                                                            \
            for (int ib = 0; ib < 8; ib++) {                                                     \
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * ib));     \
                const int64_t b = sb * 8 + ib;                                                   \
                const __m256 scale = _mm256_set1_ps(qs[b] * d * iq4_scale(blk, ib));             \
                acc[ib & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(TABLE_DOT(DOT32, table, bytes, ACTIVATIONS(b))), scale, \
                                              acc[ib & 1]);                                              \
            }                                                                                    \
        }                                                                                        \
        return hsum8(_mm256_add_ps(acc[0], acc[1]));                                             \
    }

#define MXFP4_BODY(NAME, TARGET, DOT32)                                                          \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group, (void)qsum;                                                       \
        const __m256i table = TABLE(MXFP4X2);                                                    \
        __m256 acc = _mm256_setzero_ps();                                                        \
        for (int64_t b = 0; b < n / QK; b++) {                                                   \
            const uint8_t *blk = (const uint8_t *)w + b * 17;                                    \
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 1));                   \
            const __m256 scale = _mm256_set1_ps(qs[b] * e8m0_half(blk[0]));                      \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(TABLE_DOT(DOT32, table, bytes, ACTIVATIONS(b))), scale, acc); \
        }                                                                                        \
        return hsum8(acc);                                                                       \
    }

/* Q4_K on 512 bits (instantiated in moe.c, where the target is named): 64 bytes of codes an
 * iteration, two pairs of sub-blocks. The low nibbles are sub-blocks j and j + 2, the high ones
 * (masked in place: 16 times the code, no shift) j + 1 and j + 3; each sub-block's d sc s is a
 * lane of the super-block's eight, permuted into place (divided by 16 for the high nibbles). */
#define Q4K_BODY512(NAME, TARGET)                                                                \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group;                                                                   \
        const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8((char)0xf0);          \
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                           \
        __m256 off = _mm256_setzero_ps();                                                        \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                              \
            const uint8_t *blk = (const uint8_t *)w + sb * 144, *codes = blk + 16;               \
            K4_SCALES(blk, sb, dv, off);                                                         \
            const __m512 d = _mm512_zextps256_ps512(dv);                                         \
            const __m512 d16 = _mm512_zextps256_ps512(_mm256_mul_ps(dv, _mm256_set1_ps(1.0f / 16))); \
            for (int j = 0; j < 8; j += 4) {                                                     \
                const __m512i c = _mm512_loadu_si512(codes + 16 * j);                            \
                const int8_t *x = q + (sb * 8 + j) * QK;                                         \
                const __m512i x02 = _mm512_inserti64x4(                                          \
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x)),              \
                    _mm256_loadu_si256((const __m256i *)(x + 2 * QK)), 1);                       \
                const __m512i x13 = _mm512_inserti64x4(                                          \
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + QK))),       \
                    _mm256_loadu_si256((const __m256i *)(x + 3 * QK)), 1);                       \
                const __m512i i02 = _mm512_inserti64x4(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 2), 1); \
                const __m512i i13 = _mm512_inserti64x4(_mm512_set1_epi32(17 + j), _mm256_set1_epi32(19 + j), 1); \
                acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(),  \
                                           _mm512_and_si512(c, low), x02)), _mm512_permutex2var_ps(d, i02, d16), acc0); \
                acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(),  \
                                           _mm512_and_si512(c, high), x13)), _mm512_permutex2var_ps(d, i13, d16), acc1); \
            }                                                                                    \
        }                                                                                        \
        return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - hsum8(off);                     \
    }

/* Q6_K on 512 bits: two blocks of 32 an instruction (the lower half block k, the upper k + 1),
 * each lane doing what Q6K_BODY's does (the lower halves its acc[0], the upper its acc[1]), so
 * the result is the 256-bit body's bit for bit. A half super-block's codes are built two blocks
 * a vector, with per-half shifts; its eight d sc s scales in one vector (qs d, then sc, as the
 * scalar code multiplies them), a permute placing each block's two. */
#define Q6K_BODY512(NAME, TARGET)                                                                \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,             \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) {   \
        (void)ws, (void)group, (void)qsum;                                                       \
        const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30), one = _mm512_set1_epi8(1); \
        const __m512i up4_2 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1); \
        const __m512i down0_2 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); \
        const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);                          \
        __m512 acc = _mm512_setzero_ps();                                                        \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                              \
            const uint8_t *blk = (const uint8_t *)w + sb * 210;                                  \
            const float d = F16C(blk + 208);                                                      \
            for (int half = 0; half < 2; half++) {                                               \
                const __m512i l = _mm512_loadu_si512(blk + 64 * half);          /* l0 | l1 */     \
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half))); \
                const __m512i codes[2] = {                                                       \
                    _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(_mm512_sllv_epi16(h, up4_2), top)), \
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),              \
                                    _mm512_and_si512(_mm512_srlv_epi16(h, down0_2), top))};      \
                const int64_t b0 = sb * 8 + half * 4;                                            \
                const __m256 qd = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(  \
                    _mm_loadu_ps(qs + b0)), pairs), _mm256_set1_ps(d));                           \
                const __m256 sv = _mm256_mul_ps(qd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(     \
                    _mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * half)))));                 \
                const __m512 s16 = _mm512_castps256_ps512(sv);                                   \
                for (int k = 0; k < 4; k += 2) {                                                 \
                    const __m512i x = _mm512_loadu_si512(q + (b0 + k) * QK);                     \
                    const __m512i isum = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[k / 2], x), \
                        _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), one, x), 5)); \
                    const __m512i idx = _mm512_set_epi32(2 * k + 3, 2 * k + 3, 2 * k + 3, 2 * k + 3, \
                        2 * k + 2, 2 * k + 2, 2 * k + 2, 2 * k + 2, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, \
                        2 * k, 2 * k, 2 * k, 2 * k);                                            \
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(idx, s16), acc); \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1))); \
    }

#define KQUANT_BODIES(SUFFIX, TARGET, DOT32)                                                     \
    Q45K_BODY(dot_q4k_##SUFFIX, TARGET, DOT32, 0)                                                \
    Q45K_BODY(dot_q5k_##SUFFIX, TARGET, DOT32, 1)                                                \
    Q6K_BODY(dot_q6k_##SUFFIX, TARGET, DOT32)                                                    \
    IQ4XS_BODY(dot_iq4xs_##SUFFIX, TARGET, DOT32)                                                \
    MXFP4_BODY(dot_mxfp4_##SUFFIX, TARGET, DOT32)
#endif
