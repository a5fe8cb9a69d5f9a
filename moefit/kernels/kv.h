/* Attention over KV rows as the sequence state stores them, on the host (included by moe.c after
 * rows.h): each kv head's R query rows (its g query heads x T tokens) against its first S keys,
 * decoded into L1 a block of keys at a time, never as a whole copy.
 *
 *   codec 0 fp32, 1 fp16, 2 bf16     the values
 *   codec 3 int8                     codes, one fp32 scale a row
 *   codec 4 q4                       two 4-bit codes a byte (the even value in the low nibble),
 *                                    minus 8, one fp16 scale per 32 values (runtime/kv_codecs.py)
 *
 * Every row attends every key (no mask): what KV streaming's host part is to the forward that
 * follows it, and a decode step's whole cache. A head's keys are cut into ranges of KV_SPAN over
 * the pool (flash-decoding): each range leaves its unnormalised sums, its max score and its total,
 * merged by their max at the end, so one kv head or a few still keep every thread busy. Returns the
 * output and each row's log-sum-exp, by which models/attention.py merges this part with others.
 *
 * Before this, the host part was decoded by torch into the compute dtype, converted to fp32 and
 * given to torch's flash kernel: four copies of the part a layer a token (measured 26-157 ms a
 * layer at 8-32K int8 keys of 4 heads of 128, 0.2-0.3 GB/s of the stored rows; now 4-14 ms,
 * bench/kv_attention.py). */

typedef struct {
    int codec;
    const void *x, *s;          /* codes [K, C, row bytes]; scales int8 [K, C] fp32, q4 [K, C, n / 32] fp16 */
    int64_t capacity, n;        /* C, the rows between two heads; n, the values in a row */
    const float *rot;           /* q4: the codec's rotation [n, n] (rows are stored as x R), for a writer */
} kv_rows;

typedef struct {
    const float *q;             /* [K, R, D] */
    const kv_rows *k, *v;
    int64_t R, S, splits;       /* key ranges of KV_SPAN a head */
    int latent;                 /* MLA (moe_attend_latent): q = [q_c | q_r], scores q_c . v + q_r . k */
    float scale;
    float *part;                /* [K splits][R][Dv + 2]: a range's sums, max score and total per row */
} stored_args;

#define KV_BLOCK 16             /* keys decoded at a time: exp16's lanes */
#define KV_ROWS 64              /* query rows a pass over a range (more: another pass) */
#define KV_SPAN 512             /* keys a task: ranges fixed by S alone, so the sums do not depend on
                                   the thread count */

/* lanes [a b c d] of four sums of 8: three pairwise folds, then the halves added */
#define PAIRS(a, b) (__builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + \
                     __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15))

static int row_bytes_of(const kv_rows *r) {
    return r->codec == 0 ? 4 * r->n : r->codec <= 2 ? 2 * r->n : r->codec == 3 ? r->n : r->n / 2;
}

/* r from its row `off` on (a run of a ring's slots): the same heads, capacity and codec */
static kv_rows kv_rows_from(const kv_rows *r, int64_t off) {
    kv_rows o = *r;
    o.x = (const char *)r->x + off * row_bytes_of(r);
    if (r->s) o.s = (const char *)r->s + off * (r->codec == 3 ? 4 : r->n / 32 * 2);
    return o;
}

/* Eight stored values (q4: 32) as fp32 into o: per instruction set, since GCC builds the
 * conversions of narrow integer vectors one lane at a time */
#if defined(__x86_64__)
#define KV_CONVERSIONS(ISA, TARGET)                                                                 \
    TARGET static inline void halves_##ISA(const uint16_t *p, float *o) {                           \
        _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));                  \
    }                                                                                               \
    TARGET static inline void bf16s_##ISA(const uint16_t *p, float *o) {                            \
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));               \
        _mm256_storeu_ps(o, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));                         \
    }                                                                                               \
    TARGET static inline void int8s_##ISA(const int8_t *p, float *o) {                              \
        _mm256_storeu_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)))); \
    }                                                                                               \
    TARGET static inline void q4s_##ISA(const uint8_t *p, uint16_t half, float *o) {                \
        const float s = _cvtsh_ss(half);                                                            \
        const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);               \
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);        \
        const __m128i in_order[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};         \
        for (int i = 0; i < 4; i++) {                                                               \
            const __m128i c = i % 2 ? _mm_srli_si128(in_order[i / 2], 8) : in_order[i / 2];         \
            const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));                           \
            _mm256_storeu_ps(o + 8 * i, _mm256_fmsub_ps(x, _mm256_set1_ps(s), _mm256_set1_ps(8.0f * s))); \
        }                                                                                           \
    }
