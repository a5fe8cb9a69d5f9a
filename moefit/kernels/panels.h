/* int4 rows eight at a time (included by moe.c after dots.h), on every SIMD body: AVX2's, AVX-VNNI's
 * and AVX512-VNNI's tiles differ only in how a block's products are added (ADD / FINISH below).
 *
 * A row-at-a-time dot spends most of its instructions on each block's bookkeeping: the codes'
 * nibbles put in the activations' order, a horizontal sum, a block scale broadcast. Here eight
 * rows are first rearranged, once per call, into a per-thread panel (pack_codes): for block b and
 * byte quad k, the eight rows' bytes 4k..4k+3 side by side in one 256-bit vector, so that a lane
 * is a row. maddubs then multiplies each row's quad of codes by the same four activations
 * (broadcast; dpbusd on VNNI), the block's sums stay in their lanes, and the block's eight scales are one
 * vector (pack_scales). The packed panel then serves every token of the call,
 * PANEL_TOKENS at a time, each weight vector used by that many.
 *
 * Measured on an AVX2-only EPYC (Zen 3), one thread, a 1536 x 2048 int4 matrix in cache, against
 * dot_q4_avx2 a row at a time: 1 token 1.4-2.4x faster (the packing is half of it), 4-64 tokens
 * 3.3-4.7x (bench/kernel_rows.c prints both; bench/results/kernel_rows-round14-avx2.txt). On an
 * AVX512 EPYC (Zen 4) the VNNI tiles against its pair-order row body (dot_q4_vnni512, since
 * removed), in cache: rearranged per call 1 token 1.1-1.3x, 4-64 tokens 1.7-3.1x; stored as
 * panels 1.6-2.2x and 2.2-3.3x (bench/results/kernel_rows-round17-avx512.txt).
 *
 * Where one tile takes every token of the call (a decode step's experts) the panel is not stored
 * at all: each block's codes are transposed in registers and multiplied (QUADS_ROWS), and the next
 * panel's rows are prefetched (eight rows read side by side are eight short streams the hardware
 * does not run ahead of).
 * From memory, a layer call of 8 Qwen3-30B experts, 2 threads, on that EPYC: 1 token 0.81-0.89
 * ms (rearranged into a buffer 1.24-1.42, the old row body 1.02, stored panels 0.80), 4 tokens
 * 1.28-1.38 (1.94-2.05, 2.32); bench/kernel.py, bench/results/kernel-round17-avx512.txt.
 *
 * The numbers: a block's products are exact integers (the same on every body), scaled by its fp32
 * scale times the activation block's, added in block order; a token's arithmetic is the same
 * whatever the tile it is in, so its outputs do not depend on the number of tokens in the call,
 * on whether the matrix is stored in panels, or on the instruction set. The activations are in
 * order 1 (quantize_row). */

#define PANEL 8                   /* rows a panel: a 256-bit vector of int32 lanes */
#define PANEL_TOKENS 4            /* tokens a tile (their sums and accumulators stay in registers) */

static int int4_panels;           /* set by choose_isa with panel_tiles, on every SIMD body */

int moe_int4_panels(void);        /* moe.c: whether this CPU's kernel multiplies int4 in panels */

typedef struct {
    const int8_t *q;              /* activation rows [., cols], order 1 */
    const float *s;               /* [., cols / QK] */
    const int32_t *sum;           /* [., cols / QK] */
    const int32_t *row;           /* the activation row of output i (NULL: row i) */
    float *y;                     /* output i's row: y + i * y_stride; the matrix's row r at column r */
    int64_t y_stride, n;          /* n outputs */
} act_rows;

#if defined(__x86_64__)
typedef struct {
    const int8_t *q;
    const float *s;
    const int32_t *sum;
    float *y;
    const int32_t *mid;           /* Q6_K's tiles: 32 times each 16 activations' sum (kdecoded.h's q6k_mids) */
} tile_row;

