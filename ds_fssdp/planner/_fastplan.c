/* Planner hot paths in C: the same algorithms, step for step, as the Python references in
 * ds_fssdp/planner/{materialize,joint,dispatch,balance}.py (tests compare them on random
 * instances). Planning runs every iteration for every MoE layer; the Python versions take
 * milliseconds at E=64, D=32, these take microseconds.
 *
 * Legend: E experts, D ranks, N nodes of G ranks (node of d = d / G), X replicated experts, F
 * flows that carry tokens. Arrays are row-major: placement uint8 [E*D], tokens int64 or float64
 * [E*D], dense plan int64 [E*D*D]. Inputs arrive as addresses of C-contiguous CPU tensors whose
 * dtype and shape ds_fssdp/planner/fast.py has checked (and keeps alive for the call); outputs as
 * writable buffers or a new bytes object. Values that could index out of bounds or make the
 * comparisons moot (owner ids, G, negative counts, non-finite predictions) are checked here and
 * raise ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif


#define MAX_D 4096
#define PTR(type, addr) ((type *)(uintptr_t)(addr))

/* c ? a : b without a branch (a select that depends on the data mispredicts half the time, and
 * compilers may turn ?: into a branch). */
static inline int64_t sel_i(int c, int64_t a, int64_t b) { return b ^ ((a ^ b) & -(int64_t)c); }

/* Scratch memory kept between calls, one buffer per use (the GIL is held throughout, so there is
 * one caller at a time): planning runs for every layer every iteration, and fresh allocations of
 * these sizes page-fault on first touch. NULL with MemoryError set if it cannot grow. */
enum { SCRATCH_ENTRY, SCRATCH_CORE, SCRATCH_TOUCHED, SCRATCH_FLOWS, SCRATCH_DENSE, SCRATCH_SCHEDULE, SCRATCH_EXCHANGE,
       SCRATCH_SLOTS };
static char *scratch_buf[SCRATCH_SLOTS];
static size_t scratch_size[SCRATCH_SLOTS];
static void *scratch_get(int slot, size_t bytes) {
    if (bytes > scratch_size[slot]) {
        char *p = realloc(scratch_buf[slot], bytes); /* keeps the contents */
        if (!p) { PyErr_NoMemory(); return NULL; }
        scratch_buf[slot] = p;
        scratch_size[slot] = bytes;
    }
    return scratch_buf[slot];
}

/* Entry points call this last: a buffer past SCRATCH_KEEP bytes (a very large layer) is freed
 * rather than held between calls. */
#define SCRATCH_KEEP ((size_t)8 << 20)
static void scratch_trim(void) {
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_size[i] > SCRATCH_KEEP) {
            free(scratch_buf[i]);
            scratch_buf[i] = NULL;
            scratch_size[i] = 0;
        }
}

/* SCRATCH_DENSE is all zeros between calls (its users clear what they set): a dense array that
 * is not cleared in full every call. */
static void *scratch_zeroed(size_t bytes) {
    size_t had = scratch_size[SCRATCH_DENSE];
    char *p = scratch_get(SCRATCH_DENSE, bytes);
    if (p && bytes > had) memset(p + had, 0, bytes - had);
    return p;
}

/* The flows of a dispatch that carry tokens, (x, h, d, k) each: k tokens of replicated expert
 * rep[x] that holder h computes for source rank d. Kept in SCRATCH_FLOWS as four columns of cap
 * entries (x, h, d, k: the rows of flows_4F), grown as needed. */
typedef struct {
    int64_t *col[4], n, cap;
} Flows;

static void flows_start(Flows *fl) {
    fl->n = 0;
    fl->cap = (int64_t)(scratch_size[SCRATCH_FLOWS] / (4 * sizeof(int64_t)));
    for (int j = 0; j < 4; j++) fl->col[j] = (int64_t *)scratch_buf[SCRATCH_FLOWS] + j * fl->cap;
}

/* Room for `need` flows. Returns 0, or -1 with MemoryError set. */
static int flows_reserve(Flows *fl, int64_t need) {
    if (need <= fl->cap) return 0;
    int64_t cap = fl->cap ? 2 * fl->cap : 1024;
    if (cap < need) cap = need;
    int64_t *p = scratch_get(SCRATCH_FLOWS, sizeof(int64_t) * 4 * (size_t)cap);
    if (!p) return -1;
    for (int j = 3; j >= 0; j--) { /* the columns to their new offsets, the last first */
        memmove(p + j * cap, p + j * fl->cap, sizeof(int64_t) * (size_t)fl->n);
        fl->col[j] = p + j * cap;
    }
    fl->cap = cap;
    return 0;
}

/* One more flow: fl has room for it. */
static inline void flows_put(Flows *fl, int64_t x, int64_t h, int64_t d, int64_t k) {
    int64_t i = fl->n++;
    fl->col[0][i] = x; fl->col[1][i] = h; fl->col[2][i] = d; fl->col[3][i] = k;
}

static int check_ranks(int64_t D) {
    if (D > MAX_D) {
        PyErr_Format(PyExc_ValueError, "the C planner supports up to %d ranks, got %lld", MAX_D, (long long)D);
        return -1;
    }
    return 0;
}

/* node_D[d] = d / G: nodes are contiguous blocks of G ranks (Topology). Raises unless G divides D. */
static int node_ids(int64_t *node_D, int64_t D, int64_t G) {
    if (G < 1 || D < 1 || D % G) {
        PyErr_Format(PyExc_ValueError, "ranks_per_node (%lld) must divide the %lld ranks", (long long)G, (long long)D);
        return -1;
    }
    for (int64_t d = 0; d < D; d++) node_D[d] = d / G;
    return 0;
}

static int check_len(Py_buffer *b, int64_t want, const char *what) {
    if (b->len < want) {
        PyErr_Format(PyExc_ValueError, "%s buffer has %zd bytes, needs %lld", what, b->len, (long long)want);
        return -1;
    }
    return 0;
}

static int check_owner(const int64_t *owner_E, int64_t E, int64_t D) {
    for (int64_t e = 0; e < E; e++)
        if (owner_E[e] < 0 || owner_E[e] >= D) {
            PyErr_Format(PyExc_ValueError, "owner_E[%lld] = %lld is not a rank in [0, %lld)", (long long)e,
                         (long long)owner_E[e], (long long)D);
            return -1;
        }
    return check_ranks(D);
}

/* The holders of placement row p, ascending, into H; those in node n are H[lo[n] : lo[n + 1]]
 * (nodes are contiguous blocks of D / N ranks). Returns how many. */
static int64_t holders_by_node(const uint8_t *p, int64_t D, int64_t N, int64_t *H, int64_t *lo) {
    int64_t nh = 0, G = D / N;
    for (int64_t n = 0; n < N; n++) {
        lo[n] = nh;
        for (int64_t d = n * G; d < (n + 1) * G; d++) { H[nh] = d; nh += p[d] != 0; }
    }
    lo[N] = nh;
    return nh;
}

/* The OR of the G bytes at p (a node's bytes of a placement row: nonzero where a rank holds a copy). */
static inline uint8_t or_bytes(const uint8_t *p, int64_t G) {
    if (G % 8 == 0) { /* 8 bytes at a time, then the word's bytes folded into one */
        uint64_t any = 0, w;
        for (int64_t j = 0; j < G; j += 8) { memcpy(&w, p + j, 8); any |= w; }
        any |= any >> 32;
        any |= any >> 16;
        any |= any >> 8;
        return (uint8_t)any;
    }
    uint8_t any = 0;
    for (int64_t j = 0; j < G; j++) any |= p[j];
    return any;
}

/* ---------------------------------------------------------------------------------------------
 * Algorithm 1 (paper): placement (zeroed) gets the shard, then the replicas.
 */
/* The rank for the next replica of an expert: among ranks lacking it with a free slot, a node
 * without it first, then the most free slots, then the least owned load, then the lowest id.
 * One branch-free pass over the ranks. */
static int64_t pick_rank_alg1(const uint8_t *holds_D, const int64_t *free_D, const double *rank_load_D,
                              const int64_t *node_D, const uint8_t *node_holds, int64_t D, int64_t m) {
    const int64_t none = INT64_MAX;
    int64_t best = -1, best_key = none;
    double best_load = INFINITY;
    for (int64_t d = 0; d < D; d++) {
        int64_t key = node_holds[node_D[d]] * (m + 1) + (m - free_D[d]); /* smaller is better */
        key = (!holds_D[d] && free_D[d] > 0) ? key : none;
        double load = rank_load_D[d];
        int win = (key < best_key) | ((key == best_key) & (load < best_load));
        best_key = win ? key : best_key;
        best_load = win ? load : best_load;
        best = win ? d : best;
    }
    return best_key == none ? -1 : best;
}

/* top[0 : E] = 0 .. E - 1 by load, descending, ties to the lower id (a stable sort); top has room for
 * 2E (the second half: a merge sort's buffer). NaN loads order as insertion by `<` leaves them. */
static void by_load(const double *load_E, int64_t E, int64_t *top) {
    int nan = 0;
    for (int64_t e = 0; e < E; e++) { top[e] = e; nan |= load_E[e] != load_E[e]; }
    if (nan) { /* `<` is no strict weak order with NaN: the insertion's own order */
        for (int64_t i = 1; i < E; i++) {
            int64_t v = top[i], j = i - 1;
            while (j >= 0 && load_E[top[j]] < load_E[v]) { top[j + 1] = top[j]; j--; }
            top[j + 1] = v;
        }
        return;
    }
    /* bottom-up merges (the stable order is unique, so it is the insertion's): a right run's
       expert goes first only if its load is larger */
    int64_t *a = top, *b = top + E;
    for (int64_t w = 1; w < E; w *= 2) {
        for (int64_t lo = 0; lo < E; lo += 2 * w) {
            int64_t mid = lo + w < E ? lo + w : E, hi = lo + 2 * w < E ? lo + 2 * w : E, i = lo, j = mid, k = lo;
            while (i < mid && j < hi) b[k++] = load_E[a[j]] > load_E[a[i]] ? a[j++] : a[i++];
            while (i < mid) b[k++] = a[i++];
            while (j < hi) b[k++] = a[j++];
        }
        int64_t *t = a;
        a = b;
        b = t;
    }
    if (a != top) memcpy(top, a, sizeof(int64_t) * (size_t)E);
}

/* base (calibration; NULL: none): P starts as base | shard, each rank's slots less its replicas there.
 * top: room for 2E. */
static void alg1_core(const int64_t *owner_E, const double *load_E, const int64_t *node_D, uint8_t *P, int64_t E,
                      int64_t D, int64_t N, int64_t t, int64_t m, int64_t *top, const uint8_t *base) {
    int64_t free_D[MAX_D];
    double rank_load_D[MAX_D];
    uint8_t node_holds[MAX_D];
    double total = 0;
    if (base) memcpy(P, base, (size_t)(E * D));
    for (int64_t e = 0; e < E; e++) { P[e * D + owner_E[e]] = 1; total += load_E[e]; }
    if (t > E) t = E;
    if (m > t) m = t;
    if (t == 0 || m == 0 || D == 1 || total <= 0) return;
    by_load(load_E, E, top); /* top-t by load, ties to the lower id */
    if (t <= m && !base) {
        for (int64_t i = 0; i < t; i++) memset(P + top[i] * D, 1, (size_t)D);
        return;
    }
    for (int64_t d = 0; d < D; d++) { free_D[d] = m; rank_load_D[d] = 0; }
    for (int64_t e = 0; e < E; e++) {
        rank_load_D[owner_E[e]] += load_E[e];
        if (base)
            for (int64_t d = 0; d < D; d++) free_D[d] -= P[e * D + d] & (d != owner_E[e]);
    }
    int64_t slots_left = 0;
    for (int64_t d = 0; d < D; d++) {
        if (free_D[d] < 0) free_D[d] = 0;
        slots_left += free_D[d];
    }
    double load_left = 0;
    for (int64_t i = 0; i < t; i++) load_left += load_E[top[i]];
    for (int64_t i = 0; i < t; i++) {
        int64_t e = top[i];
        double l = load_E[e];
        if (slots_left == 0 || load_left <= 0) break;
        int64_t n = (int64_t)floor(slots_left * l / load_left + 0.5);
        if (n > slots_left) n = slots_left;
        load_left -= l;
        for (int64_t nd = 0, G = D / N; nd < N; nd++) /* nodes: blocks of G ranks */
            node_holds[nd] = or_bytes(P + e * D + nd * G, G);
        for (int64_t k = 0; k < n; k++) {
            int64_t d = pick_rank_alg1(P + e * D, free_D, rank_load_D, node_D, node_holds, D, m);
            if (d < 0) break;
            P[e * D + d] = 1;
            node_holds[node_D[d]] = 1;
            free_D[d] -= 1;
            slots_left -= 1;
        }
    }
}