KV_CONVERSIONS(avx512, __attribute__((target("avx512f,fma,f16c"))))
KV_CONVERSIONS(avx2, __attribute__((target("avx2,fma,f16c"))))
#endif
static inline void halves_plain(const uint16_t *p, float *o) {
    for (int i = 0; i < 8; i++) o[i] = half_to_float(p[i]);
}
static inline void bf16s_plain(const uint16_t *p, float *o) {
    for (int i = 0; i < 8; i++) {
        const uint32_t bits = (uint32_t)p[i] << 16;
        memcpy(o + i, &bits, 4);
    }
}
static inline void int8s_plain(const int8_t *p, float *o) {
    for (int i = 0; i < 8; i++) o[i] = (float)p[i];
}
static inline void q4s_plain(const uint8_t *p, uint16_t half, float *o) {
    const float s = half_to_float(half);
    for (int i = 0; i < 16; i++) o[2 * i] = (float)((p[i] & 15) - 8) * s, o[2 * i + 1] = (float)((p[i] >> 4) - 8) * s;
}

/* lane-wise max of two float vectors (VI: integer lanes of their width) */
#define VMAX(a, b, VI) ((__typeof__(a))(((VI)(a) & ((a) > (b))) | ((VI)(b) & ~((a) > (b)))))

/* the row scales of an int8 store's rows s0 .. s0+n of head h, 1 past them (and for other codecs) */
static inline void row_scales(const kv_rows *r, int64_t h, int64_t s0, int64_t n, float *out) {
    for (int64_t s = 0; s < KV_BLOCK; s++)
        out[s] = r->codec == 3 && s < n ? ((const float *)r->s)[h * r->capacity + s0 + s] : 1.0f;
}

