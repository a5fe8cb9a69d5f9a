/* One MoE layer's routed experts on the host, in one call:
 *
 *   out[t] += sum over (t, e, w) in the pairs of  w * down_e( silu(gate_e x_t) * up_e x_t )
 *
 * Weights stay in the pack's blob layout (int8: codes [R, C] + fp32 scale per row; int4: two
 * codes per byte, low nibble = even column, fp16 scale per (row, group of G columns); Q8_0 and
 * the GGUF K-quants and IQ4_XS as the file stores them, kquants.h).
 * Activations are quantised per block of 32 to int8 with one fp32 scale (llama.cpp's q8_0), so
 * every dot product is an integer dot product: AVX2 maddubs, or dpbusd where the CPU has
 * AVX-VNNI / AVX512-VNNI, chosen at run time. The file is built without -march=native: each
 * SIMD body carries its own target attribute, so one build runs on any x86-64 (and a portable
 * body serves other CPUs).
 *
 * Each expert's weights are read once per call whatever the number of its tokens (prefill
 * chunks and verify windows are GEMMs, not T GEMVs). Work is split over a persistent pthread
 * pool by (expert, block of weight rows); results are summed in the caller's expert order, so
 * the output does not depend on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32                      /* activation block */
#define ROWS_PER_TASK 16          /* the smallest task; larger when there are many rows */
#define TASKS_PER_THREAD 8         /* enough to balance, few enough that claiming costs nothing */

typedef struct {
    const void *gu, *gu_scale, *dn, *dn_scale;
} expert_ptrs;

/* ---- fp16 -> fp32 (scales) ------------------------------------------------------------ */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) f = sign;
        else {                                         /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) f = sign | 0x7f800000 | (man << 13);
    else f = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float out;
    memcpy(&out, &f, 4);
    return out;
}

/* ---- activation quantisation: x [n] -> q [n] int8, s [n / QK] scales, sum [n / QK] -------
 * order (where the int4 codes need it; 0 elsewhere): 1 stores each block as its 16 even then its
 * 16 odd elements, the order of the codes once a byte's low and high nibbles are split; 2 (the
 * AVX512 int4 body's) does so for a pair of blocks at once: the 16 even elements of block b,
 * those of b + 1, then the odd ones of b, of b + 1 (a last block without a pair as in 1). The
 * block sums let an int4 dot use the unsigned nibble directly: sum (c - 8) x = sum c x - 8 sum x. */
static void quantize_row(const float *x, int64_t n, int8_t *q, float *s, int32_t *sum, int order) {
    const int64_t nb = n / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        /* where element i goes: first + (i odd) * odd + i / 2 (order 0: first + i) */
        const int paired = order == 2 && !(b % 2 == 0 && b + 1 == nb);
        int8_t *first = q + (paired ? (b - b % 2) * QK + (b % 2) * 16 : b * QK);
        const int odd = paired ? 32 : 16;
        int32_t total = 0;
        s[b] = d;
        for (int i = 0; i < QK; i++) {
            const int8_t c = (int8_t)lrintf(xb[i] * id);
            first[order ? (i & 1) * odd + i / 2 : i] = c;
            total += c;
        }
        sum[b] = total;
    }
}

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
KQUANT_BODIES(avx2, "avx2,fma,f16c", DOT_AVX2)
KQUANT_BODIES(vnni256, AVX512, DOT_VNNI256)
Q4K_BODY512(dot_q4k_vnni512, AVX512)
#ifdef HAVE_AVXVNNI
KQUANT_BODIES(avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI)
#endif

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

/* Two int4 blocks (32 bytes of codes) against their activations in pair order (quantize_row,
 * order 2): the bytes loaded twice, the first copy's low nibbles kept, the second's high nibbles
 * kept in place (16 times the code: no shift, the lanes' scales are divided by 16 instead; at
 * most 4 * 240 * 127 a lane, exact in fp32). int32 lanes 0-3: block b, 4-7: b + 1, 8-11: b's
 * high nibbles, 12-15: b + 1's. */
