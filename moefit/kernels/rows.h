/* The float operations of a step between its quantised matrices, for fp32 rows on the host:
 *
 *   moe_rms_norm    RMSNorm of rows (rows may be strided: a view of a wider projection)
 *   moe_head_rows   a projection's heads [T, H, D] -> [H, T, D], each optionally RMS-normed
 *                   (QK-norm) and rotated (RoPE, rotate-half, on its first `rot` channels)
 *   moe_attend_one  one query position's heads against a contiguous fp32 KV [K, S, D]
 *                   (grouped-query), an online softmax over blocks of keys, kv heads over the pool
 *   moe_softmax_topk  a softmax router: the router's matrix over the pool, then softmax and top-k
 *
 * torch dispatches each of these as several operations, and at one token its overhead is the
 * cost: measured on the bench shape (bench/decode.py, 2 threads), a decode token spent ~20 ms of
 * ~70 in torch operations between the kernels, RMSNorm ~90 us a call (50 calls a token) and
 * attention ~230 us a layer at 160 keys. Vectors are GCC vector extensions: each body is compiled
 * for AVX512, AVX2 + FMA and plain x86-64 (the same source) and chosen after choose_isa.
 * The results equal float64 references to fp32 rounding (tests/test_rows.py). */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define LOAD16(p) ({ v16 v_; memcpy(&v_, (p), 64); v_; })
#define LOADV(T, p) ({ T v_; memcpy(&v_, (p), sizeof(T)); v_; })
#define STOREV(T, p, v) do { T w_ = (v); memcpy((p), &w_, sizeof(T)); } while (0)
#define STORE16(p, v) do { v16 w_ = (v); memcpy((p), &w_, 64); } while (0)
#define KEY_BLOCK 16                /* keys a softmax block: one vector of scores */

typedef struct {
    const float *q, *k, *v;            /* q [H, D]; k [K, ., D], v [K, ., Dv] with head strides */
    int64_t k_head, v_head, S, D, Dv, g;
    float scale;
    float *out;                        /* [H, Dv] */
} attend_args;

/* Sums of 16 vectors in one vector (lane i: the sum of a[i]'s lanes): four levels of pairwise
 * shuffles and adds, 30 shuffles for 16 sums instead of 16 horizontal sums. */