#define KV_BODIES(ISA, TARGET)                                                                      \
    /* n rows of head h from position s0 as fp32 [n][r->n] in buf (int8: the codes; their row      \
     * scales are applied to the block's scores and weights, row_scales); fp32 rows read in place */ \
    TARGET static const float *decode_##ISA(const kv_rows *r, int64_t h, int64_t s0, int64_t n, float *buf) { \
        const int64_t row = h * r->capacity + s0, w = r->n;                                         \
        const uint8_t *x = (const uint8_t *)r->x + row * row_bytes_of(r);                           \
        if (r->codec == 0) return (const float *)x;                                                 \
        for (int64_t j = 0; j < n; j++) {                                                           \
            const uint8_t *xj = x + j * row_bytes_of(r);                                            \
            float *o = buf + j * w;                                                                 \
            if (r->codec == 1)                                                                      \
                for (int64_t i = 0; i < w; i += 8) halves_##ISA((const uint16_t *)xj + i, o + i);    \
            else if (r->codec == 2)                                                                 \
                for (int64_t i = 0; i < w; i += 8) bf16s_##ISA((const uint16_t *)xj + i, o + i);     \
            else if (r->codec == 3)                                                                 \
                for (int64_t i = 0; i < w; i += 8) int8s_##ISA((const int8_t *)xj + i, o + i);      \
            else                                                                                    \
                for (int64_t g = 0; g < w / 32; g++)                                                \
                    q4s_##ISA(xj + 16 * g, ((const uint16_t *)r->s)[(row + j) * (w / 32) + g], o + 32 * g); \
        }                                                                                           \
        return buf;                                                                                 \
    }                                                                                               \
    /* p[r][s] = scale q_r . k_s for the block's n keys (rows D apart; query rows ld apart, their  \
     * first D values), -inf past them: two rows and four keys at a time in eight accumulators */   \
    TARGET static void block_scores_##ISA(const float *q, int64_t ld, int64_t R, int64_t D, const float *k, \
                                          int64_t n, float scale, float *p) {                       \
        for (int64_t r = 0; r < R; r += 2) {                                                        \
            const float *q0 = q + r * ld, *q1 = r + 1 < R ? q0 + ld : q0;                           \
            int64_t s = 0;                                                                          \
            for (; s + 4 <= n; s += 4) {                                                            \
                const float *k0 = k + s * D;                                                        \
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};  \
                for (int64_t c = 0; c < D; c += 8) {                                                \
                    const v8 x = LOADV(v8, q0 + c), y = LOADV(v8, q1 + c);                          \
                    const v8 c0 = LOADV(v8, k0 + c), c1 = LOADV(v8, k0 + D + c);                    \
                    const v8 c2 = LOADV(v8, k0 + 2 * D + c), c3 = LOADV(v8, k0 + 3 * D + c);        \
                    a0 += x * c0, a1 += x * c1, a2 += x * c2, a3 += x * c3;                         \
                    b0 += y * c0, b1 += y * c1, b2 += y * c2, b3 += y * c3;                         \
                }                                                                                   \
                const v8 fa = PAIRS(PAIRS(a0, a1), PAIRS(a2, a3)), fb = PAIRS(PAIRS(b0, b1), PAIRS(b2, b3)); \
                STOREV(v4, p + r * KV_BLOCK + s, (__builtin_shufflevector(fa, fa, 0, 1, 2, 3) +    \
                                                  __builtin_shufflevector(fa, fa, 4, 5, 6, 7)) * scale); \
                if (r + 1 < R)                                                                      \
                    STOREV(v4, p + (r + 1) * KV_BLOCK + s, (__builtin_shufflevector(fb, fb, 0, 1, 2, 3) + \
                                                            __builtin_shufflevector(fb, fb, 4, 5, 6, 7)) * scale); \
            }                                                                                       \
            for (; s < KV_BLOCK; s++)                                                               \
                for (int64_t j = r; j < r + 2 && j < R; j++) {                                      \
                    v8 a = {0};                                                                     \
                    for (int64_t c = 0; s < n && c < D; c += 8) a += LOADV(v8, q + j * ld + c) * LOADV(v8, k + s * D + c); \
                    const v4 h = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7); \
                    p[j * KV_BLOCK + s] = s < n ? ((h[0] + h[2]) + (h[1] + h[3])) * scale : -INFINITY; \
                }                                                                                   \
        }                                                                                           \
    }                                                                                               \
    /* rows o0, o1 of acc, columns [c, c + 8w) (w constant where inlined) */                       \
    TARGET static inline __attribute__((always_inline)) void values_tile_##ISA(                      \
        const float *p0, const float *p1, float k0, float k1, const float *v, int64_t n, int64_t Dv, \
        float *o0, float *o1, const int w) {                                                        \
        v8 a[4], b[4];                                                                              \
        for (int i = 0; i < w; i++) a[i] = LOADV(v8, o0 + 8 * i) * k0, b[i] = LOADV(v8, o1 + 8 * i) * k1; \
        for (int64_t s = 0; s < n; s++)                                                             \
            for (int i = 0; i < w; i++) {                                                           \
                const v8 x = LOADV(v8, v + s * Dv + 8 * i);                                         \
                a[i] += p0[s] * x, b[i] += p1[s] * x;                                               \
            }                                                                                       \
        for (int i = 0; i < w; i++) STOREV(v8, o1 + 8 * i, b[i]);                                   \
        for (int i = 0; i < w; i++) STOREV(v8, o0 + 8 * i, a[i]);                                   \
    }                                                                                               \
    /* acc_r = acc_r keep_r + sum over the block's n keys of p[r][s] v_s: two rows and 32 columns  \
     * at a time in eight registers (eight chains of FMAs: four left the FMA units half idle) */     \
    TARGET static void block_values_##ISA(const float *p, const float *keep, int64_t R, const float *v, \
                                          int64_t n, int64_t Dv, float *acc, int64_t acc_stride) {  \
        for (int64_t r = 0; r < R; r += 2) {                                                        \
            const int64_t r1 = r + 1 < R ? r + 1 : r;                                               \
            const float *p0 = p + r * KV_BLOCK, *p1 = p + r1 * KV_BLOCK;                            \
            float *o0 = acc + r * acc_stride, *o1 = acc + r1 * acc_stride;                          \
            int64_t c = 0;                                                                          \
            for (; c + 32 <= Dv; c += 32)                                                           \
                values_tile_##ISA(p0, p1, keep[r], keep[r1], v + c, n, Dv, o0 + c, o1 + c, 4);       \
            if (Dv - c == 24) values_tile_##ISA(p0, p1, keep[r], keep[r1], v + c, n, Dv, o0 + c, o1 + c, 3); \
            if (Dv - c == 16) values_tile_##ISA(p0, p1, keep[r], keep[r1], v + c, n, Dv, o0 + c, o1 + c, 2); \
            if (Dv - c == 8) values_tile_##ISA(p0, p1, keep[r], keep[r1], v + c, n, Dv, o0 + c, o1 + c, 1); \
        }                                                                                           \
    }                                                                                               \
    /* one row's block of scores p (times its keys' scales ks) into softmax numerators against the   \
     * row's running max m[0] and total m[1]; keep: what the sums so far are scaled by; p then       \
     * weighs the values (times their scales vs). Lanes past n are -inf and come out 0. */           \
    TARGET static inline void softmax_block_##ISA(float *p, const float *ks, const float *vs, int64_t n, \
                                                  float *m, float *keep) {                          \
        const v8 x0 = LOADV(v8, p) * LOADV(v8, ks), x1 = LOADV(v8, p + 8) * LOADV(v8, ks + 8);      \
        const v8 h8 = VMAX(x0, x1, v8i);                                                            \
        const v4 h4 = VMAX(FOLD(h8, h8, 0, 1, 2, 3), FOLD(h8, h8, 4, 5, 6, 7), v4i);               \
        float top = h4[0] > h4[1] ? h4[0] : h4[1], top2 = h4[2] > h4[3] ? h4[2] : h4[3];            \
        top = top2 > top ? top2 : top, top = m[0] > top ? m[0] : top;                               \
        STOREV(v8, p, x0 - top);                                                                    \
        STOREV(v8, p + 8, x1 - top);                                                                \
        exp16_##ISA(p);                                                                             \
        for (int64_t s = n; s < KV_BLOCK; s++) p[s] = 0.0f;                                         \
        const v8 e0 = LOADV(v8, p), e1 = LOADV(v8, p + 8), s8 = e0 + e1;                            \
        const v4 s4 = FOLD(s8, s8, 0, 1, 2, 3) + FOLD(s8, s8, 4, 5, 6, 7);                          \
        *keep = expf(m[0] - top), m[1] = m[1] * *keep + ((s4[0] + s4[2]) + (s4[1] + s4[3])), m[0] = top; \
        STOREV(v8, p, e0 * LOADV(v8, vs));                                                          \
        STOREV(v8, p + 8, e1 * LOADV(v8, vs + 8));                                                  \
    }                                                                                               \
    /* MLA's block scores: the latent's (rows v, the first Dv of each query row) times its row      \
     * scales vs plus the rope key's (rows k, the rest) times theirs, ks; then ks are 1 */           \
    TARGET static void latent_scores_##ISA(const stored_args *A, const float *q, int64_t R, const float *k, \
                                           const float *v, int64_t n, float *ks, const float *vs, float *p) { \
        const int64_t Dk = A->k->n, Dv = A->v->n;                                                   \
        float rope[KV_ROWS * KV_BLOCK];                                                             \
        block_scores_##ISA(q, Dv + Dk, R, Dv, v, n, A->scale, p);                                   \
        block_scores_##ISA(q + Dv, Dv + Dk, R, Dk, k, n, A->scale, rope);                           \
        for (int64_t r = 0; r < R; r++)                                                             \
            for (int64_t s = 0; s < n; s++)                                                         \
                p[r * KV_BLOCK + s] = p[r * KV_BLOCK + s] * vs[s] + rope[r * KV_BLOCK + s] * ks[s]; \
        for (int64_t s = 0; s < KV_BLOCK; s++) ks[s] = 1.0f;                                        \
    }                                                                                               \
    /* rows r0..r0+R of one head over keys [a, b): each row's sums into acc, then its max, total */ \
    TARGET static void stored_rows_##ISA(const stored_args *A, int64_t h, int64_t r0, int64_t R, int64_t a, \
                                         int64_t b, float *kbuf, float *vbuf, float *out) {         \
        const int64_t D = A->k->n + (A->latent ? A->v->n : 0), Dv = A->v->n, stride = Dv + 2;       \
        const float *q = A->q + (h * A->R + r0) * D;                                                \
        float p[KV_ROWS * KV_BLOCK], keep[KV_ROWS];                                                 \
        for (int64_t r = 0; r < R; r++) {                                                           \
            memset(out + r * stride, 0, sizeof(float) * Dv);                                        \
            out[r * stride + Dv] = -INFINITY, out[r * stride + Dv + 1] = 0.0f;                      \
        }                                                                                           \
        for (int64_t s0 = a; s0 < b; s0 += KV_BLOCK) {                                              \
            const int64_t n = b - s0 < KV_BLOCK ? b - s0 : KV_BLOCK;                                \
            const float *k = decode_##ISA(A->k, h, s0, n, kbuf), *v = decode_##ISA(A->v, h, s0, n, vbuf); \
            float ks[KV_BLOCK], vs[KV_BLOCK];                                                       \
            row_scales(A->k, h, s0, n, ks);                                                         \
            row_scales(A->v, h, s0, n, vs);                                                         \
            if (A->latent)                                                                          \
                latent_scores_##ISA(A, q, R, k, v, n, ks, vs, p);                                   \
            else                                                                                    \
                block_scores_##ISA(q, D, R, D, k, n, A->scale, p);                                  \
            for (int64_t r = 0; r < R; r++) softmax_block_##ISA(p + r * KV_BLOCK, ks, vs, n, out + r * stride + Dv, keep + r); \
            block_values_##ISA(p, keep, R, v, n, Dv, out, stride);                                  \
        }                                                                                           \
    }                                                                                               \
    TARGET static void stored_task_##ISA(void *ctx, int64_t task) {                                 \
        const stored_args *A = ctx;                                                                 \
        const int64_t h = task / A->splits, a = task % A->splits * KV_SPAN;                         \
        const int64_t b = a + KV_SPAN < A->S ? a + KV_SPAN : A->S, stride = A->v->n + 2;            \
        float *kbuf = malloc(sizeof(float) * KV_BLOCK * (A->k->n + A->v->n)), *vbuf = kbuf + KV_BLOCK * A->k->n; \
        for (int64_t r0 = 0; r0 < A->R; r0 += KV_ROWS)                                             \
            stored_rows_##ISA(A, h, r0, A->R - r0 < KV_ROWS ? A->R - r0 : KV_ROWS, a, b, kbuf, vbuf, \
                              A->part + (task * A->R + r0) * stride);                               \
        free(kbuf);                                                                                 \
    }

