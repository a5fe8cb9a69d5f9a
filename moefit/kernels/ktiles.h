/* GGUF Q4_K, Q5_K and Q6_K rows against up to KQ_TOKENS tokens at once (included by moe.c after
 * panels.h, whose tile_row it shares; the block layouts: kquants.h).
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
 * Q6_K's codes are signed (c - 32): the activations are made unsigned instead (x + 128, one xor)
 * and 128 times the weights' sum over each 16 is taken off; that sum is the row's, shared by
 * the tile's tokens.
 */
#if defined(__x86_64__)
#define KQ_TOKENS 4              /* tokens a tile */

/* one row (w) against the tile's tokens: a[t].y[r] = the dot with token t */
typedef void (*krow_fn)(const uint8_t *w, int64_t n, const tile_row *a, int64_t r);

/* e = hadd(hadd(s0, s1), hadd(s2, s3)), f the same of s4..s7 -> lane j: all of s_j's lanes */
#define EIGHT_SUMS(e, f) \
    _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20), _mm256_permute2x128_si256(e, f, 0x31))

/* Q4_K / Q5_K: w = d sc q - dmin m; a token's sub-block sums scaled by d sc s, less dmin m s (sum x) */
#define Q45K_TILE(NAME, TARGET, DOT32, FIFTH, NT)                                                 \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n, const tile_row *a, int64_t r) { \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                 \
        __m256 acc[NT];                                                                             \
        for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                  \
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
 * token's sums in lanes [b0 b1 b2 b3 first 16 | b0 b1 b2 b3 second 16], scaled by d sc s */
#define Q6K_TILE(NAME, TARGET, DOT32, NT)                                                         \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n, const tile_row *a, int64_t r) { \
        const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), mid = _mm256_set1_epi8(32); \
        const __m256i flip = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi8(1);             \
        const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);                           \
        __m256 acc[NT];                                                                             \
        for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                  \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 210;                                                      \
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
                const __m256i s0 = _mm256_sub_epi8(c[0], mid), s1 = _mm256_sub_epi8(c[1], mid);     \
                const __m256i s2 = _mm256_sub_epi8(c[2], mid), s3 = _mm256_sub_epi8(c[3], mid);     \
                const __m256i wsum = _mm256_slli_epi32(_mm256_hadd_epi32(                           \
                    _mm256_hadd_epi32(DOT32(one, s0), DOT32(one, s1)), _mm256_hadd_epi32(DOT32(one, s2), DOT32(one, s3))), 7); \
                const __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(    \
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * hf))), order)), d); \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *x = a[t].q + (sb * 8 + hf * 4) * QK;                              \
                    __m256i u[4];                                                                   \
                    for (int k = 0; k < 4; k++)                                                     \
                        u[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + k * QK)), flip); \
                    const __m256i s = _mm256_sub_epi32(_mm256_hadd_epi32(                           \
                        _mm256_hadd_epi32(DOT32(u[0], s0), DOT32(u[1], s1)), _mm256_hadd_epi32(DOT32(u[2], s2), DOT32(u[3], s3))), wsum); \
                    const __m256 xs = _mm256_broadcast_ps((const __m128 *)(a[t].s + sb * 8 + hf * 4)); \
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dsc, xs), acc[t]); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) a[t].y[r] = hsum8(acc[t]);                                     \
    }

#define KQ_TILES_OF(SHAPE, NAME, ISA, TARGET, DOT32, ...)                                          \
    SHAPE(NAME##1_##ISA, TARGET, DOT32, __VA_ARGS__ 1) SHAPE(NAME##2_##ISA, TARGET, DOT32, __VA_ARGS__ 2) \
    SHAPE(NAME##3_##ISA, TARGET, DOT32, __VA_ARGS__ 3) SHAPE(NAME##4_##ISA, TARGET, DOT32, __VA_ARGS__ 4)

/* per instruction set: the tiles of Q4_K, Q5_K and Q6_K (quant 10, 11, 12), by token count */
#define KQ_TILES(ISA, TARGET, DOT32)                                                               \
    KQ_TILES_OF(Q45K_TILE, q4k_tile, ISA, TARGET, DOT32, 0,)                                        \
    KQ_TILES_OF(Q45K_TILE, q5k_tile, ISA, TARGET, DOT32, 1,)                                        \
    KQ_TILES_OF(Q6K_TILE, q6k_tile, ISA, TARGET, DOT32,)                                            \
    static const krow_fn ktiles_##ISA[3][KQ_TOKENS + 1] = {                                        \
        {NULL, q4k_tile1_##ISA, q4k_tile2_##ISA, q4k_tile3_##ISA, q4k_tile4_##ISA},                \
        {NULL, q5k_tile1_##ISA, q5k_tile2_##ISA, q5k_tile3_##ISA, q5k_tile4_##ISA},                \
        {NULL, q6k_tile1_##ISA, q6k_tile2_##ISA, q6k_tile3_##ISA, q6k_tile4_##ISA}};
KQ_TILES(avx2, "avx2,fma,f16c", DOT_AVX2)
KQ_TILES(vnni256, AVX512, DOT_VNNI256)
#ifdef HAVE_AVXVNNI
KQ_TILES(avxvnni, "avx2,fma,f16c,avxvnni", DOT_AVXVNNI)
#endif
static const krow_fn (*ktiles)[KQ_TOKENS + 1];      /* choose_isa's; NULL: the portable rows */

/* Rows [r0, r1) of a Q4_K, Q5_K or Q6_K matrix against every activation row of A, KQ_TOKENS
 * tokens a tile; KQ_ROWS rows (a few KiB each) at a time, read again from the cache by each tile. */
#define KQ_ROWS 16
static void kquant_rows(int quant, const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const size_t bytes = block_row_bytes(quant, cols);
    const int64_t nb = cols / QK;
    for (int64_t first = r0; first < r1; first += KQ_ROWS) {
        const int64_t last = first + KQ_ROWS < r1 ? first + KQ_ROWS : r1;
        for (int64_t i = 0; i < A->n; i += KQ_TOKENS) {
            const int nt = A->n - i < KQ_TOKENS ? (int)(A->n - i) : KQ_TOKENS;
            tile_row a[KQ_TOKENS];
            for (int j = 0; j < nt; j++) {
                const int64_t row = A->row ? A->row[i + j] : i + j;
                a[j] = (tile_row){A->q + row * cols, A->s + row * nb, A->sum + row * nb, A->y + (i + j) * A->y_stride};
            }
            const krow_fn tile = ktiles[quant - 10][nt];
            for (int64_t r = first; r < last; r++) tile(w + r * bytes, cols, a, r);
        }
    }
}
#endif