__attribute__((target(AVX512))) static inline __m512 q4_pair(const uint8_t *c, const int8_t *q) {
    const __m512i nibbles = _mm512_inserti64x4(_mm512_set1_epi8(0x0f), _mm256_set1_epi8((char)0xf0), 1);
    const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)c));
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(bytes, nibbles),
                                                  _mm512_loadu_si512(q)));
}

/* The lane scales of pair k of a run of blocks whose scales are d (and d / 16 in d16). */
#define PAIR_SCALES(k) _mm512_set_epi32(17 + (k), 17 + (k), 17 + (k), 17 + (k), 16 + (k), 16 + (k), 16 + (k),      \
                                        16 + (k), 1 + (k), 1 + (k), 1 + (k), 1 + (k), k, k, k, k)

/* group 32: sixteen (or eight) blocks whose scales are converted and multiplied in one vector;
 * two accumulators, so that consecutive FMAs do not wait on each other. */
__attribute__((target(AVX512))) static inline void q4_g32_chunk(const uint8_t *c, const int8_t *q, __m512 d,
                                                                 int blocks, __m512 acc[2]) {
    const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(1.0f / 16));
    for (int k = 0; k < blocks; k += 2)
        acc[k / 2 % 2] = _mm512_fmadd_ps(q4_pair(c + k * 16, q + k * QK),
                                         _mm512_permutex2var_ps(d, PAIR_SCALES(k), d16), acc[k / 2 % 2]);
}

__attribute__((target(AVX512))) static int64_t q4_g32_vnni512(const uint8_t *c, const uint16_t *s, const int8_t *q,
        const float *qs, const int32_t *qsum, int64_t nb, __m512 acc[2], __m512 *off) {
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
        const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qs + b),
                                       _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + b))));
        *off = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_loadu_si512(qsum + b)), *off);
        q4_g32_chunk(c + b * 16, q + b * QK, d, 16, acc);
    }
    if (b + 8 <= nb) {
        const __m256 d8 = _mm256_mul_ps(_mm256_loadu_ps(qs + b), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + b))));
        const __m512 d = _mm512_zextps256_ps512(d8);
        *off = _mm512_fmadd_ps(d, _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(qsum + b)))),
                               *off);
        q4_g32_chunk(c + b * 16, q + b * QK, d, 8, acc);
        b += 8;
    }
    return b;
}

__attribute__((target(AVX512))) static float dot_q4_vnni512(const void *w, const void *ws, const int8_t *q,
        const float *qs, const int32_t *qsum, int64_t n, int64_t group) {
    const uint8_t *c = w;
    const uint16_t *s = ws;
    const int64_t per_group = group / QK, nb = n / QK;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, off = _mm512_setzero_ps();
    int64_t b = group == QK ? q4_g32_vnni512(c, s, q, qs, qsum, nb, acc, &off) : 0;
    float offset = 0.0f;
    for (; b + 1 < nb; b += 2) {                          /* groups of 64 and more: a pair at a time */
        const float d0 = qs[b] * _cvtsh_ss(s[b / per_group]), d1 = qs[b + 1] * _cvtsh_ss(s[(b + 1) / per_group]);
        const __m512 d = _mm512_castps128_ps512(_mm_set_ps(0.0f, 0.0f, d1, d0));
        const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(1.0f / 16));
        acc[0] = _mm512_fmadd_ps(q4_pair(c + b * 16, q + b * QK), _mm512_permutex2var_ps(d, PAIR_SCALES(0), d16),
                                 acc[0]);
        offset += d0 * (float)qsum[b] + d1 * (float)qsum[b + 1];
    }
    float tail = 0.0f;
    if (b < nb) {                                        /* an odd block count: the last one alone */
        const uint16_t one = s[b / per_group];
        tail = dot_q4_avx2(c + b * 16, &one, q + b * QK, qs + b, qsum + b, QK, QK);
    }
    const __m512 sum = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), off, _mm512_add_ps(acc[0], acc[1]));
    return _mm512_reduce_add_ps(sum) - 8.0f * offset + tail;
}
#endif