#if defined(__x86_64__)
KV_BODIES(avx512, __attribute__((target("avx512f,fma,f16c"))))
KV_BODIES(avx2, __attribute__((target("avx2,fma,f16c"))))
#endif
KV_BODIES(plain, PLAIN)

/* every range's rows of head h merged: out [R][Dv] = the sums over the total, lse = max + log total */
static void merge_ranges(const stored_args *A, int64_t h, float *out, float *lse) {
    const int64_t R = A->R, Dv = A->v->n, stride = Dv + 2;
    for (int64_t r = 0; r < R; r++) {
        float top = -INFINITY, total = 0.0f, *o = out + (h * R + r) * Dv;
        for (int64_t j = 0; j < A->splits; j++) {
            const float m = A->part[((h * A->splits + j) * R + r) * stride + Dv];
            top = m > top ? m : top;
        }
        memset(o, 0, sizeof(float) * Dv);
        for (int64_t j = 0; j < A->splits; j++) {
            const float *part = A->part + ((h * A->splits + j) * R + r) * stride;
            const float w = expf(part[Dv] - top);
            total += part[Dv + 1] * w;
            for (int64_t c = 0; c < Dv; c++) o[c] += part[c] * w;
        }
        for (int64_t c = 0; c < Dv; c++) o[c] /= total;
        lse[h * R + r] = top + logf(total);
    }
}