static PyObject *materialize_alg1(PyObject *self, PyObject *args) {
    unsigned long long owner, load, base; /* base: a bool [E, D] placement's address, 0 for none */
    Py_buffer place;
    long long E, D, G, t, m;
    if (!PyArg_ParseTuple(args, "KKw*LLLLLK", &owner, &load, &place, &E, &D, &G, &t, &m, &base)) return NULL;
    PyObject *out = NULL;
    int64_t node_D[MAX_D];
    int64_t *top = scratch_get(SCRATCH_CORE, sizeof(int64_t) * (size_t)(2 * E + 1));
    if (!top) goto done;
    if (check_owner(PTR(int64_t, owner), E, D) || node_ids(node_D, D, G) || check_len(&place, E * D, "placement"))
        goto done;
    memset(place.buf, 0, (size_t)(E * D));
    alg1_core(PTR(int64_t, owner), PTR(double, load), node_D, place.buf, E, D, D / G, t, m, top,
              base ? PTR(uint8_t, base) : NULL);
    out = Py_None;
    Py_INCREF(out);
done:
    scratch_trim();
    PyBuffer_Release(&place);
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * Joint materialization (joint.py): placement (zeroed) gets the shard, then the replicas.
 */
/* Open ranks of e in node n: those with a free slot (nfree[n]) less those already holding e
 * (hf[e, n]). */
#define OPEN(e, n) (nfree[n] - hf[(e) * N + (n)])

/* best_n[e] / best_v[e]: the open node with the largest v[e, n] (ties: lowest n); -1 / -1.0 if
 * none. */
static inline void joint_best(int64_t e, int64_t N, const double *v, const int64_t *nfree, const int64_t *hf,
                              int64_t *best_n, double *best_v) {
    int64_t bn = -1;
    double bv = -1.0;
    for (int64_t n = 0; n < N; n++) {
        int win = (OPEN(e, n) > 0) & (v[e * N + n] > bv);
        bv = win ? v[e * N + n] : bv;
        bn = win ? n : bn;
    }
    best_n[e] = bn;
    best_v[e] = bv;
}

/* The argmax over best_v kept by groups of 8 experts: group_v[g] / group_e[g] are the largest
 * value in experts [8g, 8g + 8) and its first expert (best_v is padded with -inf to a multiple of
 * 8). After best_v[e] changes only e's group is redone; the first largest over all experts is
 * the first largest group's. */
#define JOINT_GROUP 8
/* The first index of the largest of a[0 : n]; *largest gets it. */
static inline int64_t first_max(const double *a, int64_t n, double *largest) {
    double bv = a[0];
    int64_t bi = 0;
    for (int64_t i = 1; i < n; i++) {
        int win = a[i] > bv;
        bv = win ? a[i] : bv;
        bi = win ? i : bi;
    }
    *largest = bv;
    return bi;
}

static inline void group_redo(const double *best_v, double *group_v, int64_t *group_e, int64_t g) {
    group_e[g] = g * JOINT_GROUP + first_max(best_v + g * JOINT_GROUP, JOINT_GROUP, group_v + g);
}

/* Bytes of scratch joint_core needs. */
static size_t joint_scratch(int64_t E, int64_t D, int64_t N, int64_t m) {
    int64_t groups = (E + JOINT_GROUP - 1) / JOINT_GROUP;
    return sizeof(int64_t) * (size_t)(4 * E * N + 2 * E + groups * (JOINT_GROUP + 2) + N + 3 * D + 1 + D * m) +
           (size_t)E + 8;
}

/* The eager greedy keeps best_n[e] the argmax over e's open nodes at all times. Here best_v[e] is
 * refreshed lazily: a node only closes (its last free rank lacking e fills), so a stored best_v
 * is never below the true one, and the first largest stored value, once fresh, is the eager
 * choice (ties included: a stale equal value on a lower e is refreshed first). Experts that may
 * not take holders (once t are replicated, the others) are -inf in best_v. */
static int joint_core(const int64_t *owner_E, const double *T, const int64_t *node_D, uint8_t *P, int64_t E,
                      int64_t D, int64_t N, int64_t t, int64_t m, double stop, char *scratch) {
    int64_t groups = (E + JOINT_GROUP - 1) / JOINT_GROUP;
    double *F = (double *)scratch, *h = F + E * N, *v = h + E * N, *best_v = v + E * N;
    double *group_v = best_v + groups * JOINT_GROUP;
    int64_t *hf = (int64_t *)(group_v + groups), *best_n = hf + E * N, *group_e = best_n + E;
    int64_t *own = group_e + groups, *own_start = own + E, *nfree = own_start + D + 1, *reps = nfree + N;
    int64_t *by_owned = reps + D * m;
    uint8_t *repl = (uint8_t *)(by_owned + D);
    int64_t free_D[MAX_D];
    double owned_D[MAX_D];
    double total = 0;
    if (t > E) t = E;
    memset(h, 0, sizeof(double) * (size_t)(E * N));
    memset(hf, 0, sizeof(int64_t) * (size_t)(E * N));
    memset(repl, 0, (size_t)E);
    for (int64_t e = 0; e < E; e++) P[e * D + owner_E[e]] = 1;
    for (int64_t d = 0; d < D; d++) { free_D[d] = m; owned_D[d] = 0; }
    /* nodes are contiguous blocks of G ranks (Topology: node of d = d // G) */
    int64_t G = D / N, e4 = E - E % 4;
    for (int64_t e = 0; e < e4; e += 4) /* each node's sum in rank order, four experts at a time */
        for (int64_t n = 0; n < N; n++) {
            const double *t0 = T + e * D + n * G;
            double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int64_t g = 0; g < G; g++) { s0 += t0[g]; s1 += t0[D + g]; s2 += t0[2 * D + g]; s3 += t0[3 * D + g]; }
            F[e * N + n] = s0; F[(e + 1) * N + n] = s1; F[(e + 2) * N + n] = s2; F[(e + 3) * N + n] = s3;
        }
    for (int64_t e = e4; e < E; e++)
        for (int64_t n = 0; n < N; n++) {
            double sum = 0;
            for (int64_t g = 0; g < G; g++) sum += T[e * D + n * G + g];
            F[e * N + n] = sum;
        }
    for (int64_t e = 0; e < E; e++) {
        double *Fe = F + e * N, row = 0;
        for (int64_t n = 0; n < N; n++) row += Fe[n];
        int64_t on = node_D[owner_E[e]];
        h[e * N + on] = 1;
        hf[e * N + on] = 1; /* every rank has all m slots free */
        total += row;
        owned_D[owner_E[e]] += row;
    }
    if (!isfinite(total)) /* NaN or infinite counts would make every comparison below moot */
        for (int64_t i = 0; i < E * D; i++)
            if (!isfinite(T[i])) {
                PyObject *v = PyFloat_FromDouble(T[i]);
                if (v) {
                    PyErr_Format(PyExc_ValueError, "tokens_ED[%lld, %lld] = %R is not finite", (long long)(i / D),
                                 (long long)(i % D), v);
                    Py_DECREF(v);
                }
                return -1;
            }
    if (t == 0 || m == 0 || D == 1 || total <= 0) return 0;
    /* each node's ranks by owned load, then id: the order ties on free slots are broken in */
    for (int64_t n = 0; n < N; n++) {
        int64_t *o = by_owned + n * G;
        for (int64_t i = 0; i < G; i++) {
            int64_t d = n * G + i, j = i - 1;
            while (j >= 0 && owned_D[o[j]] > owned_D[d]) { o[j + 1] = o[j]; j--; }
            o[j + 1] = d;
        }
    }
    for (int64_t n = 0; n < N; n++) nfree[n] = G;
    /* the experts each rank owns (CSR), ascending */
    memset(own_start, 0, sizeof(int64_t) * (size_t)(D + 1));
    for (int64_t e = 0; e < E; e++) own_start[owner_E[e] + 1]++;
    for (int64_t d = 0; d < D; d++) own_start[d + 1] += own_start[d];
    for (int64_t d = 0; d < D; d++) free_D[d] = own_start[d]; /* a cursor for the fill, reset below */
    for (int64_t e = 0; e < E; e++) own[free_D[owner_E[e]]++] = e;
    for (int64_t d = 0; d < D; d++) free_D[d] = m;
    double tau = total / D;
    int64_t n_repl = 0;
    /* v[e, n]: per-holder load, plus total while node n lacks e (cover first) */
    for (int64_t i = 0; i < E * N; i++) v[i] = F[i] + ((h[i] == 0 && F[i] > 0) ? total : 0.0); /* h: 0 or 1 */
    for (int64_t e = 0; e < E; e++) joint_best(e, N, v, nfree, hf, best_n, best_v);
    for (int64_t e = E; e < groups * JOINT_GROUP; e++) best_v[e] = -INFINITY;
    for (int64_t g = 0; g < groups; g++) group_redo(best_v, group_v, group_e, g);
    for (;;) {
        /* the reference's argmax over (e, n), e-major: the first largest. (best_v[e] is -1
           exactly when e has no open node, so it never wins.) */
        int64_t be;
        double best;
        for (;;) {
            be = group_e[first_max(group_v, groups, &best)];
            if (!(best > -1.0)) { be = -1; break; }
            if (OPEN(be, best_n[be]) > 0) break;
            joint_best(be, N, v, nfree, hf, best_n, best_v); /* stale: its best node closed */
            group_redo(best_v, group_v, group_e, be / JOINT_GROUP);
        }
        if (be < 0 || best <= 0.0 || best < stop * tau) break; /* nothing left to balance */
        /* the open rank of node bn with the most free slots, then the least owned load, then
           the lowest id: the first with the most in by_owned order (branch-free) */
        int64_t bn = best_n[be], d_best = -1, b_free = 0;
        const uint8_t *Pe = P + be * D;
        for (int64_t i = bn * G; i < (bn + 1) * G; i++) {
            int64_t d = by_owned[i], fd = sel_i(Pe[d] == 0, free_D[d], 0);
            int win = fd > b_free;
            b_free = sel_i(win, fd, b_free);
            d_best = sel_i(win, d, d_best);
        }
        P[be * D + d_best] = 1;
        h[be * N + bn] += 1;
        v[be * N + bn] = F[be * N + bn] / h[be * N + bn];
        free_D[d_best] -= 1;
        reps[d_best * m + (m - 1 - free_D[d_best])] = be;
        if (free_D[d_best] > 0) {
            hf[be * N + bn] += 1;
        } else { /* d_best is full: no longer an open rank of node bn for anything */
            nfree[bn] -= 1;
            for (int64_t i = own_start[d_best]; i < own_start[d_best + 1]; i++) hf[own[i] * N + bn] -= 1;
            for (int64_t i = 0; i < m - 1; i++) hf[reps[d_best * m + i] * N + bn] -= 1;
        }
        joint_best(be, N, v, nfree, hf, best_n, best_v);
        group_redo(best_v, group_v, group_e, be / JOINT_GROUP);
        if (!repl[be]) {
            repl[be] = 1;
            if (++n_repl == t) { /* from now on only the replicated experts take holders */
                for (int64_t e = 0; e < E; e++) if (!repl[e]) best_v[e] = -INFINITY;
                for (int64_t g = 0; g < groups; g++) group_redo(best_v, group_v, group_e, g);
            }
        }
    }
    return 0;
}