/* Tokens i.. of A (at most `most`) as a tile's rows, their outputs from column r0; how many */
static int tile_of(const act_rows *A, int64_t i, int most, int64_t cols, int64_t r0, tile_row *a) {
    const int64_t nb = cols / QK;
    const int nt = A->n - i < most ? (int)(A->n - i) : most;
    for (int j = 0; j < nt; j++) {
        const int64_t row = A->row ? A->row[i + j] : i + j;
        a[j] = (tile_row){A->q + row * cols, A->s + row * nb, A->sum + row * nb, A->y + (i + j) * A->y_stride + r0};
    }
    return nt;
}

/* Block b of eight rows of codes (row_bytes apart) as the panel holds it: v[k] = the rows' bytes
 * 4k..4k+3 side by side (4x4 transposes of dwords). */
__attribute__((target("avx2"))) static inline void block_quads(const uint8_t *w, int64_t row_bytes, __m256i v[4]) {
#define ROWS_AT(i, j) _mm256_loadu2_m128i((const __m128i *)(w + (j) * row_bytes), (const __m128i *)(w + (i) * row_bytes))
    const __m256i r04 = ROWS_AT(0, 4), r15 = ROWS_AT(1, 5), r26 = ROWS_AT(2, 6), r37 = ROWS_AT(3, 7);
#undef ROWS_AT
    const __m256i t0 = _mm256_unpacklo_epi32(r04, r15), t1 = _mm256_unpackhi_epi32(r04, r15);
    const __m256i t2 = _mm256_unpacklo_epi32(r26, r37), t3 = _mm256_unpackhi_epi32(r26, r37);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* While block b of the panel at w0 is read: a 1/nb share of the next panel's rows (8 row_bytes on)
 * asked for. Eight rows read side by side are eight short streams, which the hardware prefetcher
 * does not run ahead of (from memory the rearranging waited on them: bench/kernel.py). */
static inline void prefetch_next_panel(const uint8_t *w0, int64_t row_bytes, int64_t b, int64_t nb) {
    const char *next = (const char *)w0 + 8 * row_bytes + b * (8 * row_bytes / nb);
    _mm_prefetch(next, _MM_HINT_T0), _mm_prefetch(next + 64, _MM_HINT_T0);
}

/* Where one tile reads a stored panel (a decode step's few tokens: the matrix streams from memory
 * once), the codes STREAM_LEAD bytes ahead of a block (two lines: in the panels after it; moe.c's)
 * are asked for, and the scales' line an eighth of that ahead (a panel's scales are an eighth of
 * its codes).
 * The hardware prefetcher alone kept one thread's read of a stored matrix at 8 GB/s of 13.6 and
 * two threads' at 15.5 of 24.9 (the lm_head, 151936 x 2048 int4, Sapphire Rapids: 4 KiB ahead
 * 12.6 and 22-24 GB/s; 1 and 2 KiB less, 8 and 16 KiB less again;
 * bench/results/prefetch-panels-round38-avx512.txt). A prompt's tiles read a panel from the cache
 * after the first, and go without. */
static inline void prefetch_panel_lead(const uint8_t *block, const uint16_t *scales, int64_t b) {
    _mm_prefetch((const char *)block + STREAM_LEAD, _MM_HINT_T0);
    _mm_prefetch((const char *)block + STREAM_LEAD + 64, _MM_HINT_T0);
    if (!(b & 3)) _mm_prefetch((const char *)scales + STREAM_LEAD / 8, _MM_HINT_T0);
}

/* Eight rows of codes (row_bytes apart) -> [nb][4][8 rows][4 bytes] */
__attribute__((target("avx2"))) static void pack_codes(const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                       uint8_t *out) {
    for (int64_t b = 0; b < nb; b++, out += 128) {
        __m256i v[4];
        prefetch_next_panel(w, row_bytes, b, nb);
        block_quads(w + 16 * b, row_bytes, v);
        for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(out + 32 * k), v[k]);
    }
}

/* Eight rows of fp16 group scales [8][groups] -> [groups][8]: 8x8 transposes of 16-bit words,
 * eight groups at a time. */
