/* A prompt chunk's GGUF experts (included by moe.c after kpanels.h, whose panels it decodes once a
 * call), and kquant_rows, which sends a K-quant matrix's rows to the panels, the decoded panels or
 * ktiles.h's tiles.
 *
 * A call of more than one tile (a prompt chunk's experts): each panel of eight rows of any GGUF
 * block type is decoded once into the calling thread's buffer (every block of 32's eight code
 * vectors, transposed and unpacked, or looked up, as the panels above make them per tile; the eight
 * rows' scales, and Q4_K's / Q5_K's mins), and each tile reads them there. The integer sums and the
 * float operations on them are the panels', in their order: a row's outputs do not depend on the
 * call's token count. A layer call of 16 and 64 tokens, two alternated pairs each against the tiles
 * (bench/results/kernel-decoded-panels-round26-avx512.txt, an AVX512 EPYC, 2 threads): Q4_K 1.02-1.41x,
 * Q5_K 1.05-1.22x, IQ4_XS 0.90-1.31x, MXFP4 (gpt-oss's shape) 1.14-1.43x.
 *
 * Q6_K has no panel of its own (its rows go through ktiles.h's tile in calls of up to KQ_TOKENS
 * tokens), so its decoded panel gives the tile's bits: eight accumulators a token, one per lane of
 * the tile's (sub-block j of a half super-block: block j % 4, its 16 weights j / 4), each taking
 * the tile's fused multiply-add per half super-block, summed at the end in hsum8's order.
 */
#if defined(__x86_64__)

/* one block of 32 of eight rows (16 code bytes at codes, row_bytes apart) -> its eight looked-up
 * vectors at out: quad k's low values at out[k], its high ones at out[4 + k] */
#define TABLE_DECODE_BLOCK(table, codes, row_bytes, out)                                            \
    do {                                                                                            \
        __m256i v_[4];                                                                              \
        block_quads(codes, row_bytes, v_);                                                          \
        for (int k = 0; k < 4; k++) {                                                               \
            __m256i lo, hi;                                                                         \
            TABLE_LOOKUP(table, v_[k], lo, hi);                                                     \
            _mm256_store_si256(out + k, lo), _mm256_store_si256(out + 4 + k, hi);                   \
        }                                                                                           \
    } while (0)

#define IQ4_DECODE(NAME, TARGET, OFFSET)                                                            \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const __m256i table = _mm256_xor_si256(TABLE(IQ4NL), _mm256_set1_epi8(OFFSET ? (char)0x80 : 0)); \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 136;                                                      \
            panel_prefetch(w, row_bytes, sb, 136);                                                  \
            iq4_panel_scales(blk, row_bytes, scales + sb * 16);                                     \
            for (int j = 0; j < 8; j++) TABLE_DECODE_BLOCK(table, blk + 8 + 16 * j, row_bytes, vals + (sb * 8 + j) * 8); \
        }                                                                                           \
    }

/* eight MXFP4 rows decoded: MXFP4_PANEL's looked-up vectors, a block's eight 2^(e - 128) */
#define MX_DECODE(NAME, TARGET, OFFSET)                                                             \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const __m256i table = _mm256_add_epi8(TABLE(MXFP4X2), _mm256_set1_epi8((char)(OFFSET)));     \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            const uint8_t *blk = w + b * 17;                                                        \
            if (b % 8 == 0) panel_prefetch(w, row_bytes, b / 8, 136);                               \
            scales[b] = mx_panel_scales(blk, row_bytes);                                            \
            TABLE_DECODE_BLOCK(table, blk + 1, row_bytes, vals + b * 8);                            \
        }                                                                                           \
    }

/* a decoded IQ4_XS or MXFP4 panel against NT tokens: IQ4_PANEL's (MXFP4_PANEL's) sums and scaling on
 * the decoded vectors; SCALE(b): block b's scales in the buffer */