static PyObject *materialize_joint(PyObject *self, PyObject *args) {
    unsigned long long owner, tokens;
    Py_buffer place;
    long long E, D, G, t, m;
    double stop;
    if (!PyArg_ParseTuple(args, "KKw*LLLLLd", &owner, &tokens, &place, &E, &D, &G, &t, &m, &stop)) return NULL;
    PyObject *out = NULL;
    int64_t node_D[MAX_D];
    if (check_owner(PTR(int64_t, owner), E, D) || node_ids(node_D, D, G) || check_len(&place, E * D, "placement"))
        goto done;
    char *scratch = scratch_get(SCRATCH_CORE, joint_scratch(E, D, D / G, m < 0 ? 0 : m));
    if (!scratch) goto done;
    memset(place.buf, 0, (size_t)(E * D));
    if (joint_core(PTR(int64_t, owner), PTR(double, tokens), node_D, place.buf, E, D, D / G, t, m, stop, scratch))
        goto done;
    out = Py_None;
    Py_INCREF(out);
done:
    scratch_trim();
    PyBuffer_Release(&place);
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * Who holds what: holder_E[e] = the single holder, or -1 for the X replicated experts (rep,
 * ascending); sum_E[e] = expert e's tokens (sum_E NULL: not summed). Raises if an expert has no
 * holder or a count is negative.
 */
static int64_t holders(const uint8_t *P, const int64_t *T, int64_t E, int64_t D, int64_t *holder_E, int64_t *rep,
                       int64_t *sum_E) {
    int64_t X = 0, any = 0;
    if (!sum_E)
        for (int64_t i = 0; i < E * D; i++) any |= T[i]; /* any sign bit */
    else
        for (int64_t e = 0; e < E; e++) { /* one pass over the tokens: each row's sum, any sign bit */
            int64_t sum = 0, or = 0;
            for (int64_t d = 0; d < D; d++) { sum += T[e * D + d]; or |= T[e * D + d]; }
            sum_E[e] = sum;
            any |= or;
        }
    if (any < 0)
        for (int64_t i = 0; i < E * D; i++)
            if (T[i] < 0) {
                PyErr_Format(PyExc_ValueError, "tokens_ED[%lld, %lld] = %lld is negative", (long long)(i / D),
                             (long long)(i % D), (long long)T[i]);
                return -1;
            }
    for (int64_t e = 0; e < E; e++) {
        int64_t nh = 0, at = -1; /* at: the first holder's rank */
        const uint8_t *p = P + e * D;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) { /* 8 ranks at a time: the bytes that are not 0 */
            uint64_t w;
            memcpy(&w, p + d, 8);
            uint64_t nz = ((((w & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | w) & 0x8080808080808080ULL);
            nh += (int64_t)(((nz >> 7) * 0x0101010101010101ULL) >> 56); /* one bit per nonzero byte */
            at = sel_i((at < 0) & (nz != 0), d + __builtin_ctzll(nz | 1ULL << 63) / 8, at);
        }
        for (; d < D; d++) { if (p[d] && at < 0) at = d; nh += p[d] != 0; }
        if (nh == 0) {
            PyErr_Format(PyExc_ValueError, "every expert needs at least one holder in placement_ED (expert %lld has "
                         "none)", (long long)e);
            return -1;
        }
        holder_E[e] = nh == 1 ? at : -1;
        if (nh > 1) rep[X++] = e;
    }
    return X;
}

/* ---------------------------------------------------------------------------------------------
 * Algorithm 3 (paper dispatch): local, same node, all holders, even split with the remainder to
 * the holders following the source cyclically.
 */
/* The flows of the replicated experts (single-holder experts need none: all their tokens go to
 * the holder), counted, and written into fl unless it is NULL (fl has room for them: the count
 * of a first call with NULL). Returns the count. */
static int64_t paper_core(const uint8_t *P, const int64_t *T, const int64_t *node_D, const int64_t *rep, int64_t X,
                          int64_t D, Flows *fl) {
    int64_t all[MAX_D], lo[MAX_D + 1];
    int64_t N = node_D[D - 1] + 1, count = 0;
    for (int64_t x = 0; x < X; x++) {
        int64_t e = rep[x];
        const uint8_t *hold = P + e * D;
        int64_t n_all = holders_by_node(hold, D, N, all, lo);
        for (int64_t d = 0; d < D; d++) {
            int64_t c = T[e * D + d];
            if (c == 0) continue;
            if (hold[d]) {
                if (fl) flows_put(fl, x, d, d, c);
                count++;
                continue;
            }
            /* targets: holders in d's node (ascending), else all holders; q each, and one more
               for the r that follow d cyclically */
            int64_t nd = node_D[d], n = lo[nd + 1] - lo[nd];
            const int64_t *targets = n ? all + lo[nd] : all;
            if (!n) n = n_all;
            count += c < n ? c : n; /* the targets with a token */
            if (!fl) continue;
            int64_t q, r, first = 0;
            if (c <= UINT32_MAX) { /* c > 0: the same quotient, by a faster division */
                q = (uint32_t)c / (uint32_t)n;
                r = (uint32_t)c % (uint32_t)n;
            } else {
                q = c / n;
                r = c % n;
            }
            while (first < n && targets[first] < d) first++;
            if (first == n) first = 0;
            if (q) { /* target i is (i - first) mod n places after d's first */
                for (int64_t i = 0; i < n; i++)
                    flows_put(fl, x, targets[i], d, q + ((i >= first ? i - first : i - first + n) < r));
            } else { /* r = c targets take one token each: first .. first + r - 1 cyclically, ascending */
                for (int64_t i = 0; i < first + r - n; i++) flows_put(fl, x, targets[i], d, 1);
                for (int64_t i = first; i < first + r && i < n; i++) flows_put(fl, x, targets[i], d, 1);
            }
        }
    }
    return count;
}

/* ---------------------------------------------------------------------------------------------
 * Balancing dispatch (balance.py): fixed single-holder experts, the Hall bound, a greedy fill
 * under the cap, then augmenting paths (same node first), growing the cap if needed.
 */
typedef struct {
    int64_t X, D, G;         /* G ranks per node: nodes are contiguous blocks (Topology) */
    const int64_t *rep;      /* [X] expert ids */
    const uint8_t *P;        /* [E*D] */
    const int64_t *node_D;
    int64_t *rows;           /* [D] */
    int64_t cap;
    int64_t *flow;           /* [X*D*D] flows of replicated expert x into holder h from source d */
    int64_t *inflow;         /* [X*D] sources with a positive flow of x into h */
    int64_t *rem;            /* [X*D] */
    int64_t *holders;        /* [X*D]: row x lists the holders of x, ascending */
    int64_t *nholders;       /* [X] */
    int64_t *hs;             /* [X*(N+1)]: holders of x in node n are holders[x][hs[x, n] : hs[x, n + 1]] */
    int64_t *held, *held_start; /* the replicated experts rank h holds, ascending: held[held_start[h] :
                                   held_start[h + 1]] */
    int64_t N;
    int64_t rem_total;       /* sum of rem */
    int64_t *touched, ntouched, touched_cap; /* (x, h, d) of cells of flow that became positive
                                                 (maybe again), packed: x << 32 | h << 16 | d */
} Fill;

static inline int64_t room(const Fill *f, int64_t h) { return f->cap - f->rows[h]; }

/* Holder-major, so a search scanning the sources that send into holder h reads one row. */
#define FLOW(f, x, d, h) ((f)->flow[((x) * (f)->D + (h)) * (f)->D + (d)])
#define HOLDERS(f, x) ((f)->holders + (x) * (f)->D)
#define HS(f, x, n) ((f)->hs[(x) * ((f)->N + 1) + (n)])

/* Rebuild the touched list from the positive cells (when it is full: a cell went to 0 and back
 * more often than there are cells). */
static void fill_retouch(Fill *f) {
    f->ntouched = 0;
    for (int64_t x = 0; x < f->X; x++)
        for (int64_t h = 0; h < f->D; h++)
            for (int64_t d = 0; d < f->D; d++)
                if (FLOW(f, x, d, h)) f->touched[f->ntouched++] = x << 32 | h << 16 | d;
}

static inline void fill_move(Fill *f, int64_t x, int64_t d, int64_t h, int64_t k) {
    int64_t *cell = &FLOW(f, x, d, h);
    int fresh = *cell == 0 && k > 0;
    f->inflow[x * f->D + h] += fresh - (*cell > 0 && *cell + k == 0);
    if (fresh) {
        if (f->ntouched == f->touched_cap) fill_retouch(f);
        f->touched[f->ntouched++] = x << 32 | h << 16 | d;
    }
    *cell += k;
    f->rows[h] += k;
}

/* k of source d's tokens of x left to place go to holder h. */
static inline void fill_take(Fill *f, int64_t x, int64_t d, int64_t h, int64_t k) {
    fill_move(f, x, d, h, k);
    f->rem[x * f->D + d] -= k;
    f->rem_total -= k;
}

/* Source d's tokens of x left to place go to holders H[lo : hi] of x, the one with the most room
 * first, while any has room. */
static void fill_most_room(Fill *f, int64_t x, int64_t d, int64_t lo, int64_t hi) {
    const int64_t *H = HOLDERS(f, x);
    int64_t *left = &f->rem[x * f->D + d];
    while (*left) {
        int64_t best = -1, best_room = INT64_MIN;
        for (int64_t i = lo; i < hi; i++) { /* branch-free: the first with the most room */
            int64_t r = room(f, H[i]);
            int win = r > best_room;
            best = win ? H[i] : best;
            best_room = win ? r : best_room;
        }
        if (best < 0 || best_room <= 0) break;
        fill_take(f, x, d, best, *left < best_room ? *left : best_room);
    }
}

/* Bit i set where a[i] != 0, for i < n <= 64 (the work left, found without a branch per entry). */
static inline uint64_t nonzero_bits(const int64_t *a, int64_t n) {
    uint64_t bits = 0;
    for (int64_t i = 0; i < n; i++) bits |= (uint64_t)(a[i] != 0) << i;
    return bits;
}

static void fill_greedy(Fill *f, const int64_t *order) {
    int64_t D = f->D;
    for (int64_t oi = 0; oi < f->X; oi++) {
        int64_t x = order[oi];
        const int64_t *H = HOLDERS(f, x);
        for (int64_t i = 0; i < f->nholders[x]; i++) { /* a holder keeps its own tokens */
            int64_t h = H[i], r = room(f, h), k = f->rem[x * D + h];
            if (r < 0) r = 0;
            if (k > r) k = r;
            if (k) fill_take(f, x, h, h, k);
        }
        for (int64_t n = 0; n < f->N; n++) { /* then the holders in the source's node (nodes apart) */
            int64_t lo = HS(f, x, n), hi = HS(f, x, n + 1), end = (n + 1) * f->G;
            if (hi == lo) continue;
            for (int64_t b = n * f->G; b < end; b += 64) /* the sources with tokens left, ascending */
                for (uint64_t live = nonzero_bits(f->rem + x * D + b, end - b < 64 ? end - b : 64); live;
                     live &= live - 1)
                    fill_most_room(f, x, b + __builtin_ctzll(live), lo, hi);
        }
    }
}

typedef struct {
    int64_t *prev_x, *prev_d, *prev_h, *queue, *unseen_X, *unseen_XN, qt; /* unseen holders of x (in node n) */
    uint8_t *seen;
} Search;

static inline void reach(Fill *f, Search *s, int64_t h, int64_t x, int64_t d, int64_t from) {
    s->seen[h] = 1;
    int64_t n = f->node_D[h];
    for (int64_t i = f->held_start[h]; i < f->held_start[h + 1]; i++) {
        int64_t y = f->held[i];
        s->unseen_X[y] -= 1;
        s->unseen_XN[y * f->N + n] -= 1;
    }
    s->prev_x[h] = x; s->prev_d[h] = d; s->prev_h[h] = from;
    s->queue[s->qt++] = h;
}

/* Enqueue the unseen holders of x reached through source d (from holder `from`, or -1 for a
 * start): those in d's node, then (cross) the others, each ascending. */
static inline void reach_holders(Fill *f, Search *s, int64_t x, int64_t d, int64_t from, int tier) {
    const int64_t *H = HOLDERS(f, x);
    int64_t n = f->node_D[d], lo = HS(f, x, n), hi = HS(f, x, n + 1);
    if (tier == 0) {
        for (int64_t i = lo; i < hi; i++) if (!s->seen[H[i]]) reach(f, s, H[i], x, d, from);
    } else {
        for (int64_t i = 0; i < lo; i++) if (!s->seen[H[i]]) reach(f, s, H[i], x, d, from);
        for (int64_t i = hi; i < f->nholders[x]; i++) if (!s->seen[H[i]]) reach(f, s, H[i], x, d, from);
    }
}

/* Augmenting paths, breadth first over holders (same-node edges first; `cross` = 0: only
 * same-node edges). Every holder with room the search reaches ends a path (it is not searched
 * past): the path is pushed with its bottleneck, if earlier pushes in this search left it one.
 * Returns 1 if anything was pushed. */
static int fill_augment(Fill *f, int cross, Search *s) {
    int64_t D = f->D, X = f->X, G = f->G;
    int64_t qh = 0;
    int pushed = 0;
    s->qt = 0;
    memset(s->seen, 0, (size_t)D);
    for (int64_t x = 0; x < X; x++) {
        s->unseen_X[x] = f->nholders[x];
        for (int64_t n = 0; n < f->N; n++) s->unseen_XN[x * f->N + n] = HS(f, x, n + 1) - HS(f, x, n);
    }
    int tiers = cross ? 2 : 1;
    for (int tier = 0; tier < tiers; tier++)
        for (int64_t i = 0; i < X * D; i += 4) { /* most sources are done: skip them 4 at a time */
            const int64_t *r = f->rem + i;
            int64_t n = X * D - i < 4 ? X * D - i : 4;
            if (n == 4 && !(r[0] | r[1] | r[2] | r[3])) continue;
            for (int64_t j = i; j < i + n; j++) if (f->rem[j]) reach_holders(f, s, j / D, j % D, -1, tier);
        }
    while (qh < s->qt) {
        int64_t h = s->queue[qh++];
        if (room(f, h) > 0) {
            /* walk back: find the start, then the bottleneck */
            int64_t end = h, cur = h, x0 = -1, d0 = -1;
            int64_t k = room(f, end);
            while (cur >= 0) {
                int64_t b = s->prev_h[cur];
                if (b < 0) { x0 = s->prev_x[cur]; d0 = s->prev_d[cur]; }
                else {
                    int64_t fl = FLOW(f, s->prev_x[cur], s->prev_d[cur], b);
                    if (fl < k) k = fl;
                }
                cur = b;
            }
            if (f->rem[x0 * D + d0] < k) k = f->rem[x0 * D + d0];
            if (k <= 0) continue;
            for (cur = end; s->prev_h[cur] >= 0; cur = s->prev_h[cur]) { /* each edge moves k along */
                int64_t b = s->prev_h[cur], x = s->prev_x[cur], d = s->prev_d[cur];
                fill_move(f, x, d, b, -k);
                fill_move(f, x, d, cur, k);
            }
            fill_take(f, x0, d0, cur, k); /* and the start places k more */
            pushed = 1;
            if (!f->rem_total) return 1;
            continue;
        }
        /* Tokens of x on h from source d may move to another holder of x: sources ascending,
           each reaching its node's holders, then (cross) the rest. With cross, the first source
           reaches every holder of x; without, the first source of each node reaches all the
           holders that node can. */
        for (int64_t i = f->held_start[h]; i < f->held_start[h + 1]; i++) { /* x held by h */
            int64_t x = f->held[i];
            if (!s->unseen_X[x] || !f->inflow[x * D + h]) continue;
            const int64_t *in = &FLOW(f, x, 0, h);
            if (cross) {
                int64_t d = 0;
                while (!in[d]) d++;
                reach_holders(f, s, x, d, h, 0);
                reach_holders(f, s, x, d, h, 1);
                continue;
            }
            for (int64_t n = 0; n < f->N && s->unseen_X[x]; n++) {
                if (!s->unseen_XN[x * f->N + n]) continue;
                for (int64_t d = n * G; d < (n + 1) * G; d++)
                    if (in[d]) { reach_holders(f, s, x, d, h, 0); break; }
            }
        }
    }
    return pushed;
}

/* Tokens left go straight to the holder with the most room, in any node (one-edge paths). */
static void fill_direct_cross(Fill *f) {
    for (int64_t x = 0; x < f->X; x++)
        for (int64_t d = 0; d < f->D; d++) fill_most_room(f, x, d, 0, f->nholders[x]);
}

#define EXACT_SETS 10 /* all subsets of the replicated experts up to this many */

/* a[T] becomes the sum of a over the subsets of T (M = 2^bits entries). */
static void subset_sums(int64_t *a, int64_t M) {
    int64_t b = 1;
    if (M >= 4) { /* the two lowest bits by blocks of 4 */
        for (int64_t j = 0; j < M; j += 4) {
            int64_t a0 = a[j], a1 = a[j + 1], a2 = a[j + 2], a3 = a[j + 3];
            a[j + 1] = a0 + a1;
            a[j + 2] = a0 + a2;
            a[j + 3] = a0 + a1 + a2 + a3;
        }
        b = 4;
    }
    for (; b < M; b <<= 1) /* each T with bit b gains T without it */
        for (int64_t T = 0; T < M; T += 2 * b)
            for (int64_t j = T; j < T + b; j++) a[j + b] += a[j];
}

/* Lower bound on the most loaded rank's rows (balance.row_bound): integer sums, one division
 * per set in doubles, as the reference. */
static double row_bound(const Fill *f, const int64_t *load_X, const int64_t *base_D, char *scratch) {
    int64_t X = f->X, D = f->D;
    double bound = 0, sum = 0;
    for (int64_t d = 0; d < D; d++) { if (base_D[d] > bound) bound = (double)base_D[d]; sum += (double)base_D[d]; }
    for (int64_t x = 0; x < X; x++) sum += (double)load_X[x];
    if (sum / D > bound) bound = sum / D;
    if (X == 0) return bound;
    if (X <= EXACT_SETS) {
        /* A rank is a holder of set S unless the replicated experts it holds (mask_d) avoid S:
           with g[T] = base (and number) of the ranks whose mask_d lies inside T (a subset-sum
           transform over the 2^X masks), S's holders carry base total - g[~S] and number
           D - cnt[~S]. Load sums grow one expert at a time (a set = a smaller set + its lowest
           expert). Each set's ratio is divided in doubles, as the reference divides. */
        int64_t M = (int64_t)1 << X, full = M - 1;
        int64_t *g = (int64_t *)scratch, *cnt = g + M, *lsum = cnt + M, *mask_D = lsum + M;
        memset(g, 0, sizeof(int64_t) * (size_t)(2 * M));
        memset(mask_D, 0, sizeof(int64_t) * (size_t)D);
        for (int64_t x = 0; x < X; x++)
            for (int64_t i = 0; i < f->nholders[x]; i++) mask_D[HOLDERS(f, x)[i]] |= (int64_t)1 << x;
        int64_t base_total = 0;
        for (int64_t d = 0; d < D; d++) base_total += base_D[d];
        /* base and number in one word when they fit (number < 2^13 as D <= MAX_D) */
        int packed = base_total < ((int64_t)1 << 49);
        for (int64_t d = 0; d < D; d++) {
            g[mask_D[d]] += packed ? (base_D[d] << 13) + 1 : base_D[d];
            if (!packed) cnt[mask_D[d]] += 1;
        }
        subset_sums(g, M);
        if (!packed) subset_sums(cnt, M);
        double best = 0;
        lsum[0] = 0;
        for (int64_t S = 1; S < M; S++) {
            int64_t low = __builtin_ctzll((unsigned long long)S), gs = g[full ^ S];
            int64_t l = lsum[S & (S - 1)] + load_X[low];
            lsum[S] = l;
            int64_t base = packed ? gs >> 13 : gs, c = packed ? gs & 8191 : cnt[full ^ S];
            double r = (double)(l + base_total - base) / (double)(D - c);
            best = r > best ? r : best;
        }
        if (best > bound) bound = best;
    } else {
        /* singletons and the hottest prefixes (stable order by load, descending) */
        int64_t *order = (int64_t *)scratch;
        uint8_t *in = (uint8_t *)(order + X);
        for (int64_t x = 0; x < X; x++) order[x] = x;
        for (int64_t i = 1; i < X; i++) {
            int64_t v = order[i], j = i - 1;
            while (j >= 0 && load_X[order[j]] < load_X[v]) { order[j + 1] = order[j]; j--; }
            order[j + 1] = v;
        }
        memset(in, 0, (size_t)X);
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t i = 0; i < X; i++) {
                if (pass == 0) { memset(in, 0, (size_t)X); in[i] = 1; } else in[order[i]] = 1;
                int64_t num = 0, cnt = 0;
                for (int64_t x = 0; x < X; x++) if (in[x]) num += load_X[x];
                for (int64_t d = 0; d < D; d++) {
                    int reach = 0;
                    for (int64_t x = 0; x < X && !reach; x++) if (in[x] && f->P[f->rep[x] * D + d]) reach = 1;
                    if (reach) { num += base_D[d]; cnt++; }
                }
                if ((double)num / (double)cnt > bound) bound = (double)num / (double)cnt;
            }
            memset(in, 0, (size_t)X);
        }
    }
    return bound;
}