static int attend_rows(const float *q, int64_t K, int64_t R, int64_t S, const kv_rows *k, const kv_rows *v,
                       int latent, float scale, float *out, float *lse) {
    for (const kv_rows *r = k; r; r = r == k ? v : NULL)
        if (r->codec < 0 || r->codec > 4 || r->n % (r->codec == 4 ? 32 : 8) || r->n < 8 || S > r->capacity)
            return -1;
    if (S < 1 || K < 1 || R < 1) return -1;
    choose_rows_isa();
    const int64_t splits = (S + KV_SPAN - 1) / KV_SPAN;
    stored_args A = {q, k, v, R, S, splits, latent, scale, malloc(sizeof(float) * K * splits * R * (v->n + 2))};
    task_fn task = stored_task_plain;
#if defined(__x86_64__)
    if (!strncmp(isa, "avx512", 6)) task = stored_task_avx512;
    else if (strcmp(isa, "portable")) task = stored_task_avx2;
#endif
    parallel(task, &A, K * splits);
    for (int64_t h = 0; h < K; h++) merge_ranges(&A, h, out, lse);
    free(A.part);
    return 0;
}

/* q [K, R, D] against the first S stored rows of each of the K heads of k (D values a row) and v
 * (Dv) -> out [K, R, Dv], lse [K, R] (natural log of each row's softmax denominator, scores times
 * scale). Returns -1 for dims not a multiple of 8 (q4: of 32), an unknown codec or no keys. */