#define IQ4_SCALE(b) (b / 8 * 16 + b % 8)
#define MX_SCALE(b) (b)
#define TABLE_DECODED_PANEL(NAME, TARGET, ADD, OFFSET, SCALE, NT)                                   \
    __attribute__((target(TARGET))) static void NAME(const __m256i *vals, const __m256 *scales, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        ZEROED(acc, NT);                                                                            \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            __m256i s[NT][2];                                                                       \
            for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();                \
            for (int k = 0; k < 4; k++) {                                                           \
                const __m256i lo = _mm256_load_si256(vals + b * 8 + k), hi = _mm256_load_si256(vals + b * 8 + 4 + k); \
                TABLE_QUAD(ADD, NT, s, lo, hi, a, b, k)                                             \
            }                                                                                       \
            TABLE_SCALE(NT, acc, s, scales[SCALE(b)], a, b, OFFSET)                                 \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* eight Q4_K (FIFTH: Q5_K) rows decoded: per sub-block pair (j, j + 1) and half h, Q45K_PANEL's four
 * lo (sub-block j) and four hi (j + 1) vectors, its fifth bits in; per super-block the eight d sc,
 * then the eight dmin m */
#define Q45K_DECODE(NAME, TARGET, FIFTH)                                                            \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16);                  \
            panel_prefetch(w, row_bytes, sb, bytes);                                                \
            q4k_panel_scales(blk, row_bytes, scales + sb * 16, scales + sb * 16 + 8);               \
            __m256i qh[2][4];                                                                       \
            if (FIFTH) block_quads(blk + 16, row_bytes, qh[0]), block_quads(blk + 32, row_bytes, qh[1]); \
            for (int j = 0; j < 8; j += 2)                                                          \
                for (int h = 0; h < 2; h++) {                                                       \
                    __m256i v[4], *out = vals + sb * 64 + j * 8 + h * 8;                            \
                    block_quads(codes + 16 * j + 16 * h, row_bytes, v);                             \
                    for (int k = 0; k < 4; k++) {                                                   \
                        __m256i lo, hi;                                                             \
                        Q45K_UNPACK(FIFTH, v[k], qh[h][k], j, lo, hi);                              \
                        _mm256_store_si256(out + k, lo), _mm256_store_si256(out + 4 + k, hi);       \
                    }                                                                               \
                }                                                                                   \
        }                                                                                           \
    }

/* sub-blocks j, j + 1 of super-block sb, decoded at v (per half h: four lo, four hi), against NT tokens */
#define Q45K_DECODED_HALF(ADD, NT, HALVES, s, v, sb, j, h)                                          \
    for (int k = 0; k < 4; k++) {                                                                   \
        const __m256i lo = _mm256_load_si256((v) + h * 8 + k), hi = _mm256_load_si256((v) + h * 8 + 4 + k); \
        Q45K_QUAD(ADD, NT, HALVES, s, lo, hi, sb, j, h, k)                                          \
    }
#define Q45K_DECODED_QUADS(ADD, NT, HALVES, s, v, sb, j)                                            \
    Q45K_HALVES_LOOP(HALVES, h, Q45K_DECODED_HALF(ADD, NT, HALVES, s, v, sb, j, h))