static size_t bound_scratch(int64_t X, int64_t D) {
    if (X <= EXACT_SETS) return sizeof(int64_t) * (size_t)(((int64_t)1 << X) * 3 + D);
    return sizeof(int64_t) * (size_t)X + (size_t)X;
}

/* holder_E / rep / X from holders(); the flows with tokens into fl. Returns 0, or -1 with
 * MemoryError set. */
static int balanced_core(const uint8_t *P, const int64_t *T, const int64_t *node_D, const int64_t *holder_E,
                         const int64_t *rep, const int64_t *sum_E, int64_t X, int64_t E, int64_t D, double slack,
                         Flows *fl) {
    if (X == 0) return 0;
    int64_t rows[MAX_D + 1]; /* rows per rank: the single-holder experts' (the base) until the fill */
    memset(rows, 0, sizeof(int64_t) * (size_t)(D + 1));
    for (int64_t e = 0; e < E; e++) { /* branch-free: a replicated expert's sum lands in rows[D] */
        int64_t h = holder_E[e];
        rows[h < 0 ? D : h] += sum_E[e];
    }
    int64_t N = node_D[D - 1] + 1;
    int64_t cells = X * D * D, touched_cap = 2 * cells;
    size_t ints = (size_t)(X + X * D + X * D + X * D + X + X + 4 * D + X + X * (N + 1) + X * N + X * D + D + 1);
    size_t bytes = sizeof(int64_t) * ints + (size_t)D + 8 + bound_scratch(X, D);
    char *mem = scratch_get(SCRATCH_CORE, bytes);
    int64_t *touched = scratch_get(SCRATCH_TOUCHED, sizeof(int64_t) * (size_t)touched_cap);
    int64_t *flows = scratch_zeroed(sizeof(int64_t) * (size_t)cells); /* [x, holder h, source d] */
    if (!mem || !touched || !flows) return -1;
    int64_t *load_X = (int64_t *)mem, *inflow = load_X + X, *rem = inflow + X * D, *hold = rem + X * D;
    int64_t *nhold = hold + X * D, *order = nhold + X, *hs = order + X;
    Search s;
    s.prev_x = hs + X * (N + 1); s.prev_d = s.prev_x + D; s.prev_h = s.prev_d + D; s.queue = s.prev_h + D;
    s.unseen_X = s.queue + D;
    s.unseen_XN = s.unseen_X + X;
    int64_t *held = s.unseen_XN + X * N, *held_start = held + X * D;
    s.seen = (uint8_t *)(held_start + D + 1);
    char *bound_mem = (char *)(s.seen + D);
    bound_mem += (8 - ((uintptr_t)bound_mem & 7)) & 7; /* aligned: the + 8 above */
    /* zero what is summed into (the rest is written before it is read) */
    memset(inflow, 0, sizeof(int64_t) * (size_t)(X * D));
    memset(held_start, 0, sizeof(int64_t) * (size_t)(D + 1));
    memset(s.queue, 0, sizeof(int64_t) * (size_t)D);
    Fill f;
    f.X = X; f.D = D; f.N = N; f.G = D / N; f.rep = rep; f.P = P; f.node_D = node_D;
    f.rows = rows; f.flow = flows; f.inflow = inflow; f.rem = rem; f.holders = hold; f.nholders = nhold; f.hs = hs;
    f.rem_total = 0;
    f.touched = touched; f.ntouched = 0; f.touched_cap = touched_cap;
    for (int64_t x = 0; x < X; x++) {
        int64_t e = rep[x];
        memcpy(rem + x * D, T + e * D, sizeof(int64_t) * (size_t)D);
        load_X[x] = sum_E[e];
        f.rem_total += load_X[x];
        nhold[x] = holders_by_node(P + e * D, D, N, hold + x * D, hs + x * (N + 1));
        for (int64_t i = 0; i < nhold[x]; i++) held_start[hold[x * D + i] + 1]++;
    }
    for (int64_t d = 0; d < D; d++) held_start[d + 1] += held_start[d];
    for (int64_t x = 0; x < X; x++) /* x ascending, so each rank's list is too */
        for (int64_t i = 0; i < nhold[x]; i++) {
            int64_t d = hold[x * D + i];
            held[held_start[d] + s.queue[d]++] = x; /* queue: a per-rank cursor until the searches */
        }
    f.held = held; f.held_start = held_start;
    f.cap = (int64_t)ceil(row_bound(&f, load_X, rows, bound_mem) * (1.0 + slack) - 1e-9);
    /* order: fewest holders, then most tokens, then id */
    for (int64_t x = 0; x < X; x++) order[x] = x;
    for (int64_t i = 1; i < X; i++) {
        int64_t v = order[i], j = i - 1;
        while (j >= 0) {
            int64_t u = order[j];
            int later = nhold[u] > nhold[v] || (nhold[u] == nhold[v] && load_X[u] < load_X[v]);
            if (!later) break;
            order[j + 1] = u; j--;
        }
        order[j + 1] = v;
    }
    fill_greedy(&f, order);
    while (f.rem_total && fill_augment(&f, 0, &s)) {}
    fill_direct_cross(&f);
    while (f.rem_total) {
        if (!fill_augment(&f, 1, &s)) {
            int64_t grown = (int64_t)ceil((double)f.cap * 1.01);
            f.cap = grown > f.cap + 1 ? grown : f.cap + 1;
        }
    }
    /* The positive cells out (each once: a cell is cleared as it is read, so a repeat in the
       list finds 0), which leaves the dense array zero for the next call, even if the flows
       cannot grow. Each cell is written at n and kept (n advances) when positive. */
    int failed = flows_reserve(fl, fl->n + f.ntouched);
    int64_t n = fl->n;
    for (int64_t i = 0; i < f.ntouched; i++) {
        int64_t x = touched[i] >> 32, h = touched[i] >> 16 & 0xffff, d = touched[i] & 0xffff;
        int64_t *cell = &FLOW(&f, x, d, h), k = *cell;
        *cell = 0;
        if (failed) continue;
        fl->col[0][n] = x; fl->col[1][n] = h; fl->col[2][n] = d; fl->col[3][n] = k;
        n += k != 0;
    }
    if (!failed) fl->n = n;
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * The layer schedule under concurrent costs (ds_fssdp/planner/schedule.py: pipeline_times and
 * choose_degrees): the same operations in the same order, so the same doubles. A load is six
 * doubles (schedule.LOAD_COLUMNS: intra, inter, local, remote, side, relay); the costs seven
 * (intra-node startup and rate, inter-node startup and rate, GEMM startup and rate, backward factor).
 */
static inline double lin(const double *c, double u) { return u <= 0 ? 0.0 : c[0] + c[1] * u; }
static inline double dmax(double a, double b) { return a >= b ? a : b; }

/* One direction of one load at degree n (schedule._one_hop_times, _relay_times, _pipeline);
 * scratch: 5n doubles. */
static double load_time(const double *c, const double *ld, int64_t n, int backward, double *scratch) {
    double f = backward ? c[6] : 1.0, intra = ld[0], inter = ld[1], local = ld[2], remote = ld[3], side = ld[4],
           relay = ld[5], dn = (double)n;
    if (n == 1)
        return 2.0 * dmax(lin(c, intra), lin(c + 2, inter)) + f * lin(c + 4, local + remote) + f * lin(c + 4, side) +
               0.0 + 2.0 * lin(c + 2, relay);
    double g = f * lin(c + 4, remote / dn), s = f * lin(c + 4, side), compute = f * lin(c + 4, local);
    if (relay > 0) { /* two hops: relay_order's R, I, C, J, Q (kinds 0-4) on the node link, rank link, compute */
        static const int res[5] = {0, 1, 2, 1, 0};
        double r = lin(c + 2, relay / dn), x = lin(c, intra / dn), dur[5] = {r, x, g, x, r};
        double free_[3] = {r * 0.0, r * 0.0, compute}, *ended = scratch; /* ended[kind * n + chunk] */
#define STEP(kind, j)                                                                                  \
    do {                                                                                               \
        double st_ = free_[res[kind]];                                                                 \
        if (kind) st_ = dmax(st_, ended[((kind) - 1) * n + (j)]);                                      \
        ended[(kind) * n + (j)] = free_[res[kind]] = st_ + dur[kind];                                  \
    } while (0)
        STEP(0, 0);
        for (int64_t t = 0; t < n + 2; t++) {
            if (t < n) {
                if (t + 1 < n) STEP(0, t + 1);
                STEP(1, t);
            }
            if (t >= 1 && t <= n) {
                STEP(2, t - 1);
                STEP(3, t - 1);
            }
            if (t >= 2) STEP(4, t - 2);
        }
#undef STEP
        double tail = dmax(free_[2], ended[3 * n + n - 1]);
        return dmax(free_[0], tail + s);
    }
    /* one hop: the links run d1, then d_i and c_(i-1) for i = 2..n, then c_n (_link_order) */
    double x = dmax(lin(c, intra / dn), lin(c + 2, inter / dn)), link = x * 0.0, *done_d = scratch;
    int64_t gi = 1;
    for (int64_t i = 1; i <= n + 1; i++) {
        if (i <= n) {
            link = link + x;
            done_d[i] = link;
        }
        if (i >= 2) { /* combine i - 1 once chunk i - 1 is computed */
            for (; gi <= i - 1; gi++) compute = dmax(compute, done_d[gi]) + g;
            link = dmax(link, compute) + x;
        }
    }
    return dmax(link, compute + s);
}

/* Two doubles for relay_times4, with the scalar operations it needs, lane by lane: SSE2 where
 * the compiler has it, else a pair (the same IEEE operations either way). */
#ifdef __SSE2__
typedef __m128d v2;
static inline v2 v_set(double lo, double hi) { return _mm_set_pd(hi, lo); }
static inline v2 v_all(double a) { return _mm_set1_pd(a); }
static inline v2 v_add(v2 a, v2 b) { return _mm_add_pd(a, b); }
static inline v2 v_mul(v2 a, v2 b) { return _mm_mul_pd(a, b); }
static inline v2 v_div(v2 a, v2 b) { return _mm_div_pd(a, b); }
static inline v2 v_max(v2 a, v2 b) { /* dmax: a >= b ? a : b */
    v2 m = _mm_cmpge_pd(a, b);
    return _mm_or_pd(_mm_and_pd(m, a), _mm_andnot_pd(m, b));
}
static inline v2 v_lin(const double *c, v2 u) { /* lin: u <= 0 ? 0.0 : c[0] + c[1] * u */
    return _mm_andnot_pd(_mm_cmple_pd(u, _mm_setzero_pd()), _mm_add_pd(_mm_set1_pd(c[0]), _mm_mul_pd(_mm_set1_pd(c[1]), u)));
}
static inline void v_store(double *out, v2 a) { _mm_storeu_pd(out, a); }
#else
typedef struct { double l[2]; } v2;
static inline v2 v_set(double lo, double hi) { return (v2){{lo, hi}}; }
static inline v2 v_all(double a) { return (v2){{a, a}}; }
static inline v2 v_add(v2 a, v2 b) { return (v2){{a.l[0] + b.l[0], a.l[1] + b.l[1]}}; }
static inline v2 v_mul(v2 a, v2 b) { return (v2){{a.l[0] * b.l[0], a.l[1] * b.l[1]}}; }
static inline v2 v_div(v2 a, v2 b) { return (v2){{a.l[0] / b.l[0], a.l[1] / b.l[1]}}; }
static inline v2 v_max(v2 a, v2 b) { return (v2){{dmax(a.l[0], b.l[0]), dmax(a.l[1], b.l[1])}}; }
static inline v2 v_lin(const double *c, v2 u) { return (v2){{lin(c, u.l[0]), lin(c, u.l[1])}}; }
static inline void v_store(double *out, v2 a) { out[0] = a.l[0]; out[1] = a.l[1]; }
#endif

/* load_time of four loads whose relay is > 0 at one degree n > 1: the same operations for each, the
 * four side by side (one load's steps wait on each other, four loads' do not). ended[kind][chunk]
 * is read only at the chunk of the kind before it, so rolling values replace the array. */
#define LANES(stmt) for (int l = 0; l < 2; l++) { stmt; }
static void relay_times4(const double *c, const double *const ld[4], int64_t n, int backward, double out[4]) {
    v2 f = v_all(backward ? c[6] : 1.0), dn = v_all((double)n), zero = v_all(0.0);
    v2 r[2], x[2], g[2], s[2], f0[2], f1[2], f2[2], e0[2], e1[2], e1p[2], e2[2], e3[2], e3p[2];
#define COL(l, k) v_set(ld[2 * (l)][k], ld[2 * (l) + 1][k])
    LANES(g[l] = v_mul(f, v_lin(c + 4, v_div(COL(l, 3), dn))); s[l] = v_mul(f, v_lin(c + 4, COL(l, 4)));
          f2[l] = v_mul(f, v_lin(c + 4, COL(l, 2))); r[l] = v_lin(c + 2, v_div(COL(l, 5), dn));
          x[l] = v_lin(c, v_div(COL(l, 0), dn)); f0[l] = f1[l] = v_mul(r[l], zero); e1[l] = e3[l] = zero)
#undef COL
    LANES(e0[l] = f0[l] = v_add(f0[l], r[l])) /* R of chunk 0 */
    for (int64_t t = 0; t < n + 2; t++) {
        LANES(e1p[l] = e1[l]; e3p[l] = e3[l])
        if (t < n) {
            if (t + 1 < n) { /* R of chunk t + 1, then I of chunk t (after its R, e0) */
                LANES(v2 st = v_max(f1[l], e0[l]); e0[l] = f0[l] = v_add(f0[l], r[l]); e1[l] = f1[l] = v_add(st, x[l]))
            } else {
                LANES(e1[l] = f1[l] = v_add(v_max(f1[l], e0[l]), x[l]))
            }
        }
        if (t >= 1 && t <= n) { /* C and J of chunk t - 1 */
            LANES(e2[l] = f2[l] = v_add(v_max(f2[l], e1p[l]), g[l]); e3[l] = f1[l] = v_add(v_max(f1[l], e2[l]), x[l]))
        }
        if (t >= 2) LANES(f0[l] = v_add(v_max(f0[l], e3p[l]), r[l])) /* Q of chunk t - 2 */
    }
    LANES(v2 tail = v_max(f2[l], e3[l]); v_store(out + 2 * l, v_max(f0[l], v_add(tail, s[l]))))
}
#undef LANES

/* ---------------------------------------------------------------------------------------------
 * Entry points.
 */

/* Either dispatch's holders (holder_E, rep, and for the balanced one sum_E: scratch of 3E + 1) and
 * node_D. Returns X, or -1 with an error set. */
static int64_t dispatch_holders(const uint8_t *P, const int64_t *T, int64_t E, int64_t D, int64_t G, int balanced,
                                int64_t **holder_E, int64_t *node_D) {
    *holder_E = scratch_get(SCRATCH_ENTRY, sizeof(int64_t) * (size_t)(3 * E + 1));
    if (!*holder_E || check_ranks(D) || node_ids(node_D, D, G)) return -1;
    int64_t *rep = *holder_E + E;
    return holders(P, T, E, D, *holder_E, rep, balanced ? rep + E + 1 : NULL);
}

/* Either dispatch, as both entries run it: the holders, then the flows with tokens into fl
 * (SCRATCH_FLOWS). Returns X, or -1 with an error set. */
static int64_t dispatch_flows(const uint8_t *P, const int64_t *T, int64_t E, int64_t D, int64_t G, double slack,
                              int balanced, int64_t **holder_E, Flows *fl) {
    int64_t node_D[MAX_D];
    int64_t X = dispatch_holders(P, T, E, D, G, balanced, holder_E, node_D);
    if (X < 0) return -1;
    const int64_t *rep = *holder_E + E;
    flows_start(fl);
    if (balanced) return balanced_core(P, T, node_D, *holder_E, rep, rep + E + 1, X, E, D, slack, fl) ? -1 : X;
    if (flows_reserve(fl, paper_core(P, T, node_D, rep, X, D, NULL))) return -1;
    paper_core(P, T, node_D, rep, X, D, fl);
    return X;
}

/* dispatch_dense(P, T, plan, E, D, G, slack, balanced): plan [E*D*D] zeroed, filled. */
static PyObject *dispatch_dense(PyObject *self, PyObject *args) {
    unsigned long long place, tokens;
    Py_buffer plan;
    long long E, D, G;
    double slack;
    int balanced;
    if (!PyArg_ParseTuple(args, "KKw*LLLdp", &place, &tokens, &plan, &E, &D, &G, &slack, &balanced)) return NULL;
    const int64_t *T = PTR(int64_t, tokens);
    int64_t *R = plan.buf, *holder_E;
    PyObject *out = NULL;
    Flows fl;
    if (check_len(&plan, (int64_t)sizeof(int64_t) * E * D * D, "plan")) goto done;
    if (dispatch_flows(PTR(uint8_t, place), T, E, D, G, slack, balanced, &holder_E, &fl) < 0) goto done;
    const int64_t *rep = holder_E + E;
    for (int64_t e = 0; e < E; e++)
        if (holder_E[e] >= 0)
            for (int64_t d = 0; d < D; d++) R[(e * D + d) * D + holder_E[e]] = T[e * D + d];
    for (int64_t i = 0; i < fl.n; i++) R[(rep[fl.col[0][i]] * D + fl.col[2][i]) * D + fl.col[1][i]] = fl.col[3][i];
    out = Py_None;
    Py_INCREF(out);
done:
    scratch_trim();
    PyBuffer_Release(&plan);
    return out;
}

/* dispatch_compact(P, T, E, D, G, slack, balanced) -> (X, F, bytes), the bytes int64:
 * [holder_E (E), rep_X (X), tokens_ED (E*D), flows_4F (4*F): rows x, h, d, k] (the plan's arrays
 * in one buffer, so Python makes views of it and copies nothing). */
static PyObject *dispatch_compact(PyObject *self, PyObject *args) {
    unsigned long long place, tokens;
    long long E, D, G;
    double slack;
    int balanced;
    if (!PyArg_ParseTuple(args, "KKLLLdp", &place, &tokens, &E, &D, &G, &slack, &balanced)) return NULL;
    const uint8_t *P = PTR(uint8_t, place);
    const int64_t *T = PTR(int64_t, tokens);
    int64_t *holder_E, node_D[MAX_D], X, F;
    PyObject *out = NULL;
    Flows fl;
    if (balanced) {
        if ((X = dispatch_flows(P, T, E, D, G, slack, balanced, &holder_E, &fl)) < 0) goto done;
        F = fl.n;
    } else { /* the paper's flows counted, then written straight into the bytes */
        if ((X = dispatch_holders(P, T, E, D, G, balanced, &holder_E, node_D)) < 0) goto done;
        F = paper_core(P, T, node_D, holder_E + E, X, D, NULL);
    }
    const int64_t *rep = holder_E + E;
    PyObject *buf = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(int64_t) * (size_t)(E + X + E * D + 4 * F)));
    if (!buf) goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(buf), *xs = o + E + X + E * D;
    memcpy(o, holder_E, sizeof(int64_t) * (size_t)E);
    memcpy(o + E, rep, sizeof(int64_t) * (size_t)X);
    memcpy(o + E + X, T, sizeof(int64_t) * (size_t)(E * D));
    if (balanced) {
        for (int j = 0; j < 4; j++) memcpy(xs + j * F, fl.col[j], sizeof(int64_t) * (size_t)F);
    } else {
        Flows into = {{xs, xs + F, xs + 2 * F, xs + 3 * F}, 0, F};
        paper_core(P, T, node_D, rep, X, D, &into);
    }
    out = Py_BuildValue("LLN", (long long)X, (long long)F, buf); /* N: the tuple takes buf */
