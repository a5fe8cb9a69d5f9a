/* GGUF Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 rows against up to KQ_TOKENS tokens at once (included by
 * moe.c after panels.h, whose tile_row it shares; the block layouts: kquants.h; Q4_K's whole
 * panels of eight rows go through kpanels.h instead).
 *
 * A row's super-block is unpacked once for every token of the tile: its codes, its scales and
 * mins. Each token's integer dots of a super-block are then summed across lanes into one vector
 * (lane j: sub-block j, or for Q6_K lane j the first and lane 4 + j the second 16 weights of
 * block j of a half) by horizontal adds, and scaled by one multiply-add. A row at a time, every
 * sub-block's dot was converted, permuted to its scale and multiplied apart, for each token.
 *
 * The integer sums are exact and the float operations on them are the same, in the same order,
 * for every token of every tile: a token's output does not depend on how many tokens share its
 * tile, nor on the instruction set (AVX2's maddubs and VNNI's dpbusd add the same integers).
 *
 * IQ4_XS's and MXFP4's table values are signed: their magnitudes meet the activations with the
 * weights' signs (SIGNED_DOT). Q6_K's codes c (0-63) meet them as they are, and 32 times each 16
 * activations' sum (tile_row's mid) is taken off each sub-block's sum: the integers of (c - 32) x,
 * without the sign operations (in the cache, one thread: 77 -> 66 ns a row of 2,048 for one token,
 * 49 -> 40 a token for four; four tokens' layer call from memory, one thread: 3.2-3.6 -> 2.7-2.9 ms;
 * bench/results/kernel-lead-round39-avx512.txt).
 */
#if defined(__x86_64__)
#define KQ_TOKENS 4              /* tokens a tile */

/* one row (w) against the tile's tokens: a[t].y[r] = the dot with token t */
typedef void (*krow_fn)(const uint8_t *w, int64_t n, const tile_row *a, int64_t r);

/* e = hadd(hadd(s0, s1), hadd(s2, s3)), f the same of s4..s7 -> lane j: all of s_j's lanes */
#define EIGHT_SUMS(e, f) \
    _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20), _mm256_permute2x128_si256(e, f, 0x31))

/* the tile's NT accumulators, a token each */
#define ZEROED(acc, NT) __m256 acc[NT]; for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps()

/* signed weights v against activations x: |v| (unsigned, as DOT32 wants) against x with v's sign */
#define SIGNED_DOT(DOT32, v, x) DOT32(_mm256_sign_epi8((v), (v)), _mm256_sign_epi8((x), (v)))

/* Q4_K / Q5_K: w = d sc q - dmin m; a token's sub-block sums scaled by d sc s, less dmin m s (sum x) */
#define Q45K_TILE(NAME, TARGET, DOT32, FIFTH, NT)                                                 \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n, const tile_row *a, int64_t r) { \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                 \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16);                  \
            uint32_t sm[4];                                                                         \
            k4_unpack(blk + 4, sm);                                                                 \
            const __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm))), \
                                             _mm256_set1_ps(F16C(blk)));                            \
            const __m256 dmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 2)))), \
                                             _mm256_set1_ps(F16C(blk + 2)));                        \
            const __m256i qh = FIFTH ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : low;       \
            __m256i pair[NT][2], half[NT][2];                                                       \
            for (int j = 0; j < 8; j += 2) {                                                        \
                const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 16 * j));            \
                __m256i c0 = _mm256_and_si256(c, low), c1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), low); \
                if (FIFTH) {                                                                        \
                    const __m256i b0 = _mm256_set1_epi8((char)(1 << j)), b1 = _mm256_set1_epi8((char)(2 << j)); \
                    c0 = _mm256_or_si256(c0, FIFTH_BIT(qh, b0, sixteen));                           \
                    c1 = _mm256_or_si256(c1, FIFTH_BIT(qh, b1, sixteen));                           \
                }                                                                                   \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *x = a[t].q + (sb * 8 + j) * QK;                                   \
                    pair[t][j / 2 % 2] = _mm256_hadd_epi32(DOT32(c0, _mm256_loadu_si256((const __m256i *)x)), \
                                                           DOT32(c1, _mm256_loadu_si256((const __m256i *)(x + QK)))); \
                    if (j % 4) half[t][j / 4] = _mm256_hadd_epi32(pair[t][0], pair[t][1]);          \
                }                                                                                   \
            }                                                                                       \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256 xs = _mm256_loadu_ps(a[t].s + sb * 8);                                 \
                const __m256 sums = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a[t].sum + sb * 8))); \
                const __m256i s = EIGHT_SUMS(half[t][0], half[t][1]);                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dsc, xs), acc[t]);    \
                acc[t] = _mm256_fnmadd_ps(dmn, _mm256_mul_ps(xs, sums), acc[t]);                    \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) a[t].y[r] = hsum8(acc[t]);                                     \
    }