/* a decoded Q4_K / Q5_K panel against NT tokens: Q45K_PANEL's sums and scaling on Q45K_DECODE's vectors */
#define Q45K_DECODED_PANEL(NAME, TARGET, ADD, FINISH, HALVES, NT)                                   \
    __attribute__((target(TARGET))) static void NAME(const __m256i *vals, const __m256 *scales, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const __m256 *dsc = scales + sb * 16, *dmn = dsc + 8;                                   \
            for (int j = 0; j < 8; j += 2) {                                                        \
                __m256i s[NT][2 * (HALVES)];                       /* Q45K_QUAD's chains */         \
                for (int t = 0; t < NT; t++)                                                        \
                    for (int i = 0; i < 2 * (HALVES); i++) s[t][i] = _mm256_setzero_si256();        \
                Q45K_DECODED_QUADS(ADD, NT, HALVES, s, vals + sb * 64 + j * 8, sb, j);              \
                Q45K_PAIR_SCALE(FINISH, NT, HALVES, acc, s, dsc, dmn, sb, j)                        \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* eight Q6_K rows' super-block scales -> d sc_i for each of its 16 scales, a lane a row (Q6K_TILE's dsc) */
__attribute__((target("avx2,fma,f16c"))) static inline void q6k_panel_scales(const uint8_t *blk, int64_t row_bytes,
                                                                            __m256 dsc[16]) {
    __m256i sc[4];                                     /* scales 4k..4k+3, a lane a row */
    block_quads(blk + 192, row_bytes, sc);
    uint16_t dh[8];
    for (int r = 0; r < 8; r++) memcpy(dh + r, blk + r * row_bytes + 208, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
    for (int i = 0; i < 16; i++) {                     /* byte i % 4 of the lane, sign-extended */
        const __m256i s = _mm256_srai_epi32(_mm256_sll_epi32(sc[i / 4], _mm_cvtsi32_si128(24 - 8 * (i % 4))), 24);
        dsc[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(s), d);
    }
}

/* eight Q6_K rows decoded: block b's codes less 32 at vals + 8 b (its sub-block h in quads 4h..4h+3,
 * a lane a row); per super-block its 16 d sc (scale i: half i / 8, block i / 2 % 4 of it, sub-block
 * i % 2), then each sub-block's 128 sum(q - 32): what the activations' offset adds to its sums (the
 * tiles read them as x + 128, unsigned as dpbusd and maddubs want; offset_acts) */
#define Q6K_DECODE(NAME, TARGET, ADD, FINISH)                                                       \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), mid = _mm256_set1_epi8(32); \
        const __m256i ones = _mm256_set1_epi8(1);                                                   \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 210;                                                      \
            panel_prefetch(w, row_bytes, sb, 210);                                                  \
            q6k_panel_scales(blk, row_bytes, scales + sb * 32);                                     \
            __m256i *offset = (__m256i *)(scales + sb * 32 + 16);                                   \
            for (int hf = 0; hf < 2; hf++)                                                          \
                for (int h = 0; h < 2; h++) {                                                       \
                    __m256i l0[4], l1[4], qh[4], sum[4][2];                                         \
                    block_quads(blk + 64 * hf + 16 * h, row_bytes, l0);                             \
                    block_quads(blk + 64 * hf + 32 + 16 * h, row_bytes, l1);                        \
                    block_quads(blk + 128 + 32 * hf + 16 * h, row_bytes, qh);                       \
                    for (int m = 0; m < 4; m++) sum[m][0] = sum[m][1] = _mm256_setzero_si256();     \
                    for (int k = 0; k < 4; k++) {                      /* Q6K_TILE's c[0..3] */     \
                        const __m256i c[4] = {                                                      \
                            _mm256_or_si256(_mm256_and_si256(l0[k], low), _mm256_and_si256(_mm256_slli_epi16(qh[k], 4), top)), \
                            _mm256_or_si256(_mm256_and_si256(l1[k], low), _mm256_and_si256(_mm256_slli_epi16(qh[k], 2), top)), \
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0[k], 4), low), _mm256_and_si256(qh[k], top)), \
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1[k], 4), low),     \
                                            _mm256_and_si256(_mm256_srli_epi16(qh[k], 2), top))};   \
                        for (int m = 0; m < 4; m++) {                                               \
                            const __m256i s = _mm256_sub_epi8(c[m], mid);                           \
                            _mm256_store_si256(vals + (sb * 8 + 4 * hf + m) * 8 + 4 * h + k, s);    \
                            ADD(sum[m][k / 2], ones, s);                                            \
                        }                                                                           \
                    }                                                                               \
                    for (int m = 0; m < 4; m++)                                                     \
                        offset[8 * hf + 2 * m + h] = _mm256_slli_epi32(                             \
                            _mm256_add_epi32(FINISH(sum[m][0]), FINISH(sum[m][1])), 7);             \
                }                                                                                   \
        }                                                                                           \
    }

/* a decoded Q6_K panel against NT tokens (activations offset: offset_acts), Q6K_TILE's arithmetic
 * lane by lane: sub-block (m, h) of a half's sums (two chains of two quads: AVX2's int16 lanes hold
 * 2 * 2 * 255 * 32) less its offset, into accumulator m + 4h by d sc x_scale; hsum8's order at the end */