done:
    scratch_trim();
    return out;
}


/* Loads [R*6] and costs [7] of the schedule's entry points, checked. */
static int schedule_args(Py_buffer *loads, long long R, Py_buffer *costs, long long n) {
    if (R < 1 || n < 1) {
        PyErr_Format(PyExc_ValueError, "the schedule needs >= 1 load (%lld) and degree >= 1 (%lld)", R, n);
        return -1;
    }
    if (check_len(loads, (int64_t)sizeof(double) * 6 * R, "loads")) return -1;
    return check_len(costs, (int64_t)sizeof(double) * 7, "costs");
}

/* schedule_times(loads, costs, out, R, n, backward): out [R] = each load's one direction at degree n. */
static PyObject *schedule_times(PyObject *self, PyObject *args) {
    Py_buffer loads, costs, out;
    long long R, n;
    int backward;
    if (!PyArg_ParseTuple(args, "y*y*w*LLp", &loads, &costs, &out, &R, &n, &backward)) return NULL;
    PyObject *ret = NULL;
    double *scratch;
    if (schedule_args(&loads, R, &costs, n) || check_len(&out, (int64_t)sizeof(double) * R, "out")) goto done;
    if (!(scratch = scratch_get(SCRATCH_SCHEDULE, sizeof(double) * (size_t)(5 * n + 2)))) goto done;
    for (long long i = 0; i < R; i++)
        ((double *)out.buf)[i] = load_time(costs.buf, (const double *)loads.buf + 6 * i, n, backward, scratch);
    ret = Py_None;
    Py_INCREF(ret);
done:
    scratch_trim();
    PyBuffer_Release(&loads);
    PyBuffer_Release(&costs);
    PyBuffer_Release(&out);
    return ret;
}

