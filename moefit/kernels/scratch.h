/* A layer call's scratch, kept between calls (included by moe.c before the layer code).
 *
 * A prompt chunk's layer call needs tens of MiB of scratch (its expert pairs' gate_up and down
 * outputs: 32 MiB of down outputs for 512 tokens of 8 experts at hidden 2048). glibc serves a block
 * of 32 MiB or more by mmap and unmaps it at free, whatever its settings, so each such call had the
 * kernel map, zero and fault in every page again (with moefit's heap settings, moefit/host_heap.py,
 * a quarter of a 512-token prompt's page faults). The largest block given back, up to KEPT_MOST,
 * is kept for the next call instead; a call that finds it taken or too small allocates its own
 * (two calls at once each have one). */
#define KEPT_MOST ((size_t)256 << 20)

typedef struct {
    size_t bytes;                      /* the block's, this header's 64 included */
    uint8_t pad[56];
} scratch_head;

static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static scratch_head *kept;             /* NULL while a call holds it */

/* a block of at least `bytes` (64-byte aligned, after its header) */
static void *scratch_take(size_t bytes) {
    scratch_head *h = NULL;
    bytes = sizeof(scratch_head) + (bytes + 63) / 64 * 64;
    pthread_mutex_lock(&kept_lock);
    if (kept && kept->bytes >= bytes) h = kept, kept = NULL;
    pthread_mutex_unlock(&kept_lock);
    if (!h && (h = aligned_alloc(64, bytes))) h->bytes = bytes;
    return h ? h + 1 : NULL;
}

static void scratch_give(void *block) {
    scratch_head *h = (scratch_head *)block - 1;
    pthread_mutex_lock(&kept_lock);
    if (h->bytes <= KEPT_MOST && (!kept || h->bytes > kept->bytes)) {
        scratch_head *old = kept;
        kept = h, h = old;
    }
    pthread_mutex_unlock(&kept_lock);
    free(h);
}

/* one block for n buffers of sizes[i] bytes, each 64-byte aligned, at part[i]; NULL without memory */
static void *scratch_parts(const size_t *sizes, int n, void **part) {
    size_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += (sizes[i] + 63) / 64 * 64;
    uint8_t *block = scratch_take(bytes), *at = block;
    for (int i = 0; block && i < n; at += (sizes[i] + 63) / 64 * 64, i++) part[i] = at;
    return block;
}
