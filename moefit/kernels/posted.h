/* A layer call posted to the pool (included by moe.c after run_layer): moe_layer_post returns at
 * once and a pool worker leads the call, its phases shared with the other workers as parallel()
 * shares them, while the caller goes on with other work (the runner's bookkeeping of the layer:
 * experts/host_side.py); moe_layer_wait then works on the call's tasks with them until it is done
 * and returns what run_layer returned. The pool's threads stay the pool's threads: the caller is
 * not working while it is away, and joins when it waits.
 *
 * moe_swiglu_post posts a SwiGLU MLP the same way (a decode step's shared expert, running while
 * the engine thread prepares the routed experts' call).
 *
 * One call in flight: posting another, or any parallel() of the caller's meanwhile, first joins
 * it. Where no worker has taken it when the caller waits (a pool of one thread has none), the
 * caller runs it itself. */

enum { IDLE, POSTED, RUNNING, DONE };
enum { LAYER_CALL, SWIGLU_CALL };

int moe_swiglu(const float *x, int64_t T, int64_t E, int64_t I, int gu_quant, int64_t gu_group, const void *gu,
               const void *gu_scales, int down_quant, int64_t down_group, const void *down, const void *down_scales,
               float *y);                                      /* linear.h */

static struct {
    _Atomic int state;
    int64_t ticket;                    /* the last call posted; its rc stays until the next */
    int rc;
    int kind;                          /* LAYER_CALL (run_layer's arguments below) or SWIGLU_CALL (sw) */
    struct { int gu_quant, down_quant; int64_t gu_group, down_group; const void *gu, *gu_scales, *down, *down_scales; } sw;
    const float *x;
    int64_t T, E, I, group, n_exp;
    int quant;
    const expert_ptrs *ex;
    const int64_t *start;
    const int32_t *rows;
    const float *weights;
    float *out;
    act_params act;                    /* used when act.gu_bias is set (gpt-oss's experts) */
} posted;

static void lead_posted(void) {
    leading = 1;
    if (posted.kind == SWIGLU_CALL)
        posted.rc = moe_swiglu(posted.x, posted.T, posted.E, posted.I, posted.sw.gu_quant, posted.sw.gu_group,
                               posted.sw.gu, posted.sw.gu_scales, posted.sw.down_quant, posted.sw.down_group,
                               posted.sw.down, posted.sw.down_scales, posted.out);
    else
        posted.rc = run_layer(posted.x, posted.T, posted.E, posted.I, posted.quant, posted.group, posted.n_exp,
                              posted.ex, posted.start, posted.rows, posted.weights, posted.out,
                              posted.act.gu_bias ? &posted.act : NULL);
    leading = 0;
    atomic_store(&posted.state, DONE);
}

static void take_posted(void) {
    int want = POSTED;
    if (atomic_load(&posted.state) == POSTED && atomic_compare_exchange_strong(&posted.state, &want, RUNNING))
        lead_posted();
}

/* Until the posted call is done, its phases' tasks claimed here too; then the pool is free. */
static int join_posted(void) {
    if (atomic_load(&posted.state) == IDLE) return posted.rc;
    uint64_t seen = 0;
    while (atomic_load(&posted.state) != DONE) {       /* only a caller's turn joins (pool.h's enter_caller) */
        take_posted();                                  /* nobody has: it runs here */
        const uint64_t gen = atomic_load(&pool.generation);
        if (gen != seen) {
            seen = gen;
            run_tasks(gen);
        } else {
            RELAX();
        }
    }
    atomic_store(&posted.state, IDLE);
    return posted.rc;
}

/* The call described in `posted` handed to the pool: a new generation with no tasks wakes a worker,
 * which leads it (take_posted). */
static int64_t post_it(void) {
    posted.ticket++;
    atomic_store(&posted.state, POSTED);
    if (pool.threads > 1) {
        const uint64_t gen = atomic_load(&pool.generation) + 1;
        atomic_store(&pool.next, gen << 32);
        pool.tasks = 0;
        publish(gen);
    }
    return posted.ticket;
}

/* moe_layer (gu_bias NULL) or moe_layer_act, posted; returns its ticket for moe_layer_wait. The
 * arrays it is given must live until then. */
int64_t moe_layer_post(const float *x, int64_t T, int64_t E, int64_t I, int quant, int64_t group, int64_t n_exp,
                       const expert_ptrs *ex, const int64_t *start, const int32_t *rows, const float *weights,
                       float *out, float alpha, float limit, const float *const *gu_bias,
                       const float *const *dn_bias) {
    enter_caller();
    join_posted();
    choose_isa();                                       /* here, not racing a worker's first call */
    posted.kind = LAYER_CALL;
    posted.x = x, posted.T = T, posted.E = E, posted.I = I, posted.quant = quant, posted.group = group;
    posted.n_exp = n_exp, posted.ex = ex, posted.start = start, posted.rows = rows, posted.weights = weights;
    posted.out = out, posted.act = (act_params){alpha, limit, gu_bias, dn_bias};
    const int64_t ticket = post_it();
    leave_caller();
    return ticket;
}

/* moe_swiglu posted (a decode step's shared expert, started before the routed experts are): its
 * ticket for moe_layer_wait. x and y must live until then. */
int64_t moe_swiglu_post(const float *x, int64_t T, int64_t E, int64_t I, int gu_quant, int64_t gu_group,
                        const void *gu, const void *gu_scales, int down_quant, int64_t down_group, const void *down,
                        const void *down_scales, float *y) {
    enter_caller();
    join_posted();
    choose_isa();
    posted.kind = SWIGLU_CALL;
    posted.x = x, posted.T = T, posted.E = E, posted.I = I, posted.out = y;
    posted.sw.gu_quant = gu_quant, posted.sw.gu_group = gu_group, posted.sw.gu = gu, posted.sw.gu_scales = gu_scales;
    posted.sw.down_quant = down_quant, posted.sw.down_group = down_group, posted.sw.down = down;
    posted.sw.down_scales = down_scales;
    const int64_t ticket = post_it();
    leave_caller();
    return ticket;
}