static dot_fn dot_q8 = dot_q8_portable, dot_q4 = dot_q4_portable, dot_q8g = dot_q8g_portable;
static dot_fn dot_q4k = dot_q4k_portable, dot_q5k = dot_q5k_portable, dot_q6k = dot_q6k_portable,
              dot_iq4xs = dot_iq4xs_portable, dot_mxfp4 = dot_mxfp4_portable;
#define SET_KQUANTS(SUFFIX)                                                                  \
    (dot_q4k = dot_q4k_##SUFFIX, dot_q5k = dot_q5k_##SUFFIX, dot_q6k = dot_q6k_##SUFFIX,             \
     dot_iq4xs = dot_iq4xs_##SUFFIX, dot_mxfp4 = dot_mxfp4_##SUFFIX)
static const char *isa = "portable";

/* The best the CPU has, or at most MOEFIT_ISA (portable, avx2, avx-vnni): how the tests run
 * every path on one machine. */
static void choose_isa(void) {
    static atomic_int chosen;                   /* once: every layer call asks */
    if (atomic_exchange(&chosen, 1)) return;
#if defined(__x86_64__)
    const char *cap = getenv("MOEFIT_ISA");
    if (cap && !strcmp(cap, "portable")) return;
    const int below_512 = cap && (!strcmp(cap, "avx2") || !strcmp(cap, "avx-vnni"));
    const int below_vnni = cap && !strcmp(cap, "avx2");
    __builtin_cpu_init();
    if (!below_512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw")) {
        dot_q8 = dot_q8_vnni512, dot_q4 = dot_q4_vnni512, isa = "avx512-vnni";
        dot_q8g = dot_q8g_vnni512;
        SET_KQUANTS(vnni256);
        dot_q4k = dot_q4k_vnni512;
        return;
    }
#ifdef HAVE_AVXVNNI
    if (!below_vnni && __builtin_cpu_supports("avxvnni")) {
        dot_q8 = dot_q8_avxvnni, dot_q4 = dot_q4_avxvnni, dot_q8g = dot_q8g_avxvnni, isa = "avx-vnni";
        SET_KQUANTS(avxvnni);
        return;
    }
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        dot_q8 = dot_q8_avx2, dot_q4 = dot_q4_avx2, dot_q8g = dot_q8g_avx2, isa = "avx2";
        SET_KQUANTS(avx2);
    }
#endif
}

/* ---- the thread pool: workers sleep on a condition variable between calls, spin briefly
 * between the phases of one call. `next` holds (generation << 32 | next task index), so a
 * worker still looking at an older phase can never claim a task of the new one. */
typedef void (*task_fn)(void *ctx, int64_t task);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int threads;                       /* including the caller */
    _Atomic uint64_t generation, next;
    _Atomic int64_t done;
    int64_t tasks;
    task_fn fn;
    void *ctx;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1};

#define SPIN 2000                  /* ~50 us: covers the gap between phases, not between layers */
#if defined(__x86_64__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static void run_tasks(uint64_t gen) {
    for (;;) {
        uint64_t v = atomic_load(&pool.next);
        if (v >> 32 != gen || (int64_t)(v & 0xffffffffu) >= pool.tasks) return;
        if (!atomic_compare_exchange_weak(&pool.next, &v, v + 1)) continue;
        pool.fn(pool.ctx, (int64_t)(v & 0xffffffffu));
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&pool.generation);
    for (;;) {
        int spins = 0;
        while (atomic_load(&pool.generation) == seen && spins++ < SPIN) RELAX();
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        run_tasks(seen);
    }
    return NULL;
}

static void parallel(task_fn fn, void *ctx, int64_t tasks) {
    if (pool.threads <= 1 || tasks == 1) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t);
        return;
    }
    const uint64_t gen = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.next, gen << 32);            /* first: stale workers stop claiming */
    pool.fn = fn, pool.ctx = ctx, pool.tasks = tasks;
    atomic_store(&pool.done, 0);
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.generation, gen);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_tasks(gen);
    while (atomic_load(&pool.done) < tasks) RELAX();
}

/* The order quantize_row stores activations in for a matrix of `quant` (after choose_isa). */
static int int4_order(int quant) {
    if (quant != 4) return 0;
#if defined(__x86_64__)
    if (dot_q4 == dot_q4_vnni512) return 2;
#endif
    return 1;
}