__attribute__((target("avx2"))) static void pack_scales(const uint16_t *s, int64_t groups, uint16_t *out) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m128i a[8], t[8], u[8];
        for (int r = 0; r < 8; r++) a[r] = _mm_loadu_si128((const __m128i *)(s + r * groups + g));
        for (int r = 0; r < 8; r += 2)
            t[r] = _mm_unpacklo_epi16(a[r], a[r + 1]), t[r + 1] = _mm_unpackhi_epi16(a[r], a[r + 1]);
        for (int h = 0; h < 8; h += 4)            /* rows h..h+3: groups 0-1, 2-3, 4-5, 6-7 */
            u[h] = _mm_unpacklo_epi32(t[h], t[h + 2]), u[h + 1] = _mm_unpackhi_epi32(t[h], t[h + 2]),
            u[h + 2] = _mm_unpacklo_epi32(t[h + 1], t[h + 3]), u[h + 3] = _mm_unpackhi_epi32(t[h + 1], t[h + 3]);
        for (int i = 0; i < 4; i++) {
            _mm_storeu_si128((__m128i *)(out + (g + 2 * i) * 8), _mm_unpacklo_epi64(u[i], u[i + 4]));
            _mm_storeu_si128((__m128i *)(out + (g + 2 * i + 1) * 8), _mm_unpackhi_epi64(u[i], u[i + 4]));
        }
    }
    for (; g < groups; g++)
        for (int r = 0; r < 8; r++) out[g * 8 + r] = s[r * groups + g];
}

#define BROADCAST4(p) _mm256_set1_epi32(*(const int32_t *)(const void *)(p))

/* A block's products for one token, by instruction set: ADD takes a quad's low and high nibbles
 * (lo, hi) and the four activations each multiplies (broadcast), FINISH gives the eight rows'
 * int32 sums. AVX2: maddubs into int16 lanes (at most 8 * 2 * 15 * 127 = 30480: no saturation),
 * widened once a block; VNNI: dpbusd into int32 lanes, low and high nibbles in two chains. The
 * sums are the same integers either way. */
#define SUMS_AVX2 __m256i
#define ZERO_AVX2 _mm256_setzero_si256()
#define ADD_AVX2(s, lo, hi, qlo, qhi) \
    (s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo, qlo), _mm256_maddubs_epi16(hi, qhi))))
#define FINISH_AVX2(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
typedef struct { __m256i lo, hi; } vnni_sums;
#define SUMS_VNNI vnni_sums
#define ZERO_VNNI ((vnni_sums){_mm256_setzero_si256(), _mm256_setzero_si256()})
#define ADD_VNNI256(s, lo, hi, qlo, qhi) (s.lo = _mm256_dpbusd_epi32(s.lo, lo, qlo), s.hi = _mm256_dpbusd_epi32(s.hi, hi, qhi))
#define ADD_AVXVNNI(s, lo, hi, qlo, qhi) \
    (s.lo = _mm256_dpbusd_avx_epi32(s.lo, lo, qlo), s.hi = _mm256_dpbusd_avx_epi32(s.hi, hi, qhi))
#define FINISH_VNNI(s) _mm256_add_epi32(s.lo, s.hi)

/* A block's four quad vectors: from a packed panel (codes [nb][4][8][4]), or transposed in
 * registers from eight rows (codes the first row, row_bytes apart), where a panel would be read
 * by one tile only (at most PANEL_TOKENS tokens) and so is not worth storing. */
#define QUADS_PACKED(v, codes, d, b, row_bytes, nb) \
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_si256((const __m256i *)(codes + 128 * b + 32 * k))
#define QUADS_ROWS(v, codes, d, b, row_bytes, nb) \
    (prefetch_next_panel(codes, row_bytes, b, nb), block_quads(codes + 16 * b, row_bytes, v))
/* a stored panel that one tile reads (a decode step's): QUADS_PACKED, the panels after it asked for */
#define QUADS_STREAMED(v, codes, d, b, row_bytes, nb) \
    prefetch_panel_lead(codes + 128 * b, d, b); \
    QUADS_PACKED(v, codes, d, b, row_bytes, nb)