/* The posted call's result (0, or -1 for shapes it does not take), once it is done; -2 for a
 * ticket older than the last one posted. */
int moe_layer_wait(int64_t ticket) {
    enter_caller();
    const int rc = ticket != posted.ticket ? -2 : join_posted();
    leave_caller();
    return rc;
}

/* ---- a decode step's call straight from its routing ------------------------------------------
 * One token's experts ids[0..n) (distinct) with their router weights w, each one's parts read from
 * `table` (the layer's expert_ptrs, indexed by expert): moe_layer_post's call with its experts in
 * ascending order (the order a verify window's or a prompt's grouping gives a token: the same
 * sums), out [1, E] zeroed first. What the runner did in Python before posting (grouping, sorting,
 * the pointer array: ~100 us of the engine thread with its caches cold, the pool idle meanwhile)
 * is done here. `act`: NULL for SwiGLU, else gpt-oss's clamped gate with each expert's biases read
 * from the layer's bias tables as its parts are from `table`. Returns the ticket, or -1 for n
 * outside [1, STEP_MOST]. */
enum { STEP_MOST = 64 };

typedef struct {
    float alpha, limit;
    const float *gu_bias, *dn_bias;      /* [N, 2I] (gate then up) and [N, E], fp32 */
    int64_t gu_stride, dn_stride;        /* floats from one expert's row to the next */
} step_act;

static struct {
    expert_ptrs ex[STEP_MOST];
    int64_t start[STEP_MOST + 1];
    int32_t rows[STEP_MOST];
    float w[STEP_MOST];
    const float *gu_bias[STEP_MOST], *dn_bias[STEP_MOST];
} step;

int64_t moe_step_post(const float *x, int64_t E, int64_t I, int quant, int64_t group, int64_t n, const int64_t *ids,
                      const float *w, const expert_ptrs *table, const step_act *act, float *out) {
    if (n < 1 || n > STEP_MOST) return -1;
    enter_caller();
    join_posted();                                      /* the call in flight reads `step` until done */
    int order[STEP_MOST];
    for (int i = 0; i < n; i++) {                       /* insertion sort by expert: k is small */
        int j = i;
        for (; j > 0 && ids[order[j - 1]] > ids[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    for (int i = 0; i < n; i++) {
        const int64_t e = ids[order[i]];
        step.ex[i] = table[e], step.w[i] = w[order[i]];
        step.rows[i] = 0, step.start[i] = i;
        if (act) {
            step.gu_bias[i] = act->gu_bias + e * act->gu_stride;
            step.dn_bias[i] = act->dn_bias + e * act->dn_stride;
        }
    }
    step.start[n] = n;
    memset(out, 0, sizeof(float) * E);
    const int64_t ticket = moe_layer_post(x, 1, E, I, quant, group, n, step.ex, step.start, step.rows, step.w, out,
                                          act ? act->alpha : 0.0f, act ? act->limit : 0.0f, act ? step.gu_bias : NULL,
                                          act ? step.dn_bias : NULL);
    leave_caller();
    return ticket;
}

/* ---- a decode step routed and posted in one call -----------------------------------------------
 * One token's router (rows.h's: moe_softmax_topk's numbers, or moe_sigmoid_topk's where `sigmoid`:
 * ids [k], w [k]) and, where the layer's row holds every chosen expert's parts, its experts posted
 * (moe_step_post, `act` as it takes it): the ticket. -1 for shapes the router does not take or k
 * over STEP_MOST (nothing written); -3 routed but not posted (an expert's parts not in the row
 * yet: the caller fills them and posts). */
typedef struct {
    const void *w;                       /* [N, E], fp32 or (w_bf16) bf16 */
    const float *bias;                   /* [N] or NULL (softmax: added to the logits, gpt-oss's; sigmoid:
                                            to the scores its choice ranks) */
    int64_t N, k;
    int sigmoid, renorm;                 /* renorm: the sigmoid router's `normalise` */
    int64_t groups, top_groups;          /* the sigmoid router's */
    float scale;
    int w_bf16;
} router_spec;

static int64_t route_step_post(const float *x, int64_t E, const router_spec *R, int64_t I, int quant, int64_t group,
                               const expert_ptrs *table, const step_act *act, int64_t *ids, float *w, float *out) {
    const int rc = R->sigmoid ? moe_sigmoid_topk(x, 1, E, R->w, R->w_bf16, R->bias, R->N, R->k, R->groups,
                                                 R->top_groups, R->renorm, R->scale, ids, w)
                              : moe_softmax_topk(x, 1, E, R->w, R->w_bf16, R->bias, R->N, R->k, R->renorm, ids, w);
    if (rc) return -1;
    for (int64_t j = 0; j < R->k; j++)
        if (!table[ids[j]].gu) return -3;
    return moe_step_post(x, E, I, quant, group, R->k, ids, w, table, act, out);
}

int64_t moe_route_step_post(const float *x, int64_t E, const router_spec *R, int64_t I, int quant, int64_t group,
                            const expert_ptrs *table, const step_act *act, int64_t *ids, float *w, float *out) {
    if (R->k > STEP_MOST) return -1;
    enter_caller();                                     /* routed and posted in one turn */
    const int64_t ticket = route_step_post(x, E, R, I, quant, group, table, act, ids, w, out);
    leave_caller();
    return ticket;
}