/* Q6_K: w = d sc (q - 32), a scale per 16 weights; per half super-block (four blocks of 32) a
 * token's sums of q x in lanes [b0 b1 b2 b3 first 16 | b0 b1 b2 b3 second 16], less its mids (32
 * times the same lanes' activation sums), scaled by d sc s. A decode step's rows, read one after
 * another from memory, ask for their bytes STREAM_LEAD (moe.c's) on: the hardware prefetcher alone
 * had left them at 8-13 GB/s on two threads, below Q4_K's panels (one token's layer call,
 * bench/results/kernel-lead-round39-avx512.txt). */
#define Q6K_TILE(NAME, TARGET, DOT32, NT)                                                         \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n, const tile_row *a, int64_t r) { \
        const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);                   \
        const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);                           \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 210;                                                      \
            read_ahead(blk, 210);                                                                   \
            const __m256 d = _mm256_set1_ps(F16C(blk + 208));                                       \
            for (int hf = 0; hf < 2; hf++) {                                                        \
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf));            \
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf + 32));       \
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));       \
                const __m256i c[4] = {                                                              \
                    _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)), \
                    _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)), \
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, top)), \
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),                \
                                    _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};               \
                const __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(    \
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * hf))), order)), d); \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *x = a[t].q + (sb * 8 + hf * 4) * QK;                              \
                    __m256i p[4];                                                                   \
                    for (int k = 0; k < 4; k++) p[k] = DOT32(c[k], _mm256_loadu_si256((const __m256i *)(x + k * QK))); \
                    const __m256i sums = _mm256_sub_epi32(                                          \
                        _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])), \
                        _mm256_loadu_si256((const __m256i *)(a[t].mid + sb * 16 + hf * 8)));        \
                    const __m256 xs = _mm256_broadcast_ps((const __m128 *)(a[t].s + sb * 8 + hf * 4)); \
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dsc, xs), acc[t]); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) a[t].y[r] = hsum8(acc[t]);                                     \
    }

/* IQ4_XS (KIND 13) and MXFP4 (14): 4-bit indices into a table of int8 values, a scale a block of
 * 32; eight blocks at a time (an IQ4_XS super-block; eight MXFP4 blocks, the last few of a row
 * one at a time). d: IQ4_XS's super-block scale. */
/* IQ4_XS's eight sub-block scales ls - 32 (6 bits: the low 4 in blk[4..7], the high 2 in blk[2..3]) times d */
__attribute__((target("avx2"))) static inline __m256 iq4_scales(const uint8_t *blk, float d) {
    uint32_t packed;
    memcpy(&packed, blk + 4, 4);
    const __m128i b = _mm_cvtsi32_si128((int)packed), nib = _mm_set1_epi8(15);
    const __m128i low4 = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    const __m256i high2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(blk[2] | (blk[3] << 8)),
                                                             _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(_mm256_cvtepu8_epi32(low4), _mm256_slli_epi32(high2, 4));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(d));
}

/* the scales of group g's eight blocks, and where their codes are */
__attribute__((target("avx2"))) static inline __m256 table_blocks(int kind, const uint8_t *w, int64_t g, float d,
                                                                   const uint8_t *codes[8]) {
    float ds[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t *blk = kind == 13 ? w + g * 136 : w + (g * 8 + j) * 17;
        codes[j] = kind == 13 ? blk + 8 + 16 * j : blk + 1;
        if (kind == 14) ds[j] = e8m0_half(blk[0]);
    }
    return kind == 13 ? iq4_scales(w + g * 136, d) : _mm256_loadu_ps(ds);
}
#define TABLE_VALUES(table, bytes) _mm256_shuffle_epi8((table), _mm256_and_si256(_mm256_set_m128i(   \
    _mm_srli_epi16((bytes), 4), (bytes)), _mm256_set1_epi8(15)))