#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
#define LEVEL1(a, b) (FOLD(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                      FOLD(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define LEVEL2(a, b) (FOLD(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
                      FOLD(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define LEVEL3(a, b) (FOLD(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
                      FOLD(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define LEVEL4(a, b) (FOLD(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
                      FOLD(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))

typedef int32_t v16i __attribute__((vector_size(64)));

typedef struct {
    const float *x, *w;
    int64_t T, E, N;
    float *logits;
} router_args;

#define ROWS_BODIES(ISA, TARGET)                                                                    \
    TARGET static inline float dot16_##ISA(const float *a, const float *b, int64_t n) {               \
        v16 s0 = {0}, s1 = {0};                                                                     \
        int64_t i = 0;                                                                              \
        for (; i + 32 <= n; i += 32) s0 += LOAD16(a + i) * LOAD16(b + i), s1 += LOAD16(a + i + 16) * LOAD16(b + i + 16); \
        for (; i < n; i += 16) s0 += LOAD16(a + i) * LOAD16(b + i);                                 \
        s0 += s1;                                                                                   \
        v8 h = FOLD(s0, s0, 0, 1, 2, 3, 4, 5, 6, 7) + FOLD(s0, s0, 8, 9, 10, 11, 12, 13, 14, 15);   \
        v4 c = FOLD(h, h, 0, 1, 2, 3) + FOLD(h, h, 4, 5, 6, 7);                                     \
        return (c[0] + c[2]) + (c[1] + c[3]);                                                       \
    }                                                                                               \
    /* exp of each lane for x <= 0 (Cephes' expf: 2^n times a degree-6 polynomial, ~1 ulp) */      \
    TARGET static inline void exp16_##ISA(float *x) {                                               \
        v16 v = LOAD16(x), lo = {0};                                                                \
        lo -= 87.0f;                                                                                \
        const v16i under = v < lo;                        /* -inf included: e^-87 ~ 0 */          \
        v = (v16)(((v16i)v & ~under) | ((v16i)lo & under));                                         \
        v16 t = v * 1.44269504f + 12582912.0f;           /* + 1.5 * 2^23: round to nearest */      \
        const v16 n = t - 12582912.0f;                                                              \
        v = v - n * 0.693359375f + n * 2.12194440e-4f;                                              \
        const v16 z = v * v;                                                                        \
        v16 y = ((((1.9875691500e-4f * v + 1.3981999507e-3f) * v + 8.3334519073e-3f) * v +           \
                  4.1665795894e-2f) * v + 1.6666665459e-1f) * v + 5.0000001201e-1f;                 \
        y = y * z + v + 1.0f;                                                                       \
        const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;                              \
        STORE16(x, y * (v16)e);                                                                     \
    }                                                                                               \
    TARGET static void rms_row_##ISA(const float *x, int64_t n, const float *w, float eps, float *out) { \
        const float r = 1.0f / sqrtf(dot16_##ISA(x, x, n) / (float)n + eps);                        \
        for (int64_t i = 0; i < n; i += 16) {                                                       \
            v16 y = LOAD16(x + i) * r;                                                              \
            STORE16(out + i, w ? y * LOAD16(w + i) : y);                                            \
        }                                                                                           \
    }                                                                                               \
    /* a router's logits for experts 16b .. 16b+15: logits [T, N] = x [T, E] . w [N, E] */        \
    TARGET static void router_task_##ISA(void *ctx, int64_t b) {                                    \
        const router_args *R = ctx;                                                                 \
        for (int64_t n = 16 * b; n < 16 * b + 16 && n < R->N; n++)                                  \
            for (int64_t t = 0; t < R->T; t++)                                                      \
                R->logits[t * R->N + n] = dot16_##ISA(R->x + t * R->E, R->w + n * R->E, R->E);      \
    }                                                                                               \
    /* p[16] = scale * (q . k[i]) for the block's 16 keys (rows D apart) */                          \
    TARGET static void scores16_##ISA(const float *q, const float *k, int64_t D, float scale, float *p) { \
        v16 a[16];                                                                                  \
        for (int i = 0; i < 16; i++) a[i] = (v16){0};                                               \
        for (int64_t c = 0; c < D; c += 16) {                                                       \
            const v16 qc = LOAD16(q + c);                                                           \
            for (int i = 0; i < 16; i++) a[i] += qc * LOAD16(k + i * D + c);                        \
        }                                                                                           \
        v16 b[8], d[4], e[2];                                                                       \
        for (int i = 0; i < 8; i++) b[i] = LEVEL1(a[2 * i], a[2 * i + 1]);                          \
        for (int i = 0; i < 4; i++) d[i] = LEVEL2(b[2 * i], b[2 * i + 1]);                          \
        for (int i = 0; i < 2; i++) e[i] = LEVEL3(d[2 * i], d[2 * i + 1]);                          \
        STORE16(p, LEVEL4(e[0], e[1]) * scale);                                                     \
    }                                                                                               \
    /* acc[j] = acc[j] * keep[j] + sum over the block's n keys of p[j][s] * v[s]: 4 VW columns at \
     * a time in four registers, then VW (VT: the ISA's own vectors, see ROWS_BODIES' callers) */ \
    TARGET static void values_##ISA(const attend_args *A, const float *v, const float *p, int64_t n, \
                                    const float *keep, float *acc) {                                \
        const int64_t Dv = A->Dv;                                                                   \
        for (int64_t j = 0; j < A->g; j++) {                                                        \
            const float *pj = p + j * KEY_BLOCK, kj = keep[j];                                      \
            float *o = acc + j * Dv;                                                                \
            int64_t c = 0;                                                                          \
            for (; c + 4 * VW <= Dv; c += 4 * VW) {                                                 \
                VT a0 = LOADV(VT, o + c) * kj, a1 = LOADV(VT, o + c + VW) * kj;                     \
                VT a2 = LOADV(VT, o + c + 2 * VW) * kj, a3 = LOADV(VT, o + c + 3 * VW) * kj;        \
                for (int64_t s = 0; s < n; s++) {                                                   \
                    const float ps = pj[s], *vs = v + s * Dv + c;                                   \
                    a0 += ps * LOADV(VT, vs), a1 += ps * LOADV(VT, vs + VW);                        \
                    a2 += ps * LOADV(VT, vs + 2 * VW), a3 += ps * LOADV(VT, vs + 3 * VW);           \
                }                                                                                   \
                STOREV(VT, o + c, a0);                                                              \
                STOREV(VT, o + c + VW, a1);                                                         \
                STOREV(VT, o + c + 2 * VW, a2);                                                     \
                STOREV(VT, o + c + 3 * VW, a3);                                                     \
            }                                                                                       \
            for (; c < Dv; c += VW) {                                                               \
                VT a = LOADV(VT, o + c) * kj;                                                       \
                for (int64_t s = 0; s < n; s++) a += pj[s] * LOADV(VT, v + s * Dv + c);             \
                STOREV(VT, o + c, a);                                                               \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    /* the block's softmax numerators into p (lanes past n: 0), and each head's running max m,    \
     * sum l and the factor keep its earlier sums take */                                          \
    TARGET static void block_##ISA(const attend_args *A, const float *q, const float *k, int64_t n, \
                                   float *p, float *m, float *l, float *keep) {                    \
        for (int64_t j = 0; j < A->g; j++) {                                                        \
            float *pj = p + j * KEY_BLOCK, top = m[j], sum = 0.0f;                                  \
            if (n == KEY_BLOCK) scores16_##ISA(q + j * A->D, k, A->D, A->scale, pj);                \
            else                                                                                    \
                for (int64_t s = 0; s < KEY_BLOCK; s++)                                             \
                    pj[s] = s < n ? A->scale * dot16_##ISA(q + j * A->D, k + s * A->D, A->D) : -INFINITY; \
            for (int64_t s = 0; s < n; s++) top = pj[s] > top ? pj[s] : top;                        \
            for (int64_t s = 0; s < KEY_BLOCK; s++) pj[s] -= top;                                   \
            exp16_##ISA(pj);                                                                        \
            for (int64_t s = n; s < KEY_BLOCK; s++) pj[s] = 0.0f;                                   \
            for (int64_t s = 0; s < n; s++) sum += pj[s];                                           \
            keep[j] = expf(m[j] - top), l[j] = l[j] * keep[j] + sum, m[j] = top;                    \
        }                                                                                           \
    }                                                                                               \
    TARGET static void attend_head_##ISA(void *ctx, int64_t h) {                                    \
        const attend_args *A = ctx;                                                                 \
        const float *q = A->q + h * A->g * A->D, *k = A->k + h * A->k_head, *v = A->v + h * A->v_head; \
        float p[16 * KEY_BLOCK], m[16], l[16], keep[16], *acc = A->out + h * A->g * A->Dv;          \
        for (int64_t j = 0; j < A->g; j++) m[j] = -INFINITY, l[j] = 0.0f;                           \
        memset(acc, 0, sizeof(float) * A->g * A->Dv);                                               \
        for (int64_t s0 = 0; s0 < A->S; s0 += KEY_BLOCK) {                                          \
            const int64_t n = A->S - s0 < KEY_BLOCK ? A->S - s0 : KEY_BLOCK;                        \
            block_##ISA(A, q, k + s0 * A->D, n, p, m, l, keep);                                     \
            values_##ISA(A, v + s0 * A->Dv, p, n, keep, acc);                                       \
        }                                                                                           \
        for (int64_t j = 0; j < A->g; j++)                                                          \
            for (int64_t c = 0; c < A->Dv; c += 16) STORE16(acc + j * A->Dv + c, LOAD16(acc + j * A->Dv + c) / l[j]); \
    }

/* VT, VW: the vectors values_ accumulates in, the ISA's own registers (AVX2's 8 floats: GCC kept
 * 16-float ones there on the stack and built each broadcast with 16 scalar stores, measured 9.0 ms
 * a 4096-key position against 3.2 now) */
#define PLAIN
#if defined(__x86_64__)
#define VT v16
#define VW 16
ROWS_BODIES(avx512, __attribute__((target("avx512f,fma"))))
#undef VT
#undef VW
#define VT v8
#define VW 8
ROWS_BODIES(avx2, __attribute__((target("avx2,fma"))))
#undef VT
#undef VW
#endif
#define VT v16
#define VW 16
ROWS_BODIES(plain, PLAIN)
#undef VT
#undef VW

typedef void (*rms_fn)(const float *, int64_t, const float *, float, float *);
static rms_fn rms_row = rms_row_plain;
static task_fn attend_head = attend_head_plain, router_task = router_task_plain;

static void choose_rows_isa(void) {
    choose_isa();
#if defined(__x86_64__)
    if (!strncmp(isa, "avx512", 6))
        rms_row = rms_row_avx512, attend_head = attend_head_avx512, router_task = router_task_avx512;
    else if (strcmp(isa, "portable"))
        rms_row = rms_row_avx2, attend_head = attend_head_avx2, router_task = router_task_avx2;
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

/* q [H, D] (one position) against k [K, S, D], v [K, S, Dv] (head h's rows at k + h * k_head,
 * v + h * v_head; query heads h*g .. h*g+g-1 read kv head h) -> out [H, Dv], softmax(q.k * scale).
 * Returns -1 for dims not a multiple of 16 or more than 16 query heads a kv head. */
int moe_attend_one(const float *q, const float *k, const float *v, int64_t H, int64_t K, int64_t S, int64_t D,
                   int64_t Dv, int64_t k_head, int64_t v_head, float scale, float *out) {
    if (D % 16 || Dv % 16 || H % K || H / K > 16 || S < 1) return -1;
    choose_rows_isa();
    attend_args A = {q, k, v, k_head, v_head, S, D, Dv, H / K, scale, out};
    parallel(attend_head, &A, K);
    return 0;
}

/* A softmax router: probabilities = softmax(x [T, E] . w [N, E]) per token, its k largest
 * (largest first, the lower expert first on a tie) -> ids [T, k], weights [T, k], divided by
 * their sum when renorm. The logits' rows are split over the pool. Returns -1 for E not a
 * multiple of 16 or k not in 1..N. */
int moe_softmax_topk(const float *x, int64_t T, int64_t E, const float *w, int64_t N, int64_t k, int renorm,
                     int64_t *ids, float *weights) {
    if (E % 16 || k < 1 || k > N) return -1;
    choose_rows_isa();
    float *logits = malloc(sizeof(float) * T * N);
    router_args R = {x, w, T, E, N, logits};
    parallel(router_task, &R, (N + 15) / 16);
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * N, top = -INFINITY, sum = 0.0f, kept = 0.0f;
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
