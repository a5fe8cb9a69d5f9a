/* The float operations of a step between its quantised matrices, for fp32 rows on the host:
 *
 *   moe_rms_norm    RMSNorm of rows (rows may be strided: a view of a wider projection)
 *   moe_head_rows   a projection's heads [T, H, D] -> [H, T, D], each optionally RMS-normed
 *                   (QK-norm) and rotated (RoPE, rotate-half, on its first `rot` channels)
 *   moe_softmax_topk  a softmax router: the router's matrix over the pool, then softmax and top-k
 *                   (and moe_sigmoid_topk, DeepSeek's); the matrix fp32, or bf16 widened as it is
 *                   read (a router whose values are bf16's: half the bytes, the same logits)
 *
 * torch dispatches each of these as several operations, and at one token its overhead is the
 * cost: measured on the bench shape (bench/decode.py, 2 threads), a decode token spent ~20 ms of
 * ~70 in torch operations between the kernels, RMSNorm ~90 us a call (50 calls a token).
 * (One position's attention, moe_attend_one, is kv.h's.) Vectors are GCC vector extensions: each body is compiled
 * for AVX512, AVX2 + FMA and plain x86-64 (the same source) and chosen after choose_isa.
 * The results equal float64 references to fp32 rounding (tests/test_rows.py). */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));        /* four bf16 values (bf16_plain's) */
typedef uint32_t v4u __attribute__((vector_size(16)));

#define LOADV(T, p) ({ T v_; memcpy(&v_, (p), sizeof(T)); v_; })
#define STOREV(T, p, v) do { T w_ = (v); memcpy((p), &w_, sizeof(T)); } while (0)

#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))

typedef struct {
    const float *x;
    const void *w;                      /* [N, E] fp32, or bf16 where w_bf16 (widened as it is read) */
    int w_bf16;
    int64_t T, E, N;
    float *logits;
} router_args;

/* Each body is written once over VF, the instruction set's own float vector of VN lanes (VI: its
 * int32 lanes): AVX512's 16, AVX2's 8, plain x86-64's 4. A vector wider than the target's
 * registers is lowered by GCC through the stack (16-float vectors on AVX2: a store and a reload of
 * every half, GPR moves between); one layer's decode attention, whose softmax takes exp16, was
 * 0-15 % slower so (bench/kv_attention.py, 16,384 keys, an AVX2 EPYC). The helpers keep their
 * 16-float contracts (exp16: 16 lanes; dot16, rms_row: n a multiple of 16). */
/* VN bf16 values widened to fp32 (each the high half of its float: exact). GCC lowers a vector
 * extension's u16 -> u32 conversion through 128-bit halves on AVX2 (five instructions where one
 * does): the SIMD bodies say it with intrinsics. */