/* Threads used by later calls (the caller counts as one). Grows the pool; never shrinks it
 * (extra workers just sleep). */
int moe_set_threads(int n) {
    static int started = 1;
    pthread_mutex_lock(&pool.lock);
    for (; started < n; started++) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, NULL) != 0) break;
        pthread_detach(th);
    }
    pool.threads = n < started ? n : started;
    pthread_mutex_unlock(&pool.lock);
    return pool.threads;
}

const char *moe_isa(void) {
    choose_isa();
    return isa;
}

/* ---- one layer ------------------------------------------------------------------------- */
/* gpt-oss's experts: gate_up = W x + b (gate columns, then up), gate clamped above at limit, up
 * clamped to [-limit, limit], h = (up + 1) * gate * sigmoid(alpha * gate), down = W h + b. */
typedef struct {
    float alpha, limit;
    const float *const *gu_bias;        /* [n_exp] -> [2I] */
    const float *const *dn_bias;        /* [n_exp] -> [E] */
} act_params;

typedef struct {
    int64_t E, I, group, n_exp;
    int quant, quant_dn;                /* gate_up's and down's (a GGUF file may mix Q4_K and Q6_K) */
    const expert_ptrs *ex;
    const int64_t *start;               /* [n_exp + 1] into rows / weights */
    const int32_t *rows;                /* token row of each pair */
    const float *weights;
    const int8_t *xq;                   /* [T, E] */
    const float *xs;                    /* [T, E / QK] */
    const int32_t *xsum;                /* [T, E / QK] */
    float *h;                           /* [pairs, 2I] gate_up outputs, then act in [:, :I] */
    int8_t *hq;                         /* [pairs, I] */
    float *hs;                          /* [pairs, I / QK] */
    int32_t *hsum;                      /* [pairs, I / QK] */
    float *y;                           /* [pairs, E] down outputs */
    int64_t *task_expert, *task_row;    /* task -> (expert, first weight row) */
    int64_t chunk;                      /* weight rows a task */
    const act_params *act;              /* NULL: SwiGLU; else gpt-oss's biases and clamped gate */
} layer;

/* quant: 8 int8 (a scale per row), 4 int4 (fp16 per group), 9 Q8_0 (int8, fp16 per 32), and the
 * GGUF block types of kquants.h: 10 Q4_K, 11 Q5_K, 12 Q6_K, 13 IQ4_XS, 14 MXFP4 (no separate scales) */
static dot_fn dot_for(int quant) {
    switch (quant) {
    case 8: return dot_q8;
    case 9: return dot_q8g;
    case 10: return dot_q4k;
    case 11: return dot_q5k;
    case 12: return dot_q6k;
    case 13: return dot_iq4xs;
    case 14: return dot_mxfp4;
    default: return dot_q4;
    }
}

static size_t row_bytes(int quant, int64_t cols) {
    if (quant >= 10) return block_row_bytes(quant, cols);
    return quant == 4 ? (size_t)cols / 2 : (size_t)cols;
}

/* whether the kernel takes `quant` for rows of `cols` inputs */
static int takes(int quant, int64_t cols, int64_t group) {
    if (cols % QK) return 0;
    if (quant == 4) return group % QK == 0;
    if (quant == 9) return group == QK;
    if (quant >= 10 && quant <= 13) return cols % QK_K == 0;
    if (quant == 14) return 1;                                                   /* MXFP4: blocks of 32 */
    return quant == 8;
}

static int64_t task_rows(int64_t rows) {
    const int64_t want = (rows + pool.threads * TASKS_PER_THREAD - 1) / (pool.threads * TASKS_PER_THREAD);
    return want <= ROWS_PER_TASK ? ROWS_PER_TASK : (want + ROWS_PER_TASK - 1) / ROWS_PER_TASK * ROWS_PER_TASK;
}