/* Per direction the degree whose slowest load is fastest, a degree winning only below the best so
 * far times (1 - 1e-9) (schedule.choose_degrees); a degree stops at the first load that reaches
 * that bar. scratch: 5 max_degree + 2 doubles. times (NULL: not kept): 3R doubles, of which
 * times[backward * R + i] gets load i's time at the picked degree (a picked degree timed them all). */
static void pick_degrees(const double *c, const double *L, long long R, long long max_degree, double *scratch,
                         long long pick[2], double *times) {
    int relay = R >= 4;
    for (long long i = 0; i < R; i++) relay &= L[6 * i + 5] > 0;
    for (int backward = 0; backward < 2; backward++) {
        double pick_s = 0.0, *cur = times ? times + 2 * R : NULL, *kept = times ? times + backward * R : NULL;
        long long at = 0;
        pick[backward] = 1;
        for (long long n = 1; n <= max_degree; n++) {
            double bar = pick_s * (1.0 - 1e-9), s = 0.0;
            long long first = at;
            double four[4];
            for (long long k = 0; k < R; k++) {
                long long i = first + k < R ? first + k : first + k - R; /* the last degree's slowest load first */
                if (relay && n > 1 && !(k & 3)) { /* this load's and the next three's times at once */
                    const double *ld[4];
                    for (long long j = 0; j < 4; j++) {
                        long long ij = first + k + j < R ? first + k + j : first + k + j - R;
                        ld[j] = L + 6 * (k + j < R ? ij : i);
                    }
                    relay_times4(c, ld, n, backward, four);
                }
                double v = relay && n > 1 ? four[k & 3] : load_time(c, L + 6 * i, n, backward, scratch);
                if (cur) cur[i] = v;
                if (!k || v > s) {
                    s = v;
                    at = i;
                    if (n > 1 && s >= bar) break;
                }
            }
            if (n == 1 || s < bar) {
                pick[backward] = n;
                pick_s = s;
                if (cur) { /* cur becomes the kept times (swapped: kept's memory is the next cur) */
                    double *t = kept;
                    kept = cur;
                    cur = t;
                }
            }
        }
        if (kept && kept != times + backward * R) memcpy(times + backward * R, kept, sizeof(double) * (size_t)R);
    }
}

/* choose_degrees(loads, costs, R, max_degree) -> (forward, backward): pick_degrees. */
static PyObject *choose_degrees(PyObject *self, PyObject *args) {
    Py_buffer loads, costs;
    long long R, max_degree;
    if (!PyArg_ParseTuple(args, "y*y*LL", &loads, &costs, &R, &max_degree)) return NULL;
    PyObject *ret = NULL;
    double *scratch;
    if (schedule_args(&loads, R, &costs, max_degree)) goto done;
    if (!(scratch = scratch_get(SCRATCH_SCHEDULE, sizeof(double) * (size_t)(5 * max_degree + 2)))) goto done;
    long long pick[2];
    pick_degrees(costs.buf, loads.buf, R, max_degree, scratch, pick, NULL);
    ret = Py_BuildValue("LL", pick[0], pick[1]);
done:
    scratch_trim();
    PyBuffer_Release(&loads);
    PyBuffer_Release(&costs);
    return ret;
}

/* plan_traffic(holder_BE, tokens_BED, flows_4F, out, B, E, D, F, grouped): out float64 [B*D*D] = rows d sends h
 * in each of B groups (DispatchPlan.traffic_DD, sim/links.traffic_BNN): each single-holder expert's tokens to its
 * holder, and the flows (rows x or b, h, d, k: the group b when grouped, else 0); integer sums, exact in doubles.
 * Summed as int64 by holder (acc[b][h][d]: an expert's row adds to one contiguous row) and written out transposed:
 * integer sums in any order are the same. */