/* NT tokens against one panel: out[t][0..8) = the eight rows' dots with token t. */
#define PANEL_TILE(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME, NT)                          \
    __attribute__((target(TARGET))) static void NAME##NT##_##ISA(const uint8_t *codes, int64_t row_bytes, \
            const uint16_t *scales, int64_t nb, int64_t per_group, const tile_row *a) {             \
        const __m256i low = _mm256_set1_epi8(15);                                                   \
        __m256 acc[NT];                                                                             \
        for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                  \
        const uint16_t *d = scales;                                                                 \
        for (int64_t b = 0, left = per_group; b < nb; b++) {                                        \
            SUMS sum[NT];                                                                           \
            __m256i quad[4];                                                                        \
            QUADS(quad, codes, d, b, row_bytes, nb);                                                \
            for (int t = 0; t < NT; t++) sum[t] = ZERO;                                             \
            for (int k = 0; k < 4; k++) {                                                           \
                const __m256i w = quad[k];                                                          \
                const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low); \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *q = a[t].q + b * QK + 4 * k;                                      \
                    ADD(sum[t], lo, hi, BROADCAST4(q), BROADCAST4(q + 16));                         \
                }                                                                                   \
            }                                                                                       \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));                \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256i dot = _mm256_add_epi32(FINISH(sum[t]), _mm256_set1_epi32(-8 * a[t].sum[b])); \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a[t].s[b])), acc[t]); \
            }                                                                                       \
            if (--left == 0) d += PANEL, left = per_group;                                          \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y, acc[t]);                              \
    }
typedef void (*tile_fn)(const uint8_t *, int64_t, const uint16_t *, int64_t, int64_t, const tile_row *);
#define TILES_OF(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME)                                 \
    PANEL_TILE(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME, 1)                                \
    PANEL_TILE(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME, 2)                                \
    PANEL_TILE(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME, 3)                                \
    PANEL_TILE(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS, NAME, 4)
