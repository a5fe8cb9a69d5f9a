/* The dot bodies of moe.c (included by it): one weight row of int8, int4 or Q8_0 (and, through
 * kquants.h, the GGUF K-quants, IQ4_XS and MXFP4) against one quantised activation row. A
 * portable body for each, and SIMD bodies per instruction set (AVX2, AVX-VNNI, AVX512-VNNI),
 * each with its own target attribute; moe.c's choose_isa picks them at run time.
 * bench/kernel_rows.c times them alone.
 */

/* ---- dot products: one weight row against one quantised activation row ----------------- */
typedef float (*dot_fn)(const void *w, const void *ws, const int8_t *q, const float *qs, const int32_t *qsum,
                        int64_t n, int64_t group);

static float dot_q8_portable(const void *w, const void *ws, const int8_t *q, const float *qs,
                             const int32_t *qsum, int64_t n, int64_t group) {
    (void)group, (void)qsum;
    const int8_t *c = w;
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += c[b * QK + i] * q[b * QK + i];
        acc += qs[b] * (float)isum;
    }
    return acc * *(const float *)ws;
}

/* Q8_0 (llama.cpp's): int8 codes, one fp16 scale per (row, block of 32). */
static float dot_q8g_portable(const void *w, const void *ws, const int8_t *q, const float *qs,
                              const int32_t *qsum, int64_t n, int64_t group) {
    (void)group, (void)qsum;
    const int8_t *c = w;
    const uint16_t *s = ws;
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += c[b * QK + i] * q[b * QK + i];
        acc += qs[b] * half_to_float(s[b]) * (float)isum;
    }
    return acc;
}

static float dot_q4_portable(const void *w, const void *ws, const int8_t *q, const float *qs,
                             const int32_t *qsum, int64_t n, int64_t group) {
    (void)qsum;
    const uint8_t *c = w;
    const uint16_t *s = ws;
    const int64_t per_group = group / QK;
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            const uint8_t byte = c[b * 16 + i];
            isum += ((byte & 15) - 8) * q[b * QK + i] + ((byte >> 4) - 8) * q[b * QK + 16 + i];
        }
        acc += qs[b] * half_to_float(s[b / per_group]) * (float)isum;
    }
    return acc;
}

#include "kquants.h"

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 256-bit bodies, once per instruction set: DOT32(u8, s8) gives eight int32 partial sums.
 * int8 weights: |w| against sign(w) * x, blocks two at a time into two accumulators. int4: the
 * nibble (0..15) against x, less 8 sum x. */
#define Q8_BLOCK(DOT32, BLOCK_SCALE, b, acc)                                                   \
    do {                                                                                       \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(c + (b) * QK));                \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + (b) * QK));                \
        const __m256i isum = DOT32(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));        \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(qs[b] * (BLOCK_SCALE(b))), acc); \
    } while (0)
#define Q8_BODY(NAME, TARGET, DOT32, BLOCK_SCALE, ROW_SCALE)                                \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,           \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) { \
        (void)group, (void)qsum, (void)ws;                                                     \
        const int8_t *c = w;                                                                   \
        const int64_t nb = n / QK;                                                             \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                         \
        int64_t b = 0;                                                                         \
        for (; b + 1 < nb; b += 2) {                                                           \
            Q8_BLOCK(DOT32, BLOCK_SCALE, b, acc0);                                             \
            Q8_BLOCK(DOT32, BLOCK_SCALE, b + 1, acc1);                                         \
        }                                                                                      \
        if (b < nb) Q8_BLOCK(DOT32, BLOCK_SCALE, b, acc0);                                     \
        return hsum8(_mm256_add_ps(acc0, acc1)) * (ROW_SCALE);                                 \
    }
/* int8: one fp32 scale per row, applied once; Q8_0: each block's own fp16 scale */
#define ROW_SCALE_F32 (*(const float *)ws)
#define BLOCK_SCALE_ONE(b) 1.0f
#define BLOCK_SCALE_F16(b) _cvtsh_ss(((const uint16_t *)ws)[b])