static const void *scale_of(int quant, const void *scales, int64_t row, int64_t cols, int64_t group) {
    if (quant >= 10) return NULL;                                                  /* inside the blocks */
    return quant == 8 ? (const void *)((const float *)scales + row)
                      : (const void *)((const uint16_t *)scales + row * (cols / group));   /* 4, and 9 (group 32) */
}

static void gate_up_task(void *ctx, int64_t task) {
    const layer *L = ctx;
    const int64_t e = L->task_expert[task], r0 = L->task_row[task], r1 = r0 + L->chunk;
    const expert_ptrs *x = &L->ex[e];
    const dot_fn dot = dot_for(L->quant);
    for (int64_t r = r0; r < r1 && r < 2 * L->I; r++) {
        const void *w = (const char *)x->gu + r * row_bytes(L->quant, L->E);
        const void *ws = scale_of(L->quant, x->gu_scale, r, L->E, L->group);
        const float b = L->act ? L->act->gu_bias[e][r] : 0.0f;
        for (int64_t p = L->start[e]; p < L->start[e + 1]; p++) {
            const int64_t t = L->rows[p];
            L->h[p * 2 * L->I + r] = b + dot(w, ws, L->xq + t * L->E, L->xs + t * (L->E / QK),
                                             L->xsum + t * (L->E / QK), L->E, L->group);
        }
    }
}