#define Q6K_DECODED_PANEL(NAME, TARGET, ADD, FINISH, NT)                                            \
    __attribute__((target(TARGET))) static void NAME(const __m256i *vals, const __m256 *scales, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        __m256 acc[NT][8];                                                                          \
        for (int t = 0; t < NT; t++)                                                                \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm256_setzero_ps();                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const __m256 *dsc = scales + sb * 32;                                                   \
            const __m256i *offset = (const __m256i *)(dsc + 16);                                    \
            for (int i = 0; i < 16; i++) {                     /* half i / 8, block m, sub-block h */ \
                const int m = i / 2 % 4, h = i % 2;                                                 \
                const int64_t b = sb * 8 + i / 8 * 4 + m;                                           \
                __m256i s[NT][2];                                                                   \
                for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();            \
                for (int k = 0; k < 4; k++) {                                                       \
                    const __m256i v = _mm256_load_si256(vals + b * 8 + 4 * h + k);                  \
                    for (int t = 0; t < NT; t++) ADD(s[t][k / 2], BROADCAST4(a[t].q + b * QK + 16 * h + 4 * k), v); \
                }                                                                                   \
                for (int t = 0; t < NT; t++) {                                                      \
                    const __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(FINISH(s[t][0]), FINISH(s[t][1])), offset[i]); \
                    acc[t][m + 4 * h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),                    \
                                                        _mm256_mul_ps(dsc[i], _mm256_set1_ps(a[t].s[b])), acc[t][m + 4 * h]); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) {                          /* hsum8: (a0 + a4 + (a2 + a6)) + (a1 + a5 + (a3 + a7)) */ \
            const __m256 *c = acc[t];                                                               \
            const __m256 even = _mm256_add_ps(_mm256_add_ps(c[0], c[4]), _mm256_add_ps(c[2], c[6]));  \
            const __m256 odd = _mm256_add_ps(_mm256_add_ps(c[1], c[5]), _mm256_add_ps(c[3], c[7]));   \
            _mm256_storeu_ps(a[t].y + r, _mm256_add_ps(even, odd));                                 \
        }                                                                                           \
    }