/* int4: UNPACK turns a block's 16 bytes into 32 unsigned codes in the activations' order (1);
 * LANES corrects the sum's lanes at the end. Blocks two at a time into two accumulators (an FMA's
 * latency is not in every block's path), the group's scale converted once per group. AVX2: the
 * high nibbles shifted down (maddubs saturates on 16 * 15 * 127 pairs); VNNI (no saturation): the
 * bytes in both halves, the high nibbles masked in place (16 times the code: no shift, no lane
 * insert), lanes 4-7 divided by 16 once. */
#define Q4_UNPACK_SHIFT(c) _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(c)), 4), \
                                                             _mm_loadu_si128((const __m128i *)(c))), _mm256_set1_epi8(15))
#define Q4_UNPACK_MASK(c) _mm256_and_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(c))), \
                                           _mm256_set_m128i(_mm_set1_epi8((char)0xf0), _mm_set1_epi8(0x0f)))
#define Q4_LANES_SHIFT _mm256_set1_ps(1.0f)
#define Q4_LANES_MASK _mm256_set_ps(0.0625f, 0.0625f, 0.0625f, 0.0625f, 1.0f, 1.0f, 1.0f, 1.0f)
#define Q4_BLOCK(DOT32, UNPACK, b, d, acc)                                                     \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT32(UNPACK(c + (b) * 16),                        \
                                                   _mm256_loadu_si256((const __m256i *)(q + (b) * QK)))), \
                          _mm256_set1_ps(d), acc)

#define Q4_BODY(NAME, TARGET, DOT32, UNPACK, LANES)                                           \
    __attribute__((target(TARGET))) static float NAME(const void *w, const void *ws,           \
            const int8_t *q, const float *qs, const int32_t *qsum, int64_t n, int64_t group) { \
        const uint8_t *c = w;                                                                  \
        const uint16_t *s = ws;                                                                \
        const int64_t per_group = group / QK, nb = n / QK;                                     \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                         \
        float off0 = 0.0f, off1 = 0.0f;                                                        \
        int64_t b = 0;                                                                         \
        for (int64_t g = 0; b < nb; g++) {                                                     \
            const float sw = _cvtsh_ss(s[g]);                                                  \
            const int64_t end = b + per_group < nb ? b + per_group : nb;                       \
            for (; b + 1 < end; b += 2) {                                                      \
                const float d0 = qs[b] * sw, d1 = qs[b + 1] * sw;                              \
                Q4_BLOCK(DOT32, UNPACK, b, d0, acc0);                                          \
                Q4_BLOCK(DOT32, UNPACK, b + 1, d1, acc1);                                      \
                off0 += d0 * (float)qsum[b], off1 += d1 * (float)qsum[b + 1];                  \
            }                                                                                  \
            if (b < end) {                                                                     \
                const float d0 = qs[b] * sw;                                                   \
                Q4_BLOCK(DOT32, UNPACK, b, d0, acc0);                                          \
                off0 += d0 * (float)qsum[b];                                                   \
                b++;                                                                           \
            }                                                                                  \
        }                                                                                      \
        return hsum8(_mm256_mul_ps(_mm256_add_ps(acc0, acc1), LANES)) - 8.0f * (off0 + off1); \
    }

#define DOT_AVX2(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16((a), (b)), _mm256_set1_epi16(1))
#define DOT_AVXVNNI(a, b) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (a), (b))

Q8_BODY(dot_q8_avx2, "avx2,fma,f16c", DOT_AVX2, BLOCK_SCALE_ONE, ROW_SCALE_F32)
Q8_BODY(dot_q8g_avx2, "avx2,fma,f16c", DOT_AVX2, BLOCK_SCALE_F16, 1.0f)
Q4_BODY(dot_q4_avx2, "avx2,fma,f16c", DOT_AVX2, Q4_UNPACK_SHIFT, Q4_LANES_SHIFT)
#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
Q8_BODY(dot_q8_avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI, BLOCK_SCALE_ONE, ROW_SCALE_F32)
Q8_BODY(dot_q8g_avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI, BLOCK_SCALE_F16, 1.0f)
Q4_BODY(dot_q4_avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI, Q4_UNPACK_MASK, Q4_LANES_MASK)
#define HAVE_AVXVNNI 1
#endif