static void act_task(void *ctx, int64_t p) {
    const layer *L = ctx;
    float *g = L->h + p * 2 * L->I, *u = g + L->I;
    if (L->act) {
        const float a = L->act->alpha, lim = L->act->limit;
        for (int64_t i = 0; i < L->I; i++) {
            const float gi = g[i] < lim ? g[i] : lim, ui = u[i] < -lim ? -lim : (u[i] > lim ? lim : u[i]);
            g[i] = (ui + 1.0f) * gi / (1.0f + expf(-a * gi));
        }
    } else {
        for (int64_t i = 0; i < L->I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    quantize_row(g, L->I, L->hq + p * L->I, L->hs + p * (L->I / QK), L->hsum + p * (L->I / QK), int4_order(L->quant_dn));
}

static void down_task(void *ctx, int64_t task) {
    const layer *L = ctx;
    const int64_t e = L->task_expert[task], r0 = L->task_row[task], r1 = r0 + L->chunk;
    const expert_ptrs *x = &L->ex[e];
    const dot_fn dot = dot_for(L->quant_dn);
    for (int64_t r = r0; r < r1 && r < L->E; r++) {
        const void *w = (const char *)x->dn + r * row_bytes(L->quant_dn, L->I);
        const void *ws = scale_of(L->quant_dn, x->dn_scale, r, L->I, L->group);
        const float b = L->act ? L->act->dn_bias[e][r] : 0.0f;
        for (int64_t p = L->start[e]; p < L->start[e + 1]; p++)
            L->y[p * L->E + r] = b + dot(w, ws, L->hq + p * L->I, L->hs + p * (L->I / QK),
                                         L->hsum + p * (L->I / QK), L->I, L->group);
    }
}

static int64_t plan_tasks(layer *L, int64_t rows) {
    L->chunk = task_rows(rows * L->n_exp);
    const int64_t per = (rows + L->chunk - 1) / L->chunk;
    int64_t n = 0;
    for (int64_t e = 0; e < L->n_exp; e++)
        for (int64_t k = 0; k < per; k++) L->task_expert[n] = e, L->task_row[n++] = k * L->chunk;
    return n;
}

/* Returns 0, or -1 when the shapes are not supported (the caller uses its portable path).
 * quant: gate_up's code, and down's in bits 8-15 when it differs. act: NULL for SwiGLU experts,
 * else gpt-oss's (moe_layer_act). */
static int run_layer(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
                     const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
                     float *out, const act_params *act) {
    const int q_gu = quant & 0xff, q_dn = (quant >> 8) ? (quant >> 8) : q_gu;
    if (!takes(q_gu, E, group) || !takes(q_dn, I, group)) return -1;
    choose_isa();
    const int64_t pairs = start[n_exp], most_rows = 2 * I > E ? 2 * I : E;
    layer L = {E, I, group, n_exp, q_gu, q_dn, ex, start, rows, weights};
    L.act = act;
    L.xq = malloc(T * E), L.xs = malloc(sizeof(float) * T * (E / QK)), L.xsum = malloc(4 * T * (E / QK));
    L.h = malloc(sizeof(float) * pairs * 2 * I), L.hq = malloc(pairs * I);
    L.hs = malloc(sizeof(float) * pairs * (I / QK)), L.y = malloc(sizeof(float) * pairs * E);
    L.hsum = malloc(4 * pairs * (I / QK));
    const int64_t max_tasks = n_exp * ((most_rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
    L.task_expert = malloc(sizeof(int64_t) * max_tasks), L.task_row = malloc(sizeof(int64_t) * max_tasks);
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * E, E, (int8_t *)L.xq + t * E, (float *)L.xs + t * (E / QK),
                     (int32_t *)L.xsum + t * (E / QK), int4_order(q_gu));
    parallel(gate_up_task, &L, plan_tasks(&L, 2 * I));
    parallel(act_task, &L, pairs);
    parallel(down_task, &L, plan_tasks(&L, E));
    for (int64_t p = 0; p < pairs; p++) {        /* fixed order: the caller's expert order */
        float *o = out + (int64_t)rows[p] * E;
        const float w = weights[p], *y = L.y + p * E;
        for (int64_t c = 0; c < E; c++) o[c] += w * y[c];
    }
    free((void *)L.xq), free((void *)L.xs), free((void *)L.xsum), free(L.h), free(L.hq), free(L.hs), free(L.hsum);
    free(L.y);
    free(L.task_expert), free(L.task_row);
    return 0;
}

int moe_layer(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
              const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
              float *out) {
    return run_layer(x, T, E, I, quant, group, n_exp, ex, start, rows, weights, out, NULL);
}

/* moe_layer for gpt-oss's experts: biases per expert (gu_bias[i], dn_bias[i] for the i-th
 * expert of this call), and the clamped, alpha-scaled gate. */
int moe_layer_act(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
                  const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
                  float *out, float alpha, float limit, const float *const *gu_bias, const float *const *dn_bias) {
    const act_params act = {alpha, limit, gu_bias, dn_bias};
    return run_layer(x, T, E, I, quant, group, n_exp, ex, start, rows, weights, out, &act);
}

/* ---- one quantised matrix: y [T, R] = x [T, C] W^T, rows split over the pool ------------- */
typedef struct {
    const void *w, *scales;
    int quant;
    int64_t T, R, C, group;
    const int8_t *xq;
    const float *xs;
    const int32_t *xsum;
    float *y;
    int64_t chunk;
} linear;

static void linear_task(void *ctx, int64_t task) {
    const linear *L = ctx;
    const dot_fn dot = dot_for(L->quant);
    for (int64_t r = task * L->chunk; r < (task + 1) * L->chunk && r < L->R; r++) {
        const void *w = (const char *)L->w + r * row_bytes(L->quant, L->C);
        const void *ws = scale_of(L->quant, L->scales, r, L->C, L->group);
        for (int64_t t = 0; t < L->T; t++)
            L->y[t * L->R + r] = dot(w, ws, L->xq + t * L->C, L->xs + t * (L->C / QK), L->xsum + t * (L->C / QK),
                                     L->C, L->group);
    }
}

int moe_linear(const float *x, int64_t T, int64_t C, int64_t R, int quant, int64_t group, const void *w,
               const void *scales, float *y) {
    if (C % QK || (quant == 4 && group % QK) || (quant == 9 && group != QK) ||
        (quant != 4 && quant != 8 && quant != 9)) return -1;
    choose_isa();
    int8_t *xq = malloc(T * C);
    float *xs = malloc(sizeof(float) * T * (C / QK));
    int32_t *xsum = malloc(4 * T * (C / QK));
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * C, C, xq + t * C, xs + t * (C / QK), xsum + t * (C / QK), int4_order(quant));
    linear L = {w, scales, quant, T, R, C, group, xq, xs, xsum, y, task_rows(R)};
    parallel(linear_task, &L, (R + L.chunk - 1) / L.chunk);
    free(xq), free(xs), free(xsum);
    return 0;
}