static PyObject *plan_traffic(PyObject *self, PyObject *args) {
    Py_buffer holder, tokens, flows, out;
    long long B, E, D, F;
    int grouped;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LLLLp", &holder, &tokens, &flows, &out, &B, &E, &D, &F, &grouped))
        return NULL;
    PyObject *ret = NULL;
    double *T = out.buf;
    int64_t *acc = NULL;
    const int64_t *H = holder.buf, *K = tokens.buf, *fl = flows.buf;
    if (check_len(&holder, 8 * B * E, "holder") || check_len(&tokens, 8 * B * E * D, "tokens") ||
        check_len(&flows, 8 * 4 * F, "flows_4F") || check_len(&out, 8 * B * D * D, "out"))
        goto done;
    if (B * D * D > 0) {
        if (!(acc = scratch_get(SCRATCH_EXCHANGE, sizeof(int64_t) * (size_t)(B * D * D)))) goto done;
        memset(acc, 0, sizeof(int64_t) * (size_t)(B * D * D));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t e = 0; e < E; e++) {
            int64_t h = H[b * E + e];
            if (h >= D) goto bad;
            if (h >= 0) {
                int64_t *row = acc + (b * D + h) * D;
                const int64_t *k = K + (b * E + e) * D;
                for (int64_t d = 0; d < D; d++) row[d] += k[d];
            }
        }
    for (int64_t i = 0; i < F; i++) { /* one test per flow: a negative group or rank is a large unsigned one */
        uint64_t b = grouped ? (uint64_t)fl[i] : 0, h = (uint64_t)fl[F + i], d = (uint64_t)fl[2 * F + i];
        if ((b >= (uint64_t)B) | (h >= (uint64_t)D) | (d >= (uint64_t)D)) goto bad;
        acc[(b * D + h) * D + d] += fl[3 * F + i];
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t d = 0; d < D; d++)
            for (int64_t h = 0; h < D; h++) T[(b * D + d) * D + h] = (double)acc[(b * D + h) * D + d];
    ret = Py_None;
    Py_INCREF(ret);
    goto done;
bad:
    PyErr_SetString(PyExc_ValueError, "plan_traffic: a holder, group or flow rank out of range");
done:
    scratch_trim();
    PyBuffer_Release(&holder);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&flows);
    PyBuffer_Release(&out);
    return ret;
}

/* One group's counts for gather_links (zeroed here): count_N [N] the copies on each rank less the
 * owners', in_n / out_n [n] the chunks entering / leaving each node. (restrict: the counts do not
 * alias the placement's bytes, so the per-rank count vectorizes.) */
static void gather_counts(const int64_t *O, const uint8_t *restrict P, int64_t E, int64_t N, int64_t G, int relay,
                          int64_t *restrict count_N, int64_t *restrict in_n, int64_t *restrict out_n) {
    int64_t n = N / G;
    memset(count_N, 0, sizeof(int64_t) * (size_t)N);
    memset(in_n, 0, sizeof(int64_t) * (size_t)n);
    memset(out_n, 0, sizeof(int64_t) * (size_t)n);
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *p = P + e * N;
        int64_t home = O[e] / G, leaves = 0;
        for (int64_t d = 0; d < N; d++) count_N[d] += p[d] != 0;
        count_N[O[e]] -= p[O[e]] != 0; /* the owner's own copy is not added */
        for (int64_t m = 0; m < n; m++) {
            if (m == home) continue;
            int entered = or_bytes(p + m * G, G) != 0;
            in_n[m] += entered;
            leaves += entered;
        }
        out_n[home] += relay ? leaves > 0 : leaves;
    }
}

/* gather_links(owner_E, placement_BED, rank_BN, node_Bn, B, E, N, G, chunk_bytes, relay): the links'
 * bytes of B groups' sparse collectives (ds_fssdp/planner/prices.py gather_links: the same counts,
 * times chunk_bytes); G <= N divides N, n = N / G nodes. */
static PyObject *gather_links(PyObject *self, PyObject *args) {
    Py_buffer owner, place, rank, node;
    long long B, E, N, G;
    double chunk;
    int relay;
    if (!PyArg_ParseTuple(args, "y*y*w*w*LLLLdp", &owner, &place, &rank, &node, &B, &E, &N, &G, &chunk, &relay))
        return NULL;
    PyObject *ret = NULL;
    const int64_t *O = owner.buf;
    const uint8_t *P = place.buf;
    double *R = rank.buf, *M = node.buf;
    long long n = G >= 1 && N % G == 0 ? N / G : 0;
    int64_t *in_n, *out_n;
    if (n < 1 || n > MAX_D) {
        PyErr_Format(PyExc_ValueError, "gather_links: %lld ranks per node must divide the %lld ranks", G, N);
        goto done;
    }
    if (check_len(&owner, 8 * E, "owner_E") || check_len(&place, B * E * N, "placement_BED") ||
        check_len(&rank, 8 * B * N, "rank_BN") || check_len(&node, 8 * B * n, "node_Bn") || check_owner(O, E, N))
        goto done;
    if (!(in_n = scratch_get(SCRATCH_SCHEDULE, sizeof(int64_t) * (size_t)(2 * n + N)))) goto done;
    out_n = in_n + n;
    int64_t *count_N = out_n + n;
    for (long long b = 0; b < B; b++) {
        gather_counts(O, P + b * E * N, E, N, G, relay, count_N, in_n, out_n);
        for (long long d = 0; d < N; d++) R[b * N + d] = (double)count_N[d] * chunk;
        for (long long m = 0; m < n; m++)
            M[b * n + m] = n == 1 ? 0.0 : (double)(in_n[m] > out_n[m] ? in_n[m] : out_n[m]) * chunk;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    scratch_trim();
    PyBuffer_Release(&owner);
    PyBuffer_Release(&place);
    PyBuffer_Release(&rank);
    PyBuffer_Release(&node);
    return ret;
}

/* ---------------------------------------------------------------------------------------------
 * A layer's exchange priced (ds_fssdp/planner/onecopy.py price_exchange under concurrent costs),
 * numpy's arithmetic in numpy's order, so the same doubles: a sum along a row is numpy's pairwise
 * summation added to 0.0, a sum down rows or a bincount adds in index order, a masked array is the
 * product with a 0/1 mask, a masked division as numpy's where= leaves it. The powers (1 - p)^k come
 * from numpy (onecopy.py): its pow is SIMD where the CPU has it, not libm's.
 */

/* numpy's pairwise summation of n doubles `stride` apart (its float add reduction). */
static double pairwise(const double *a, int64_t n, int64_t stride) {
    if (n < 8) {
        double r = -0.0;
        for (int64_t i = 0; i < n; i++) r += a[i * stride];
        return r;
    }
    if (n <= 128) {
        double r[8], res;
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j * stride];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[(i + j) * stride];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i * stride];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2, stride) + pairwise(a + n2 * stride, n - n2, stride);
}

/* numpy's sum of n contiguous doubles (a row of a sum(-1), or a whole contiguous array). */
static inline double row_sum(const double *a, int64_t n) { return 0.0 + pairwise(a, n, 1); }

/* distinct_fraction's p of R rows of C: each value over its row's sum; where a row sums to 0, 0
 * for rows that do not sum above 0 (its masked division). */
static void shares_of(const double *t, int64_t R, int64_t C, double *p, double *total) {
    int all = 1;
    for (int64_t r = 0; r < R; r++) {
        total[r] = row_sum(t + r * C, C);
        all &= total[r] != 0;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) p[r * C + c] = all || total[r] > 0 ? t[r * C + c] / total[r] : 0.0;
}

/* x times distinct_fraction of its p (m values) and numpy's pw = (1 - p)^k, into out. */
static void times_distinct(const double *x, const double *p, const double *pw, int64_t m, double k, double *out) {
    int all = 1;
    for (int64_t i = 0; i < m; i++) all &= p[i] != 0;
    for (int64_t i = 0; i < m; i++) out[i] = x[i] * (all || p[i] > 0 ? (1.0 - pw[i]) / (k * p[i]) : 1.0);
}

/* Row d of schedule._by_link's masked arrays: ri its rows to other ranks of its node, rc to other nodes. */
static inline void by_link_row(const double *row, int64_t d, int64_t D, int64_t G, double *ri, double *rc) {
    for (int64_t m = 0, h = 0; m < D / G; m++) {
        double same = m == d / G ? 1.0 : 0.0;
        for (int64_t j = 0; j < G; j++, h++) {
            ri[h] = row[h] * (h != d ? same : 0.0);
            rc[h] = row[h] * (1.0 - same);
        }
    }
}

/* The busiest rank link's and node link's rows of a one-hop exchange of s [D*D]
 * (schedule.loads_from_traffic; _by_link's masks). scratch: 5D + 2n doubles. */
static void hop_links(const double *s, int64_t D, int64_t G, double *scratch, double *intra, double *inter) {
    int64_t n = D / G;
    double *ri = scratch, *rc = ri + D, *in_i = rc + D, *in_c = in_i + D, *out_i = in_c + D, *nout = out_i + D,
           *nin = nout + n;
    for (int64_t h = 0; h < D; h++) in_i[h] = in_c[h] = 0.0;
    for (int64_t m = 0; m < n; m++) nout[m] = nin[m] = 0.0;
    for (int64_t d = 0; d < D; d++) {
        by_link_row(s + d * D, d, D, G, ri, rc);
        for (int64_t h = 0; h < D; h++) {
            in_i[h] += ri[h];
            in_c[h] += rc[h];
        }
        out_i[d] = row_sum(ri, D);
        nout[d / G] += row_sum(rc, D);
    }
    for (int64_t h = 0; h < D; h++) nin[h / G] += in_c[h];
    double bi = dmax(out_i[0], in_i[0]), bn = dmax(nout[0], nin[0]);
    for (int64_t d = 1; d < D; d++) bi = dmax(bi, dmax(out_i[d], in_i[d]));
    for (int64_t m = 1; m < n; m++) bn = dmax(bn, dmax(nout[m], nin[m]));
    *intra = bi;
    *inter = bn;
}

/* onecopy.relay_traffic of t with one copy's rows `sent`, from to_node [D*n] (t's rows to each node),
 * its p and numpy's powers: fills rank_D, node_n, landed_D, returns the crossing rows.
 * scratch: D n + 4D + n + 2 G D doubles. */
static double relay_rows(const double *t, const double *sent, const double *to_node, const double *p_Dn,
                         const double *pw_Dn, int64_t D, int64_t G, double k, double *scratch, double *rank_D,
                         double *node_n, double *landed) {
    int64_t n = D / G;
    double *hop = scratch, *hrow = hop + D * n, *nout = hrow + D, *moved = nout + n, *rout = moved + G * D,
           *rin = rout + D, *lgd = rin + D;
    times_distinct(to_node, p_Dn, pw_Dn, D * n, k, hop);
    for (int64_t d = 0; d < D; d++) hop[d * n + d / G] = 0.0; /* a node's own tokens take the hop inside it */
    for (int64_t d = 0; d < D; d++) hrow[d] = row_sum(hop + d * n, n);
    for (int64_t m = 0; m < n; m++) nout[m] = row_sum(hrow + m * G, G);
    for (int64_t m = 0; m < n; m++) {
        double col = 0.0;
        for (int64_t d = 0; d < D; d++) col += hop[d * n + m];
        node_n[m] = dmax(nout[m], col);
    }
    double crossing = row_sum(hop, D * n);
    for (int64_t i = 0; i < G * D; i++) moved[i] = lgd[i] = 0.0;
    for (int64_t m = 0; m < n; m++)
        for (int64_t j = 0; j < G; j++)
            for (int64_t h = 0; h < D; h++) {
                moved[j * D + h] += sent[(m * G + j) * D + h]; /* relay (m, j) forwards to h */
                lgd[j * D + h] += t[(m * G + j) * D + h];
            }
    for (int64_t j = 0; j < G; j++)
        for (int64_t m = 0; m < n; m++) moved[j * D + m * G + j] = 0.0;
    for (int64_t j = 0; j < G; j++)
        for (int64_t m = 0; m < n; m++) rout[m * G + j] = row_sum(moved + j * D + m * G, G);
    for (int64_t h = 0; h < D; h++) rin[h] = 0.0;
    for (int64_t j = 0; j < G; j++)
        for (int64_t h = 0; h < D; h++) rin[h] += moved[j * D + h];
    for (int64_t d = 0; d < D; d++) rank_D[d] = dmax(rout[d], rin[d]);
    for (int64_t m = 0; m < n; m++)
        for (int64_t i = 0; i < G; i++) landed[m * G + i] = lgd[i * D + m * G + i];
    return crossing;
}

/* D, G of the exchange's entry points, checked: G divides D, two hops need n >= 2 nodes of G >= 2. */
static int exchange_shape(long long D, long long G, int two_hops) {
    if (D < 1 || G < 1 || D % G || (two_hops && (G < 2 || D / G < 2))) {
        PyErr_Format(PyExc_ValueError, "the exchange's %lld ranks in nodes of %lld (two hops: %d) cannot be priced",
                     D, G, two_hops);
        return -1;
    }
    return 0;
}