#define TABLE_TILE(NAME, TARGET, DOT32, KIND, NT)                                                 \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n, const tile_row *a, int64_t r) { \
        const __m256i table = TABLE(KIND == 13 ? IQ4NL : MXFP4X2);                                 \
        const int64_t nb = n / QK, groups = nb / 8;                                                 \
        ZEROED(acc, NT);                                                                            \
        for (int64_t g = 0; g < groups; g++) {                                                      \
            const uint8_t *codes[8];                                                                \
            const __m256 dw = table_blocks(KIND, w, g, KIND == 13 ? F16C(w + g * 136) : 0.0f, codes);                                                    \
            __m256i pair[NT][2], half[NT][2];                                                       \
            for (int j = 0; j < 8; j += 2) {                                                        \
                const __m256i v0 = TABLE_VALUES(table, _mm_loadu_si128((const __m128i *)codes[j])); \
                const __m256i v1 = TABLE_VALUES(table, _mm_loadu_si128((const __m128i *)codes[j + 1])); \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *x = a[t].q + (g * 8 + j) * QK;                                    \
                    pair[t][j / 2 % 2] = _mm256_hadd_epi32(                                         \
                        SIGNED_DOT(DOT32, v0, _mm256_loadu_si256((const __m256i *)x)),              \
                        SIGNED_DOT(DOT32, v1, _mm256_loadu_si256((const __m256i *)(x + QK))));      \
                    if (j % 4) half[t][j / 4] = _mm256_hadd_epi32(pair[t][0], pair[t][1]);          \
                }                                                                                   \
            }                                                                                       \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256i s = EIGHT_SUMS(half[t][0], half[t][1]);                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_loadu_ps(a[t].s + g * 8)), acc[t]); \
            }                                                                                       \
        }                                                                                           \
        for (int64_t b = groups * 8; b < nb; b++) {              /* MXFP4 only: whole groups in IQ4_XS */ \
            const uint8_t *blk = w + b * 17;                                                        \
            const __m256i v = TABLE_VALUES(table, _mm_loadu_si128((const __m128i *)(blk + 1)));     \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256i s = SIGNED_DOT(DOT32, v, _mm256_loadu_si256((const __m256i *)(a[t].q + b * QK))); \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(e8m0_half(blk[0]) * a[t].s[b]), acc[t]); \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) a[t].y[r] = hsum8(acc[t]);                                     \
    }

#define KQ_TILES_OF(SHAPE, NAME, ISA, TARGET, DOT32, ...)                                          \
    SHAPE(NAME##1_##ISA, TARGET, DOT32, __VA_ARGS__ 1) SHAPE(NAME##2_##ISA, TARGET, DOT32, __VA_ARGS__ 2) \
    SHAPE(NAME##3_##ISA, TARGET, DOT32, __VA_ARGS__ 3) SHAPE(NAME##4_##ISA, TARGET, DOT32, __VA_ARGS__ 4)

/* per instruction set: the tiles of Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 (quant 10-14), by token count */
#define KQ_TILES(ISA, TARGET, DOT32)                                                               \
    KQ_TILES_OF(Q45K_TILE, q4k_tile, ISA, TARGET, DOT32, 0,)                                        \
    KQ_TILES_OF(Q45K_TILE, q5k_tile, ISA, TARGET, DOT32, 1,)                                        \
    KQ_TILES_OF(Q6K_TILE, q6k_tile, ISA, TARGET, DOT32,)                                            \
    KQ_TILES_OF(TABLE_TILE, iq4xs_tile, ISA, TARGET, DOT32, 13,)                                    \
    KQ_TILES_OF(TABLE_TILE, mxfp4_tile, ISA, TARGET, DOT32, 14,)                                    \
    static const krow_fn ktiles_##ISA[5][KQ_TOKENS + 1] = {                                        \
        {NULL, q4k_tile1_##ISA, q4k_tile2_##ISA, q4k_tile3_##ISA, q4k_tile4_##ISA},                \
        {NULL, q5k_tile1_##ISA, q5k_tile2_##ISA, q5k_tile3_##ISA, q5k_tile4_##ISA},                \
        {NULL, q6k_tile1_##ISA, q6k_tile2_##ISA, q6k_tile3_##ISA, q6k_tile4_##ISA},                \
        {NULL, iq4xs_tile1_##ISA, iq4xs_tile2_##ISA, iq4xs_tile3_##ISA, iq4xs_tile4_##ISA},        \
        {NULL, mxfp4_tile1_##ISA, mxfp4_tile2_##ISA, mxfp4_tile3_##ISA, mxfp4_tile4_##ISA}};
KQ_TILES(avx2, "avx2,fma,f16c", DOT_AVX2)
KQ_TILES(vnni256, AVX512, DOT_VNNI256)
#ifdef HAVE_AVXVNNI
KQ_TILES(avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI)
#endif
static const krow_fn (*ktiles)[KQ_TOKENS + 1];      /* choose_isa's; NULL: the portable rows */

#endif