/* AVX512-VNNI: two blocks an instruction; lanes 0-7 hold block b, lanes 8-15 block b + 1. */
#define AVX512 "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"
/* AVX512-VNNI CPUs need not have AVX-VNNI (Zen 4 has not): its 256-bit dot, EVEX-encoded */
#define DOT_VNNI256(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (a), (b))
/* int4 a row at a time (the rows past a matrix's panels; panels.h multiplies the rest) */
Q4_BODY(dot_q4_vnni256, AVX512, DOT_VNNI256, Q4_UNPACK_MASK, Q4_LANES_MASK)

/* Two int8 blocks against their activations: the codes made unsigned (c + 128: one xor, where a
 * sign trick takes three operations), the 128 sum x that adds taken off through the block sums.
 * int32 lanes 0-7: block b, 8-15: b + 1. */
__attribute__((target(AVX512))) static inline __m512 q8_pair(__m512i codes, __m512i q) {
    const __m512i u = _mm512_xor_si512(codes, _mm512_set1_epi8((char)0x80));
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q));
}

/* `blocks` (16, or fewer at a row's end: masked, what lies beyond reads as zero) blocks whose
 * scales are d, into two accumulators. */
__attribute__((target(AVX512))) static inline void q8_chunk(const int8_t *c, const int8_t *q, __m512 d, int blocks,
                                                             __m512 acc[2]) {
    for (int k = 0; k < 16 && k < blocks; k += 2) {
        const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(k), _mm256_set1_epi32(k + 1), 1);
        const __m512 dot = blocks - k >= 2
            ? q8_pair(_mm512_loadu_si512(c + k * QK), _mm512_loadu_si512(q + k * QK))
            : q8_pair(_mm512_maskz_loadu_epi8(0xffffffffu, c + k * QK), _mm512_maskz_loadu_epi8(0xffffffffu, q + k * QK));
        acc[k / 2 % 2] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(idx, d), acc[k / 2 % 2]);
    }
}

/* sum over blocks of d_b * (codes . activations)_b, d_b = qs_b (times the block's fp16 scale
 * where s is given: Q8_0), sixteen blocks' scales in one vector. */
__attribute__((target(AVX512))) static float q8_blocks_vnni512(const int8_t *c, const uint16_t *s, const int8_t *q,
        const float *qs, const int32_t *qsum, int64_t nb) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, off = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const int m = nb - b < 16 ? (int)(nb - b) : 16;
        const __mmask16 lanes = (__mmask16)((1u << m) - 1);
        __m512 d = _mm512_maskz_loadu_ps(lanes, qs + b);
        if (s) d = _mm512_mul_ps(d, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, s + b)));
        off = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, qsum + b)), off);
        if (m == 16) q8_chunk(c + b * QK, q + b * QK, d, 16, acc);
        else q8_chunk(c + b * QK, q + b * QK, d, m, acc);
    }
    return _mm512_reduce_add_ps(_mm512_fnmadd_ps(_mm512_set1_ps(128.0f), off, _mm512_add_ps(acc[0], acc[1])));
}

/* int8: one fp32 scale per row */
__attribute__((target(AVX512))) static float dot_q8_vnni512(const void *w, const void *ws, const int8_t *q,
        const float *qs, const int32_t *qsum, int64_t n, int64_t group) {
    (void)group;
    return q8_blocks_vnni512(w, NULL, q, qs, qsum, n / QK) * *(const float *)ws;
}

/* Q8_0: an fp16 scale per block */
__attribute__((target(AVX512))) static float dot_q8g_vnni512(const void *w, const void *ws, const int8_t *q,
        const float *qs, const int32_t *qsum, int64_t n, int64_t group) {
    (void)group;
    return q8_blocks_vnni512(w, ws, q, qs, qsum, n / QK);
}

#endif