/* exchange_shares(traffic, out, D, G, two_hops): out = [p_DD (D*D), with two hops p_Dn (D*n) and
 * to_node_Dn (D*n)]: distinct_fraction's p of the rows and of the rows to each node. */
static PyObject *exchange_shares(PyObject *self, PyObject *args) {
    Py_buffer traffic, out;
    long long D, G;
    int two_hops;
    if (!PyArg_ParseTuple(args, "y*w*LLp", &traffic, &out, &D, &G, &two_hops)) return NULL;
    PyObject *ret = NULL;
    double *total;
    if (exchange_shape(D, G, two_hops)) goto done;
    long long n = D / G;
    if (check_len(&traffic, 8 * D * D, "traffic") || check_len(&out, 8 * (D * D + (two_hops ? 2 * D * n : 0)), "out"))
        goto done;
    if (!(total = scratch_get(SCRATCH_EXCHANGE, sizeof(double) * (size_t)D))) goto done;
    const double *t = traffic.buf;
    double *p = out.buf;
    shares_of(t, D, D, p, total);
    if (two_hops) {
        double *to_node = p + D * D + D * n;
        for (long long d = 0; d < D; d++)
            for (long long m = 0; m < n; m++) to_node[d * n + m] = row_sum(t + d * D + m * G, G);
        shares_of(to_node, D, n, p + D * D, total);
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    scratch_trim();
    PyBuffer_Release(&traffic);
    PyBuffer_Release(&out);
    return ret;
}

/* exchange_price(traffic, shares, powers, costs, out, D, G, token_bytes, top_k, weight_bytes, side_scale,
 * one_copy, two_hops, forward, backward, max_degree) -> (forward, backward, layer_s, crossing): one
 * candidate of onecopy.price_exchange. shares: exchange_shares' out, powers: numpy's (1 - p)^k of its
 * p's (both read with one copy only); degrees 0: chosen (pick_degrees). out [D*D + 10D + n]:
 * load_cols [D*6], forward_R [D], backward_R [D], sent_DD [D*D], rank_D [D], node_n [n], landed_D [D]
 * (sent with one copy, the last three with two hops). */
static PyObject *exchange_price(PyObject *self, PyObject *args) {
    Py_buffer traffic, shares, powers, costs, out;
    long long D, G, top_k, deg[2], max_degree;
    double token_bytes, weight_bytes, side_scale;
    int one_copy, two_hops;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*LLdLddppLLL", &traffic, &shares, &powers, &costs, &out, &D, &G,
                          &token_bytes, &top_k, &weight_bytes, &side_scale, &one_copy, &two_hops, &deg[0], &deg[1],
                          &max_degree))
        return NULL;
    PyObject *ret = NULL;
    double *scratch, *sched;
    if (exchange_shape(D, G, two_hops)) goto done;
    long long n = D / G, pn = D * D + (two_hops ? D * n : 0), most = max_degree;
    if (top_k < 1 || max_degree < 1 || deg[0] < 0 || deg[1] < 0 || (deg[0] > 0) != (deg[1] > 0)) {
        PyErr_Format(PyExc_ValueError, "exchange_price: top_k (%lld), max_degree (%lld) and the degrees (%lld, %lld) "
                     "must be >= 1 (degrees: both 0 to choose them)", top_k, max_degree, deg[0], deg[1]);
        goto done;
    }
    if (check_len(&traffic, 8 * D * D, "traffic") || check_len(&costs, 8 * 7, "costs") ||
        check_len(&out, 8 * (D * D + 10 * D + n), "out") ||
        (one_copy && (check_len(&shares, 8 * (pn + (two_hops ? D * n : 0)), "shares") ||
                      check_len(&powers, 8 * pn, "powers"))))
        goto done;
    most = deg[0] > most ? deg[0] : most;
    most = deg[1] > most ? deg[1] : most;
    if (!(scratch = scratch_get(SCRATCH_EXCHANGE, sizeof(double) * (size_t)(D * n + 2 * G * D + 8 * D + 2 * n))) ||
        !(sched = scratch_get(SCRATCH_SCHEDULE, sizeof(double) * (size_t)(5 * most + 2 + 3 * D))))
        goto done;
    const double *t = traffic.buf, *c = costs.buf, *s = t;
    double *cols = out.buf, *fwd = cols + 6 * D, *bwd = fwd + D, *sent = bwd + D, *rank_D = sent + D * D,
           *node_n = rank_D + D, *landed = node_n + n, *rows = scratch, *over = rows + D, *tmp = over + D;
    double k = (double)top_k, intra, inter = 0.0, relay = 0.0, crossing = 0.0;
    if (one_copy) {
        times_distinct(t, shares.buf, powers.buf, D * D, k, sent);
        s = sent;
    }
    if (one_copy && two_hops) {
        const double *sh = shares.buf;
        crossing = relay_rows(t, sent, sh + pn, sh + D * D, (const double *)powers.buf + D * D, D, G, k, tmp, rank_D,
                              node_n, landed);
        intra = rank_D[0];
        relay = node_n[0];
        for (long long d = 1; d < D; d++) intra = dmax(intra, rank_D[d]);
        for (long long m = 1; m < n; m++) relay = dmax(relay, node_n[m]);
        intra *= token_bytes;
        relay *= token_bytes;
    } else {
        hop_links(s, D, G, tmp, &intra, &inter);
        intra *= token_bytes;
        inter *= token_bytes;
    }
    for (long long h = 0; h < D; h++) rows[h] = 0.0;
    for (long long d = 0; d < D; d++)
        for (long long h = 0; h < D; h++) rows[h] += t[d * D + h];
    for (long long d = 0; d < D; d++) {
        double *ld = cols + 6 * d, local = t[d * D + d];
        ld[0] = intra, ld[1] = inter, ld[2] = local, ld[3] = rows[d] - local, ld[5] = relay;
        ld[4] = side_scale != 0 ? row_sum(t + d * D, D) * side_scale : 0.0;
    }
    double *times = deg[0] ? NULL : sched + 5 * most + 2; /* the picked degrees' times: not timed again */
    if (!deg[0]) pick_degrees(c, cols, D, max_degree, sched, deg, times);
    for (long long d = 0; d < D; d++) fwd[d] = over[d] = 0.0;
    if (one_copy) { /* onecopy.one_copy_overhead_s: the counts, the routing entries, the gate weights */
        double count = lin(c, (double)(D * 8)), *ri = tmp, *rc = ri + D;
        for (long long d = 0; d < D; d++) {
            by_link_row(sent + d * D, d, D, G, ri, rc);
            double ik = row_sum(ri, D) * k, ck = row_sum(rc, D) * k, wi = ik * weight_bytes, wc = ck * weight_bytes;
            double w = deg[0] == 1 && deg[1] == 1 ? wi * c[1] + wc * c[3] : dmax(lin(c, wi), lin(c + 2, wc));
            fwd[d] = count + dmax(lin(c, ik * 8.0), lin(c + 2, ck * 8.0)) + w;
            over[d] = w;
        }
    }
    double layer = 0.0;
    for (long long d = 0; d < D; d++) {
        fwd[d] = (times ? times[d] : load_time(c, cols + 6 * d, deg[0], 0, sched)) + fwd[d];
        bwd[d] = (times ? times[D + d] : load_time(c, cols + 6 * d, deg[1], 1, sched)) + over[d];
        double v = fwd[d] + bwd[d];
        layer = !d || v > layer ? v : layer;
    }
    ret = Py_BuildValue("LLdd", deg[0], deg[1], layer, crossing);
done:
    scratch_trim();
    PyBuffer_Release(&traffic);
    PyBuffer_Release(&shares);
    PyBuffer_Release(&powers);
    PyBuffer_Release(&costs);
    PyBuffer_Release(&out);
    return ret;
}

/* ---------------------------------------------------------------------------------------------
 * The synthetic trace's sampling (ds_fssdp/sim/loadcv.py systematic_counts, then the step's
 * transpose to tokens_LED): numpy's float64 operations in its order, in one pass.
 */

/* systematic_counts(p, u, out, L, D, E, n): for each of the L*D rows (l, d) of E float32 shares p,
 * its offset u [L*D] and n assignments: edges = cumsum(p) * (n / sum) + u in float64, counts the
 * differences of their int32 truncations, written to out int32 [L, E, D] (transposed). */
static PyObject *systematic_counts(PyObject *self, PyObject *args) {
    Py_buffer shares, offsets, out;
    long long L, D, E, n;
    if (!PyArg_ParseTuple(args, "y*y*w*LLLL", &shares, &offsets, &out, &L, &D, &E, &n)) return NULL;
    PyObject *ret = NULL;
    enum { BLOCK = 16 }; /* rows sampled before their counts are written down the E columns */
    int32_t *block;
    if (L < 1 || D < 1 || E < 1) {
        PyErr_Format(PyExc_ValueError, "systematic_counts: L (%lld), D (%lld), E (%lld) must be >= 1", L, D, E);
        goto done;
    }
    if (check_len(&shares, 4 * L * D * E, "shares") || check_len(&offsets, 8 * L * D, "offsets") ||
        check_len(&out, 4 * L * E * D, "out"))
        goto done;
    if (!(block = scratch_get(SCRATCH_EXCHANGE, sizeof(int32_t) * (size_t)(BLOCK * E)))) goto done;
    const float *P = shares.buf;
    const double *U = offsets.buf;
    int32_t *O = out.buf;
    for (long long l = 0; l < L; l++)
        for (long long d0 = 0; d0 < D; d0 += BLOCK) {
            long long rows = D - d0 < BLOCK ? D - d0 : BLOCK;
            for (long long r = 0; r < rows; r++) {
                const float *p = P + ((l * D + d0 + r) * E);
                double total = p[0], edge, u = U[l * D + d0 + r];
                for (long long j = 1; j < E; j++) total += (double)p[j];
                double scale = (double)n / total;
                int32_t prev = 0, *c = block + r * E;
                edge = p[0];
                for (long long j = 0; j < E; j++) {
                    if (j) edge += (double)p[j];
                    int32_t cut = (int32_t)(edge * scale + u);
                    c[j] = cut - prev;
                    prev = cut;
                }
            }
            for (long long j = 0; j < E; j++)
                for (long long r = 0; r < rows; r++) O[(l * E + j) * D + d0 + r] = block[r * E + j];
        }
    ret = Py_None;
    Py_INCREF(ret);
done:
    scratch_trim();
    PyBuffer_Release(&shares);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"materialize_alg1", materialize_alg1, METH_VARARGS, "Algorithm 1 into a placement."},
    {"materialize_joint", materialize_joint, METH_VARARGS, "Joint materialization into a placement."},
    {"dispatch_dense", dispatch_dense, METH_VARARGS, "Either dispatch into a zeroed dense plan."},
    {"dispatch_compact", dispatch_compact, METH_VARARGS,
     "Either dispatch as (X, F, bytes [holder_E, rep_X, tokens_ED, flows_4F])."},
    {"schedule_times", schedule_times, METH_VARARGS, "Each load's one direction of the layer schedule."},
    {"gather_links", gather_links, METH_VARARGS, "The links' bytes of B groups' sparse collectives."},
    {"plan_traffic", plan_traffic, METH_VARARGS, "Rows each rank sends each rank, per group."},
    {"choose_degrees", choose_degrees, METH_VARARGS, "The layer schedule's (forward, backward) degrees."},
    {"exchange_shares", exchange_shares, METH_VARARGS, "distinct_fraction's shares of the rows (and nodes)."},
    {"exchange_price", exchange_price, METH_VARARGS, "One candidate of price_exchange: degrees, seconds, rows."},
    {"systematic_counts", systematic_counts, METH_VARARGS, "The synthetic trace's systematic sampling, transposed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastplan", "Planner hot paths in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastplan(void) { return PyModule_Create(&module); }