/* [0]: tiles of packed panels, [1]: of rows (QUADS_ROWS), [2]: of streamed ones, by token count */
#define PANEL_TILES(ISA, TARGET, SUMS, ZERO, ADD, FINISH)                                           \
    TILES_OF(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS_PACKED, panel_tile)                        \
    TILES_OF(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS_ROWS, rows_tile)                           \
    TILES_OF(ISA, TARGET, SUMS, ZERO, ADD, FINISH, QUADS_STREAMED, streamed_tile)                   \
    static const tile_fn panel_tiles_##ISA[3][PANEL_TOKENS + 1] = {                                \
        {NULL, panel_tile1_##ISA, panel_tile2_##ISA, panel_tile3_##ISA, panel_tile4_##ISA},         \
        {NULL, rows_tile1_##ISA, rows_tile2_##ISA, rows_tile3_##ISA, rows_tile4_##ISA},             \
        {NULL, streamed_tile1_##ISA, streamed_tile2_##ISA, streamed_tile3_##ISA, streamed_tile4_##ISA}};
PANEL_TILES(avx2, "avx2,fma,f16c", SUMS_AVX2, ZERO_AVX2, ADD_AVX2, FINISH_AVX2)
PANEL_TILES(vnni256, AVX512, SUMS_VNNI, ZERO_VNNI, ADD_VNNI256, FINISH_VNNI)
#ifdef HAVE_AVXVNNI
PANEL_TILES(avxvnni, "avx2,fma,f16c,avxvnni", SUMS_VNNI, ZERO_VNNI, ADD_AVXVNNI, FINISH_VNNI)
#endif
static const tile_fn (*panel_tiles)[PANEL_TOKENS + 1] = panel_tiles_avx2;      /* choose_isa's */

/* The calling thread's buffers (0: a panel's codes and scales; 1: kdecoded.h's offset activations),
 * grown as needed and kept (the pool's threads live as long as the process; a 2048-column panel is
 * 8 KiB of codes and 1 KiB of scales). */
static uint8_t *thread_buffer(int which, int64_t bytes) {
    static __thread uint8_t *buf[2];
    static __thread int64_t have[2];
    if (bytes > have[which]) {
        free(buf[which]);
        have[which] = 0;
        if (!(buf[which] = aligned_alloc(64, (bytes + 63) / 64 * 64))) return NULL;
        have[which] = bytes;
    }
    return buf[which];
}

static uint8_t *panel_buffer(int64_t bytes) { return thread_buffer(0, bytes); }

/* One panel (codes [nb][4][8][4], or eight rows of codes row_bytes apart when row_bytes > 0;
 * scales [groups][8]; stored: the matrix's own, not a call's buffer) against every activation row
 * of A, the outputs at column r0, PANEL_TOKENS tokens a tile. */
static void panel_tokens(const uint8_t *codes, int64_t row_bytes, int stored, const uint16_t *scales,
                         int64_t cols, int64_t group, int64_t r0, const act_rows *A) {
    const tile_fn *tiles = panel_tiles[row_bytes > 0 ? 1 : A->n <= PANEL_TOKENS && stored ? 2 : 0];
    for (int64_t i = 0; i < A->n; i += PANEL_TOKENS) {
        tile_row a[PANEL_TOKENS];
        const int nt = tile_of(A, i, PANEL_TOKENS, cols, r0, a);
        tiles[nt](codes, row_bytes, scales, cols / QK, group / QK, a);
    }
}

/* Rows [r0, r1) of the int4 matrix (w [., cols / 2], s [., cols / group] fp16) against every
 * activation row of A, whole panels rearranged here (their codes in registers where one tile takes
 * every token, else into the buffer, read by each tile); returns the first row left (fewer than
 * PANEL remain, or the buffer could not be had). */
static int64_t int4_panel_rows(const uint8_t *w, const uint16_t *s, int64_t cols, int64_t group, int64_t r0,
                               int64_t r1, const act_rows *A) {
    const int64_t groups = cols / group, code_bytes = cols / QK * 128;
    uint8_t *codes = panel_buffer(code_bytes + groups * PANEL * 2);
    if (!codes) return r0;
    uint16_t *scales = (uint16_t *)(codes + code_bytes);
    const int one_tile = A->n <= PANEL_TOKENS;
    for (; r0 + PANEL <= r1; r0 += PANEL) {
        pack_scales(s + r0 * groups, groups, scales);
        if (one_tile) {
            panel_tokens(w + r0 * (cols / 2), cols / 2, 0, scales, cols, group, r0, A);
            continue;
        }
        pack_codes(w + r0 * (cols / 2), cols / 2, cols / QK, codes);
        panel_tokens(codes, 0, 0, scales, cols, group, r0, A);
    }
    return r0;
}

/* The same for a matrix stored in panels already (moe.c's quant 5, kernels.to_panels: its first
 * rows - rows % 8 as panels, in place of the rows they hold); r0 and r1 whole panels. */
static void int4_stored_panel_rows(const uint8_t *w, const uint16_t *s, int64_t cols, int64_t group, int64_t r0,
                                   int64_t r1, const act_rows *A) {
    for (; r0 + PANEL <= r1; r0 += PANEL)
        panel_tokens(w + r0 * (cols / 2), 0, 1, s + r0 * (cols / group), cols, group, r0, A);
}
#endif

/* An int4 matrix (w [rows, cols / 2], s [rows, cols / group] fp16) in the order quant 5 reads
 * (kernels.to_panels): its first rows - rows % 8 rows as panels, the rest copied as rows. Returns
 * -1 where this CPU's body does not multiply panels. */
int moe_to_panels(const uint8_t *w, const uint16_t *s, int64_t rows, int64_t cols, int64_t group, uint8_t *out_w,
                  uint16_t *out_s) {
    if (!moe_int4_panels() || cols % QK || group % 2 || cols % group) return -1;
    const int64_t groups = cols / group, half = cols / 2, head = rows - rows % PANEL;
#if defined(__x86_64__)
    for (int64_t r = 0; r < head; r += PANEL) {
        pack_codes(w + r * half, half, cols / QK, out_w + r * half);
        pack_scales(s + r * groups, groups, out_s + r * groups);
    }
#endif
    memcpy(out_w + head * half, w + head * half, (size_t)((rows - head) * half));
    memcpy(out_s + head * groups, s + head * groups, (size_t)((rows - head) * groups) * 2);
    return 0;
}