static inline v4 bf16_plain(const uint16_t *p) {
    return (v4)(__builtin_convertvector(LOADV(v4h, p), v4u) << 16);
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline v8 bf16_avx2(const uint16_t *p) {
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
__attribute__((target("avx512f,fma"))) static inline v16 bf16_avx512(const uint16_t *p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#endif

#define ROWS_BODIES(ISA, TARGET, VF, VI, VN)                                                        \
    TARGET static inline float hsum_##ISA(VF v) {                                                   \
        float l[VN];                                                                                \
        memcpy(l, &v, sizeof l);                                                                    \
        for (int w = VN / 2; w; w /= 2)                                                             \
            for (int i = 0; i < w; i++) l[i] += l[i + w];                                           \
        return l[0];                                                                                \
    }                                                                                               \
    TARGET static inline VF f32_##ISA(const float *p) { return LOADV(VF, p); }                     \
    /* four chains of FMAs (an FMA's latency is four): n a multiple of 16; b's values read by LOAD */ \
    DOT16(dot16_##ISA, TARGET, float, f32_##ISA, VF, VN, hsum_##ISA)                                \
    DOT16(dot16w_##ISA, TARGET, uint16_t, bf16_##ISA, VF, VN, hsum_##ISA)                           \
    /* exp of each of 16 lanes for x <= 0 (Cephes' expf: 2^n times a degree-6 polynomial, ~1 ulp) */ \
    TARGET static inline void exp16_##ISA(float *x) {                                               \
        for (int j = 0; j < 16; j += VN) {                                                          \
            VF v = LOADV(VF, x + j), lo = {0};                                                      \
            lo -= 87.0f;                                                                            \
            const VI under = v < lo;                      /* -inf included: e^-87 ~ 0 */          \
            v = (VF)(((VI)v & ~under) | ((VI)lo & under));                                          \
            VF t = v * 1.44269504f + 12582912.0f;        /* + 1.5 * 2^23: round to nearest */      \
            const VF n = t - 12582912.0f;                                                           \
            v = v - n * 0.693359375f + n * 2.12194440e-4f;                                          \
            const VF z = v * v;                                                                     \
            VF y = ((((1.9875691500e-4f * v + 1.3981999507e-3f) * v + 8.3334519073e-3f) * v +        \
                     4.1665795894e-2f) * v + 1.6666665459e-1f) * v + 5.0000001201e-1f;              \
            y = y * z + v + 1.0f;                                                                   \
            const VI e = (__builtin_convertvector(n, VI) + 127) << 23;                              \
            STOREV(VF, x + j, y * (VF)e);                                                           \
        }                                                                                           \
    }                                                                                               \
    TARGET static void rms_row_##ISA(const float *x, int64_t n, const float *w, float eps, float *out) { \
        const float r = 1.0f / sqrtf(dot16_##ISA(x, x, n) / (float)n + eps);                        \
        for (int64_t i = 0; i < n; i += VN) {                                                       \
            VF y = LOADV(VF, x + i) * r;                                                            \
            STOREV(VF, out + i, w ? y * LOADV(VF, w + i) : y);                                      \
        }                                                                                           \
    }                                                                                               \
    /* a router's logits for experts 16b .. 16b+15: logits [T, N] = x [T, E] . w [N, E] */        \
    /* a bf16 row over several tokens is widened once (a prompt chunk's: the widening's work is     \
     * then a row's, not a row's a token), one token's as it is read */                            \
    TARGET static void router_task_##ISA(void *ctx, int64_t b) {                                    \
        const router_args *R = ctx;                                                                 \
        float *wide = R->w_bf16 && R->T > 1 ? malloc(sizeof(float) * R->E) : NULL;                  \
        for (int64_t n = 16 * b; n < 16 * b + 16 && n < R->N; n++) {                                \
            const uint16_t *narrow = (const uint16_t *)R->w + n * R->E;                             \
            const float *row = (const float *)R->w + n * R->E;                                      \
            if (wide) {                                                                             \
                for (int64_t i = 0; i < R->E; i += VN) STOREV(VF, wide + i, bf16_##ISA(narrow + i)); \
                row = wide;                                                                         \
            }                                                                                       \
            for (int64_t t = 0; t < R->T; t++)                                                      \
                R->logits[t * R->N + n] = R->w_bf16 && !wide ? dot16w_##ISA(R->x + t * R->E, narrow, R->E) \
                                                             : dot16_##ISA(R->x + t * R->E, row, R->E);     \
        }                                                                                           \
        free(wide);                                                                                 \
    }

/* sum a_i b_i, n a multiple of 16, b of type BT read VN at a time by LOAD (fp32, or bf16 widened:
 * the same values give the same sums, the operations and their order being one) */
#define DOT16(NAME, TARGET, BT, LOAD, VF, VN, HSUM)                                                 \
    TARGET static inline float NAME(const float *a, const BT *b, int64_t n) {                       \
        VF s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                  \
        int64_t i = 0;                                                                              \
        for (; i + 4 * VN <= n; i += 4 * VN) {                                                      \
            s0 += LOADV(VF, a + i) * LOAD(b + i), s1 += LOADV(VF, a + i + VN) * LOAD(b + i + VN);   \
            s2 += LOADV(VF, a + i + 2 * VN) * LOAD(b + i + 2 * VN);                                 \
            s3 += LOADV(VF, a + i + 3 * VN) * LOAD(b + i + 3 * VN);                                 \
        }                                                                                           \
        for (; i < n; i += VN) s0 += LOADV(VF, a + i) * LOAD(b + i);                                \
        return HSUM((s0 + s1) + (s2 + s3));                                                         \
    }

#define PLAIN
#if defined(__x86_64__)
ROWS_BODIES(avx512, __attribute__((target("avx512f,fma"))), v16, v16i, 16)
ROWS_BODIES(avx2, __attribute__((target("avx2,fma"))), v8, v8i, 8)
#endif
ROWS_BODIES(plain, PLAIN, v4, v4i, 4)

typedef void (*rms_fn)(const float *, int64_t, const float *, float, float *);
static rms_fn rms_row = rms_row_plain;
static task_fn router_task = router_task_plain;

static void choose_rows_isa(void) {
    choose_isa();
#if defined(__x86_64__)
    if (!strncmp(isa, "avx512", 6))
        rms_row = rms_row_avx512, router_task = router_task_avx512;
    else if (strcmp(isa, "portable"))
        rms_row = rms_row_avx2, router_task = router_task_avx2;
#endif
}

/* out [rows, n] = RMSNorm of the rows of x (row r at x + r * stride), times w when w is given.
 * Returns -1 for n not a multiple of 16. */
int moe_rms_norm(const float *x, int64_t rows, int64_t n, int64_t stride, const float *w, float eps, float *out) {
    if (n % 16) return -1;
    choose_rows_isa();
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * stride, n, w, eps, out + r * n);
    return 0;
}

/* head rows with out's strides given: head h of token t goes to out + h * out_head + t * D */
static void head_rows_to(const float *x, int64_t T, int64_t H, int64_t D, int64_t token_stride, int64_t head_stride,
                         const float *w, float eps, const float *cos, const float *sin, int64_t rot, float *out,
                         int64_t out_head) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *src = x + t * token_stride + h * head_stride;
            float *dst = out + h * out_head + t * D;
            if (w) rms_row(src, D, w, eps, dst);
            else memcpy(dst, src, sizeof(float) * D);
            if (!cos) continue;
            const float *c = cos + t * rot, *s = sin + t * rot;
            for (int64_t i = 0; i < half; i++) {           /* x * cos + cat(-x2, x1) * sin */
                const float a = dst[i], b = dst[i + half];
                dst[i] = a * c[i] - b * s[i];
                dst[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

/* x [T, H, D] (token t's head h at x + t * token_stride + h * head_stride) -> out [H, T, D]:
 * each head RMS-normed by w [D] when w is given (QK-norm), then its first `rot` channels rotated
 * by cos, sin [T, rot] (rotate-half RoPE; none when cos is NULL), the rest passed through. */
int moe_head_rows(const float *x, int64_t T, int64_t H, int64_t D, int64_t token_stride, int64_t head_stride,
                  const float *w, float eps, const float *cos, const float *sin, int64_t rot, float *out) {
    if (D % 16 || rot % 2 || rot > D) return -1;
    choose_rows_isa();
    head_rows_to(x, T, H, D, token_stride, head_stride, w, eps, cos, sin, rot, out, T * D);
    return 0;
}

/* A softmax router: probabilities = softmax(x [T, E] . w [N, E] (+ bias [N] when given: gpt-oss))
 * per token, its k largest (largest first, the lower expert first on a tie) -> ids [T, k], weights
 * [T, k], divided by their sum when renorm (gpt-oss's softmax of its top-k logits is that). The
 * logits' rows are split over the pool. Returns -1 for E not a multiple of 16 or k not in 1..N. */
int moe_softmax_topk(const float *x, int64_t T, int64_t E, const void *w, int w_bf16, const float *bias, int64_t N,
                     int64_t k, int renorm, int64_t *ids, float *weights) {
    if (E % 16 || k < 1 || k > N) return -1;
    choose_rows_isa();
    float *logits = malloc(sizeof(float) * T * N);
    router_args R = {x, w, w_bf16, T, E, N, logits};
    parallel(router_task, &R, (N + 15) / 16);
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * N, top = -INFINITY, sum = 0.0f, kept = 0.0f;
        for (int64_t n = 0; bias && n < N; n++) l[n] += bias[n];
        for (int64_t n = 0; n < N; n++) top = l[n] > top ? l[n] : top;
        for (int64_t n = 0; n < N; n++) l[n] = expf(l[n] - top), sum += l[n];
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t n = 0; n < N; n++)
                if (l[n] >= 0.0f && (best < 0 || l[n] > l[best])) best = n;
            ids[t * k + j] = best, weights[t * k + j] = l[best] / sum, kept += weights[t * k + j];
            l[best] = -1.0f;                                       /* taken */
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++) weights[t * k + j] /= kept;
    }
    free(logits);
    return 0;
}

/* the k largest of v [N] not yet in `out` (out[n] nonzero), largest first, the lower index first
 * on a tie -> ids [k]; each one picked is marked in out */
static void pick_largest(const float *v, int64_t N, int64_t k, uint8_t *out, int64_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t n = 0; n < N; n++)
            if (!out[n] && (best < 0 || v[n] > v[best])) best = n;
        ids[j] = best, out[best] = 1;
    }
}