int moe_attend_stored(const float *q, int64_t K, int64_t R, int64_t S, const kv_rows *k, const kv_rows *v,
                      float scale, float *out, float *lse) {
    return attend_rows(q, K, R, S, k, v, 0, scale, out, lse);
}

/* MLA's attention in its latent (models/deepseek_v3.py), read as stored: q [K, R, Dv + Dk] (each
 * head's absorbed nope query q_c [Dv], then its rotated rope query q_r [Dk]) against the first S
 * rows of each of the K heads of the rope keys k [Dk] and the latents v [Dv], which are both the
 * keys' first part and the values: score = scale (q_c . v + q_r . k) -> out [K, R, Dv], lse [K, R].
 * Each latent row is decoded once for its score and its value. Before, torch decoded both stores
 * and concatenated them into [S, Dv + Dk] keys at every step of every layer. Returns as
 * moe_attend_stored. */
int moe_attend_latent(const float *q, int64_t K, int64_t R, int64_t S, const kv_rows *k, const kv_rows *v,
                      float scale, float *out, float *lse) {
    return attend_rows(q, K, R, S, k, v, 1, scale, out, lse);
}

/* q [H, D] (one position) against fp32 rows k [K, ., D], v [K, ., Dv] (head h's at k + h * k_head,
 * v + h * v_head floats; query heads h*g .. h*g+g-1 read kv head h) -> out [H, Dv]: the decode
 * step's attention over a plain cache (step.h). Returns -1 for strides that are not whole rows,
 * or more than 16 query heads a kv head: there torch's SDPA, shaped as a GEMM, is faster (MLA's 128
 * heads on one latent of 576 / 512: 0.52 ms against 0.31 at 64 keys, 2.5 against 1.3 at 512). */
int moe_attend_one(const float *q, const float *k, const float *v, int64_t H, int64_t K, int64_t S, int64_t D,
                   int64_t Dv, int64_t k_head, int64_t v_head, float scale, float *out) {
    if (H % K || H / K > 16 || k_head % D || v_head % Dv) return -1;
    const kv_rows kr = {0, k, NULL, k_head / D, D}, vr = {0, v, NULL, v_head / Dv, Dv};
    float *lse = malloc(sizeof(float) * H);
    const int rc = moe_attend_stored(q, K, H / K, S, &kr, &vr, scale, out, lse);
    free(lse);
    return rc;
}