typedef void (*kdecode_fn)(const uint8_t *w, int64_t row_bytes, int64_t n, __m256i *vals, __m256 *scales);
typedef void (*kdecoded_fn)(const __m256i *vals, const __m256 *scales, int64_t n, const tile_row *a, int64_t r);
typedef struct {
    kdecode_fn decode;
    kdecoded_fn tiles[KQ_TOKENS + 1];
} kdecoded_set;
#define KD_SET(DECODE, TILE) {DECODE, {NULL, TILE##1, TILE##2, TILE##3, TILE##4}}
/* per instruction set: [0] Q4_K's decoded panels, [1] Q5_K's, [2] Q6_K's, [3] IQ4_XS's, [4] MXFP4's */
#define KD_TILES(ISA, TARGET, ADD, FINISH, HALVES, IQ4_ADD, OFFSET, MX_ADD, MX_OFFSET)             \
    Q45K_DECODE(q4k_decode_##ISA, TARGET, 0) Q45K_DECODE(q5k_decode_##ISA, TARGET, 1)               \
    Q6K_DECODE(q6k_decode_##ISA, TARGET, ADD, FINISH)                                               \
    Q6K_DECODED_PANEL(q6k_decoded_##ISA##1, TARGET, ADD, FINISH, 1)                                 \
    Q6K_DECODED_PANEL(q6k_decoded_##ISA##2, TARGET, ADD, FINISH, 2)                                 \
    Q6K_DECODED_PANEL(q6k_decoded_##ISA##3, TARGET, ADD, FINISH, 3)                                 \
    Q6K_DECODED_PANEL(q6k_decoded_##ISA##4, TARGET, ADD, FINISH, 4)                                 \
    IQ4_DECODE(iq4_decode_##ISA, TARGET, OFFSET)                                                    \
    Q45K_DECODED_PANEL(q4k_decoded_##ISA##1, TARGET, ADD, FINISH, HALVES(0, 1), 1)                  \
    Q45K_DECODED_PANEL(q4k_decoded_##ISA##2, TARGET, ADD, FINISH, HALVES(0, 2), 2)                  \
    Q45K_DECODED_PANEL(q4k_decoded_##ISA##3, TARGET, ADD, FINISH, HALVES(0, 3), 3)                  \
    Q45K_DECODED_PANEL(q4k_decoded_##ISA##4, TARGET, ADD, FINISH, HALVES(0, 4), 4)                  \
    Q45K_DECODED_PANEL(q5k_decoded_##ISA##1, TARGET, ADD, FINISH, HALVES(1, 1), 1)                  \
    Q45K_DECODED_PANEL(q5k_decoded_##ISA##2, TARGET, ADD, FINISH, HALVES(1, 2), 2)                  \
    Q45K_DECODED_PANEL(q5k_decoded_##ISA##3, TARGET, ADD, FINISH, HALVES(1, 3), 3)                  \
    Q45K_DECODED_PANEL(q5k_decoded_##ISA##4, TARGET, ADD, FINISH, HALVES(1, 4), 4)                  \
    MX_DECODE(mx_decode_##ISA, TARGET, MX_OFFSET)                                                   \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##1, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 1)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##2, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 2)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##3, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 3)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##4, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 4)                \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##1, TARGET, MX_ADD, MX_OFFSET, MX_SCALE, 1)                \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##2, TARGET, MX_ADD, MX_OFFSET, MX_SCALE, 2)                \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##3, TARGET, MX_ADD, MX_OFFSET, MX_SCALE, 3)                \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##4, TARGET, MX_ADD, MX_OFFSET, MX_SCALE, 4)                \
    static const kdecoded_set kdecoded_##ISA[5] = {KD_SET(q4k_decode_##ISA, q4k_decoded_##ISA),   \
                                                   KD_SET(q5k_decode_##ISA, q5k_decoded_##ISA),   \
                                                   KD_SET(q6k_decode_##ISA, q6k_decoded_##ISA),    \
                                                   KD_SET(iq4_decode_##ISA, iq4_decoded_##ISA),    \
                                                   KD_SET(mx_decode_##ISA, mx_decoded_##ISA)};
KD_TILES(avx2, "avx2,fma,f16c", KP_ADD_AVX2, KP_FINISH_AVX2, Q45K_HALVES_AVX2, IQ4_ADD_AVX2, 0, MX_ADD_AVX2, MX_OFFSET_AVX2)
KD_TILES(vnni256, AVX512, KP_ADD_VNNI256, KP_FINISH_VNNI, Q45K_HALVES_VNNI, IQ4_ADD_VNNI256, 128, IQ4_ADD_VNNI256, 128)
#ifdef HAVE_AVXVNNI
KD_TILES(avxvnni, "avx2,fma,f16c,avxvnni", KP_ADD_AVXVNNI, KP_FINISH_VNNI, Q45K_HALVES_VNNI, IQ4_ADD_AVXVNNI, 128,
         IQ4_ADD_AVXVNNI, 128)
#endif
static const kdecoded_set *kdecoded;                 /* choose_isa's, with ktiles */

/* Q6_K's decoded panels read each activation as x + 128 (unsigned: their codes are the signed
 * operand, and the offset's sum is taken off a sub-block's sums once): A's rows copied so, in token
 * order, into the thread's second buffer (their scales and sums beside them); NULL without one. */
static const act_rows *offset_acts(const act_rows *A, int64_t cols, act_rows *out) {
    const int64_t nb = cols / QK;
    uint8_t *buf = thread_buffer(1, A->n * (cols + 8 * nb));
    if (!buf) return NULL;
    int8_t *q = (int8_t *)buf;
    float *s = (float *)(buf + A->n * cols);
    int32_t *sum = (int32_t *)(s + A->n * nb);
    for (int64_t i = 0; i < A->n; i++) {
        const int64_t row = A->row ? A->row[i] : i;
        const int8_t *x = A->q + row * cols;
        for (int64_t c = 0; c < cols; c++) q[i * cols + c] = (int8_t)(x[c] ^ 0x80);
        memcpy(s + i * nb, A->s + row * nb, sizeof(float) * nb);
        memcpy(sum + i * nb, A->sum + row * nb, sizeof(int32_t) * nb);
    }
    *out = (act_rows){q, s, sum, NULL, A->y, A->y_stride, A->n};
    return out;
}

/* Rows [r0, r1) of a GGUF block type's matrix against a call of more than one tile, whole panels
 * decoded once each (above); returns the first row left (fewer than eight remain, or no buffer). */
static int64_t decoded_rows(int quant, const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const kdecoded_set *set = &kdecoded[quant - 10];
    const int64_t nb = cols / QK, bytes = (int64_t)block_row_bytes(quant, cols);
    __m256i *vals = (__m256i *)panel_buffer(nb * 8 * 32 + nb * 4 * 32);
    act_rows offset;
    if (!vals || (quant == 12 && !(A = offset_acts(A, cols, &offset)))) return r0;
    __m256 *scales = (__m256 *)(vals + nb * 8);
    for (; r0 + 8 <= r1; r0 += 8) {
        set->decode(w + r0 * bytes, bytes, cols, vals, scales);
        for (int64_t i = 0; i < A->n; i += KQ_TOKENS) {
            tile_row a[KQ_TOKENS];
            const int nt = tile_of(A, i, KQ_TOKENS, cols, 0, a);
            set->tiles[nt](vals, scales, cols, a, r0);
        }
    }
    return r0;
}

#define KQ_ROWS 16

/* a tile's token: 32 times the sum of each 16 of its activations, in Q6K_TILE's lane order (lane
 * m + 4h of half super-block j: the h-th 16 of block 4j + m) at mid + 8j */
static void q6k_mids(const tile_row *a, int64_t cols, int32_t *mid) {
    for (int64_t j = 0; j < cols / (QK * 4); j++)
        for (int lane = 0; lane < 8; lane++) {
            const int8_t *x = a->q + (4 * j + lane % 4) * QK + 16 * (lane / 4);
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += x[i];
            mid[8 * j + lane] = 32 * s;
        }
}

/* Q6_K's rows [r0, r1) through its tiles, a tile of tokens at a time (a call of one tile, or a
 * panel's remainder), its tokens' mids first */
static void q6k_tile_rows(const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const size_t bytes = block_row_bytes(12, cols);
    for (int64_t i = 0; r0 < r1 && i < A->n; i += KQ_TOKENS) {
        tile_row a[KQ_TOKENS];
        int32_t mid[KQ_TOKENS][cols / 16];
        const int nt = tile_of(A, i, KQ_TOKENS, cols, 0, a);
        const krow_fn tile = ktiles[12 - 10][nt];
        for (int t = 0; t < nt; t++) q6k_mids(a + t, cols, mid[t]), a[t].mid = mid[t];
        for (int64_t r = r0; r < r1; r++) tile(w + r * bytes, cols, a, r);
    }
}

/* Rows [r0, r1) of a Q4_K, Q5_K, Q6_K, IQ4_XS or MXFP4 matrix against every activation row of A, KQ_TOKENS
 * tokens a tile; KQ_ROWS rows (a few KiB each) at a time, read again from the cache by each tile.
 * All but Q6_K's rows eight at a time where eight are left in the block (KQ_ROWS and the tasks' rows are
 * multiples of 16, so whether a row is in a panel depends only on the matrix's rows); Q6_K's decoded
 * panels give its tile's bits (a call of more than one tile leaves its tiles only a panel's remainder). */
static void kquant_rows(int quant, const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const size_t bytes = block_row_bytes(quant, cols);
    if (A->n > KQ_TOKENS) r0 = decoded_rows(quant, w, cols, r0, r1, A);
    if (quant == 12) {
        q6k_tile_rows(w, cols, r0, r1, A);
        return;
    }
    for (int64_t first = r0; first < r1; first += KQ_ROWS) {
        const int64_t last = first + KQ_ROWS < r1 ? first + KQ_ROWS : r1;
        for (int64_t i = 0; i < A->n; i += KQ_TOKENS) {
            tile_row a[KQ_TOKENS];
            const int nt = tile_of(A, i, KQ_TOKENS, cols, 0, a);
            const krow_fn tile = ktiles[quant - 10][nt];
            int64_t r = first;
            const kpanel_fn panel = quant != 12 ? kpanels[quant >= 13 ? quant - 11 : quant - 10][nt] : NULL;
            for (; panel && r + 8 <= last; r += 8) panel(w + r * bytes, (int64_t)bytes, cols, a, r);  /* whole panels */
            for (; r < last; r++) tile(w + r * bytes, cols, a, r);
        }
    }
}
#endif