/* DeepSeek-V3's router (GLM-4.5, GLM-4.7-Flash; models/layers.sigmoid_group_topk): scores =
 * sigmoid(x [T, E] . w [N, E]); experts chosen by score + bias [N] among the `top_groups` of
 * `groups` groups whose two best biased scores sum highest -> ids [T, k] (as pick_largest), weights
 * [T, k] their unbiased scores, divided by their sum (+ 1e-20) when normalise, times scale.
 * Returns -1 for E not a multiple of 16, k not in 1..N or N not a multiple of groups. */
int moe_sigmoid_topk(const float *x, int64_t T, int64_t E, const void *w, int w_bf16, const float *bias, int64_t N,
                     int64_t k, int64_t groups, int64_t top_groups, int normalise, float scale, int64_t *ids,
                     float *weights) {
    if (E % 16 || k < 1 || k > N || groups < 1 || N % groups) return -1;
    choose_rows_isa();
    const int64_t per = N / groups;
    float *scores = malloc(sizeof(float) * T * N), *choice = malloc(sizeof(float) * (N + groups));
    uint8_t *out = malloc(N + groups);
    router_args R = {x, w, w_bf16, T, E, N, scores};
    parallel(router_task, &R, (N + 15) / 16);
    for (int64_t t = 0; t < T; t++) {
        float *s = scores + t * N, *best = choice + N, kept = 0.0f;
        for (int64_t n = 0; n < N; n++) s[n] = 1.0f / (1.0f + expf(-s[n])), choice[n] = s[n] + bias[n];
        memset(out, 0, N + groups);
        if (top_groups < groups) {
            for (int64_t g = 0; g < groups; g++) {          /* each group's two best choices, summed */
                int64_t two[2] = {0, 0};
                pick_largest(choice + g * per, per, 2 < per ? 2 : per, out + g * per, two);
                best[g] = choice[g * per + two[0]] + (per > 1 ? choice[g * per + two[1]] : 0.0f);
            }
            for (int64_t j = 0, g; j < top_groups; j++) pick_largest(best, groups, 1, out + N, &g);
            for (int64_t n = 0; n < N; n++) out[n] = !out[N + n / per];   /* only the kept groups' experts */
        }
        pick_largest(choice, N, k, out, ids + t * k);
        for (int64_t j = 0; j < k; j++) weights[t * k + j] = s[ids[t * k + j]], kept += weights[t * k + j];
        for (int64_t j = 0; j < k; j++)
            weights[t * k + j] = (normalise ? weights[t * k + j] / (kept + 1e-20f) : weights[t * k + j]) * scale;
    }
    free(scores), free(choice), free(out);
    return 0;
}
