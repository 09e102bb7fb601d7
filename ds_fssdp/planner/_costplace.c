/* Cost-aware placement ("replicate only what pays") in C: the same cover, levels and choice, float
 * for float, as cost_materialize_reference in ds_fssdp/planner/cost_place.py (the model and the
 * rules are described there; tests compare the two). Plain C, no Python: _fastplan.c checks the
 * arguments and calls cost_place_core.
 *
 * Legend: E experts, D ranks of G per node, N nodes. owner int64 [E], T float64 [E*D] (predicted
 * tokens, finite and >= 0, checked by the caller), P uint8 [E*D] (zeroed by the caller), scratch
 * of cost_place_scratch(E, D, G) bytes.
 */
#include "_costplace.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline double pos(double v) { return v > 0.0 ? v : 0.0; }
static inline double maxd(double a, double b) { return a >= b ? a : b; }
static inline double mind(double a, double b) { return a <= b ? a : b; }

/* Inputs shared by every fill. */
typedef struct {
    const int64_t *owner, *node; /* node of each rank */
    const double *T, *made;      /* made [E*N]: tokens of e produced in node n */
    int64_t E, D, G, N, t;
    double margin;
    double *rigid; /* [D] scratch of fill_time */
    const CostCoefficients *c;
} Inst;

/* One fill's state (cost_place.py: _Fill), laid out in one block so a copy is one memcpy. */
typedef struct {
    double *share, *node_share, *load, *rin, *rout, *nin, *nout, *gather;
    int64_t *freeD, *rank_in, *rank_out, *node_in, *node_out, *distinct;
    uint8_t *held, *node_has, *replicated;
} Fill;

static size_t fill_bytes(int64_t E, int64_t D, int64_t N) {
    return (size_t)(E * D + E * N + 3 * D + 2 * N + 1) * sizeof(double) +
           (size_t)(3 * D + 2 * N + 1) * sizeof(int64_t) + (size_t)(E * D + E * N + E);
}

static void fill_at(Fill *f, char *block, int64_t E, int64_t D, int64_t N) {
    double *p = (double *)block;
    f->share = p; p += E * D;
    f->node_share = p; p += E * N;
    f->load = p; p += D;
    f->rin = p; p += D;
    f->rout = p; p += D;
    f->nin = p; p += N;
    f->nout = p; p += N;
    f->gather = p; p += 1;
    int64_t *q = (int64_t *)p;
    f->freeD = q; q += D;
    f->rank_in = q; q += D;
    f->rank_out = q; q += D;
    f->node_in = q; q += N;
    f->node_out = q; q += N;
    f->distinct = q; q += 1;
    uint8_t *u = (uint8_t *)q;
    f->held = u; u += E * D;
    f->node_has = u; u += E * N;
    f->replicated = u;
}

typedef struct {
    double made;
    int32_t e, n;
} Pair;

size_t cost_place_scratch(int64_t E, int64_t D, int64_t G) {
    const int64_t N = D / G;
    /* four fills, node [D], order [D], open [D], experts [E], totals [E], made [E*N], rigid [D], node_term [N],
     * node_gather [N], pairs [E*N] and their sort's buffer, alignment */
    return 4 * (fill_bytes(E, D, N) + 64) + (size_t)(4 * D + 2 * E + E * N + 2 * N) * 8 + (size_t)(2 * E * N) * sizeof(Pair) +
           64;
}

/* cost.py: exposed_transfer. */
static inline double exposed(double gather, const CostCoefficients *c) {
    double f = gather - c->window, b = gather - 2.0 * c->window;
    return pos(f) + pos(b);
}

/* The busiest link's gather time once a rank of node b also holds a replica of an expert owned by
 * o, except the receiving rank's own link (the same for every rank of b; a max is exact in any
 * order). */
static inline double gather_to_node(const Inst *in, const Fill *f, double gather, int64_t o, int64_t b, int entered) {
    const int64_t a = in->node[o];
    const int cross = a != b && !entered;
    const int64_t out = f->rank_out[o] + ((a == b || cross) ? 1 : 0);
    const CostCoefficients *c = in->c;
    gather = maxd(gather, (double)out * c->chunk_intra);
    if (cross)
        gather = maxd(gather, maxd((double)(f->node_in[b] + 1) * c->chunk_inter,
                                   (double)(f->node_out[a] + 1) * c->chunk_inter));
    return gather;
}

/* cost_place.py: _gather_with (add: count the replica's chunks). */
static inline double gather_with(const Inst *in, Fill *f, double gather, int64_t o, int64_t r, int entered, int add) {
    const int64_t a = in->node[o], b = in->node[r];
    gather = maxd(gather_to_node(in, f, gather, o, b, entered), (double)(f->rank_in[r] + 1) * in->c->chunk_intra);
    if (add) {
        const int cross = a != b && !entered;
        const int64_t out = f->rank_out[o] + ((a == b || cross) ? 1 : 0);
        f->rank_in[r] += 1;
        f->rank_out[o] = out;
        if (cross) {
            f->node_in[b] += 1;
            f->node_out[a] += 1;
        }
    }
    return gather;
}

/* cost_place.py: _moved. */
static inline double moved(double computed, double produced, double dx) {
    double after = computed + dx - produced, before = computed - produced;
    return fabs(after) - fabs(before);
}

/* cost_place.py: _link_after. */
static inline void link_after(double *in, double *out, double computed, double produced, double dx) {
    double after = computed + dx;
    *in = *in - pos(computed - produced) + pos(after - produced);
    *out = *out - pos(produced - computed) + pos(produced - after);
}

/* cost_place.py: _Fill.score. */
static inline double score(const Inst *in, Fill *f, int64_t e, int64_t d, int64_t r, double x) {
    const int64_t D = in->D, N = in->N, a = in->node[d], b = in->node[r];
    const CostCoefficients *c = in->c;
    const double *T = in->T, *made = in->made;
    double price = 0.0;
    if (!f->held[e * D + r]) {
        const double g = gather_with(in, f, *f->gather, in->owner[e], r, f->node_has[e * N + b], 0);
        price = exposed(g, c) - exposed(*f->gather, c);
    }
    const double ranks = moved(f->share[e * D + d], T[e * D + d], -x) + moved(f->share[e * D + r], T[e * D + r], x);
    double nodes = 0.0;
    if (b != a)
        nodes = moved(f->node_share[e * N + a], made[e * N + a], -x) + moved(f->node_share[e * N + b], made[e * N + b], x);
    return -0.5 * (c->intra * ranks + c->inter * nodes) - price;
}

/* cost_place.py: _Fill.move. */
static void move(const Inst *in, Fill *f, int64_t e, int64_t d, int64_t r, double x, double goal, double level) {
    const int64_t D = in->D, N = in->N, a = in->node[d], b = in->node[r];
    const double *T = in->T, *made = in->made;
    double *share = f->share, *load = f->load;
    if (!f->held[e * D + r]) {
        *f->gather = gather_with(in, f, *f->gather, in->owner[e], r, f->node_has[e * N + b], 1);
        f->node_has[e * N + b] = 1;
        f->held[e * D + r] = 1;
        f->freeD[r]--;
        if (!f->replicated[e]) {
            f->replicated[e] = 1;
            (*f->distinct)++;
        }
    }
    link_after(&f->rin[d], &f->rout[d], share[e * D + d], T[e * D + d], -x);
    link_after(&f->rin[r], &f->rout[r], share[e * D + r], T[e * D + r], x);
    if (b != a) {
        link_after(&f->nin[a], &f->nout[a], f->node_share[e * N + a], made[e * N + a], -x);
        link_after(&f->nin[b], &f->nout[b], f->node_share[e * N + b], made[e * N + b], x);
        f->node_share[e * N + a] -= x;
        f->node_share[e * N + b] += x;
    }
    const double spare = level - load[r], excess = load[d] - goal;
    share[e * D + d] = x == share[e * D + d] ? 0.0 : share[e * D + d] - x;
    share[e * D + r] += x;
    load[d] = x == excess ? goal : load[d] - x;
    load[r] = x == spare ? level : load[r] + x;
}

/* Cover candidates, most tokens first, then lowest expert, then lowest node: a stable merge sort
 * of the candidates (listed in (expert, node) order) by tokens, descending; the merge is
 * branch-free (the next element is taken from the right run only when it has more tokens). */
static void sort_pairs(Pair *pairs, Pair *tmp, int64_t n) {
    Pair *src = pairs, *dst = tmp;
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            const int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                const int right = src[j].made > src[i].made;
                dst[k++] = right ? src[j] : src[i];
                j += right;
                i += !right;
            }
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        Pair *t = src;
        src = dst;
        dst = t;
    }
    if (src != pairs) memcpy(pairs, src, sizeof(Pair) * (size_t)n);
}

static double max_of(const double *v, int64_t n) {
    double m = v[0];
    for (int64_t i = 1; i < n; i++) m = maxd(m, v[i]);
    return m;
}

/* cost_place.py: _Fill.cover, over the instance's (expert, node) pairs that produce tokens, sorted
 * once (sort_pairs; skipping the pairs whose node holds the expert keeps the reference's order). */
static void cover(const Inst *in, Fill *f, double gain, const Pair *pairs, int64_t num_pairs) {
    const int64_t D = in->D, G = in->G, N = in->N;
    const CostCoefficients *c = in->c;
    const double top = max_of(f->load, D);
    double *share = f->share, *load = f->load;
    for (int64_t i = 0; i < num_pairs; i++) {
        if (pairs[i].made * (c->intra + c->inter) <= gain) break;
        const int64_t e = pairs[i].e, n = pairs[i].n;
        if (f->node_has[e * N + n]) continue;
        if (!(f->replicated[e] || *f->distinct < in->t)) continue;
        int room = 0; /* a rank of n could take a replica (else there is no move to score); no rank of n
                         holds e (each pair comes once) */
        for (int64_t r = n * G; r < (n + 1) * G && !room; r++) room = f->freeD[r] > 0 && load[r] < top;
        if (!room) continue;
        int64_t h = -1;
        for (int64_t d = 0; d < D; d++)
            if (in->node[d] != n && share[e * D + d] > 0.0 && (h < 0 || share[e * D + d] > share[e * D + h])) h = d;
        int found = 0;
        double best_v = 0.0, best_x = 0.0;
        int64_t best_r = -1;
        for (int64_t r = n * G; r < (n + 1) * G; r++) {
            if (f->freeD[r] <= 0 || load[r] >= top) continue;
            const double x = mind(mind(share[e * D + h], in->made[e * N + n]), top - load[r]);
            const double v = score(in, f, e, h, r, x);
            if (!found || v > best_v) {
                found = 1;
                best_v = v;
                best_r = r;
                best_x = x;
            }
        }
        if (found && best_v > gain) move(in, f, e, h, best_r, best_x, -1.0, top);
    }
}

/* cost_place.py: _Fill.localize (by_load: the experts it may replicate by predicted tokens, most first);
 * returns whether it moved rows. */
static int localize(const Inst *in, Fill *f, const Pair *by_load, int64_t num_experts) {
    const int64_t D = in->D;
    const double *T = in->T, top = max_of(f->load, D);
    double *share = f->share, *load = f->load;
    int moved_any = 0;
    for (int64_t k = 0; k < num_experts; k++) {
        const int64_t e = by_load[k].e;
        if (!(f->replicated[e] || *f->distinct < in->t)) continue;
        int64_t h = -1;
        for (int64_t r = 0; r < D; r++) {
            if (h < 0) { /* the busiest holder (lowest id on ties), again after each move */
                for (int64_t d = 0; d < D; d++)
                    if (share[e * D + d] > 0.0 && (h < 0 || share[e * D + d] > share[e * D + h])) h = d;
                if (h < 0) break;
            }
            if (f->held[e * D + r] || f->freeD[r] <= 0 || T[e * D + r] <= 0.0) continue;
            if (!(f->replicated[e] || *f->distinct < in->t)) break;
            const double x = mind(mind(share[e * D + h], T[e * D + r]), top - load[r]);
            if (x > 0.0 && score(in, f, e, h, r, x) > 0.0) {
                move(in, f, e, h, r, x, -1.0, top);
                h = -1;
                moved_any = 1;
            }
        }
    }
    return moved_any;
}

/* Ranks below the level (the receivers), ascending: insert r / drop r when its load crosses it. */
static void open_insert(int64_t *open, int64_t *num_open, int64_t r) {
    int64_t j = (*num_open)++;
    while (j > 0 && open[j - 1] > r) {
        open[j] = open[j - 1];
        j--;
    }
    open[j] = r;
}

static void open_drop(int64_t *open, int64_t *num_open, int64_t r) {
    int64_t j = 0;
    while (open[j] != r) j++;
    memmove(open + j, open + j + 1, sizeof(int64_t) * (size_t)(--(*num_open) - j));
}

/* cost_place.py: _Fill.level. score() unrolled over the receivers: the donor's rank and node terms
 * at the largest x, each node's node term at it and the replica's gather without the receiver's
 * own link are computed once per expert (the same floats: each is what score() computes for the
 * receivers it is used for; a max is exact in any order). order: the ranks by load, descending
 * (lowest id on ties), of the fill's start (every fill from it begins with its loads). */
static int level_fill(const Inst *in, Fill *f, double target, double level, const int64_t *order, int64_t *experts,
                      double *node_term, double *node_gather, int64_t *open) {
    const int64_t E = in->E, D = in->D, N = in->N;
    const CostCoefficients *c = in->c;
    const double *T = in->T, *made = in->made;
    double *share = f->share, *load = f->load;
    int64_t num_open = 0;
    for (int64_t r = 0; r < D; r++)
        if (load[r] < level) open[num_open++] = r;
    for (int64_t i = 0; i < D; i++) {
        const int64_t d = order[i], a = in->node[d];
        if (load[d] <= target) break;
        int64_t num_experts = 0; /* experts d holds, ascending (a donor receives nothing while it sheds) */
        for (int64_t e = 0; e < E; e++)
            if (f->held[e * D + d]) experts[num_experts++] = e;
        while (load[d] > target) {
            int found = 0;
            double best_v = 0.0, best_x = 0.0;
            int64_t best_e = -1, best_r = -1;
            const double gather = *f->gather, exposed_now = exposed(gather, c);
            for (int64_t k = 0; k < num_experts; k++) {
                const int64_t e = experts[k];
                const double s = share[e * D + d];
                if (s <= 0.0) continue;
                const int can_add = f->replicated[e] || *f->distinct < in->t;
                const double xm = mind(s, load[d] - target), td = T[e * D + d];
                const double donor_xm = moved(s, td, -xm);
                const double *ns = f->node_share + e * N, *mk = made + e * N;
                const double node_donor_xm = moved(ns[a], mk[a], -xm);
                const int64_t o = in->owner[e];
                for (int64_t b = 0; b < N; b++) {
                    node_term[b] = b == a ? 0.0 : node_donor_xm + moved(ns[b], mk[b], xm);
                    node_gather[b] = gather_to_node(in, f, gather, o, b, f->node_has[e * N + b]);
                }
                for (int64_t j = 0; j < num_open; j++) {
                    const int64_t r = open[j];
                    const int held = f->held[e * D + r];
                    if (r == d || !(held || (f->freeD[r] > 0 && can_add))) continue;
                    const int64_t b = in->node[r];
                    const double room = level - load[r], x = mind(xm, room);
                    double price = 0.0;
                    if (!held) {
                        const double g = maxd(node_gather[b], (double)(f->rank_in[r] + 1) * c->chunk_intra);
                        price = exposed(g, c) - exposed_now;
                    }
                    const double ranks = (x == xm ? donor_xm : moved(s, td, -x)) + moved(share[e * D + r], T[e * D + r], x);
                    double nodes = 0.0;
                    if (b != a) nodes = x == xm ? node_term[b] : moved(ns[a], mk[a], -x) + moved(ns[b], mk[b], x);
                    const double v = c->row * x + (-0.5 * (c->intra * ranks + c->inter * nodes) - price);
                    if (!found || v > best_v) {
                        found = 1;
                        best_v = v;
                        best_e = e;
                        best_r = r;
                        best_x = x;
                    }
                }
            }
            if (!found) return 0;
            const int was_open = load[d] < level;
            move(in, f, best_e, d, best_r, best_x, target, level);
            if (load[best_r] >= level) open_drop(open, &num_open, best_r);
            if (!was_open && load[d] < level) open_insert(open, &num_open, d);
        }
    }
    return 1;
}

static double fill_exchange(const Inst *in, const Fill *f) {
    const CostCoefficients *c = in->c;
    const double ranks = maxd(max_of(f->rin, in->D), max_of(f->rout, in->D));
    const double nodes = maxd(max_of(f->nin, in->N), max_of(f->nout, in->N));
    return maxd(ranks * c->intra, nodes * c->inter);
}

/* cost_place.py: _Fill.transfer. */
static double fill_transfer(const Inst *in, const Fill *f) { return fill_exchange(in, f) + exposed(*f->gather, in->c); }

/* cost_place.py: _Fill.time. */
static double fill_time(const Inst *in, const Fill *f) {
    const CostCoefficients *c = in->c;
    const double exchange = fill_exchange(in, f);
    double *rigid = in->rigid; /* rows of experts only their owner holds */
    for (int64_t d = 0; d < in->D; d++) rigid[d] = 0.0;
    for (int64_t e = 0; e < in->E; e++)
        if (!f->replicated[e]) rigid[in->owner[e]] += f->share[e * in->D + in->owner[e]];
    return maxd(max_of(f->load, in->D), (1.0 + in->margin) * max_of(rigid, in->D)) * c->row + exchange +
           exposed(*f->gather, c);
}

/* Each of X links' exchange rows, in and out, from the rows of each expert computed behind it and
 * produced there ([E*X] each): each link's sum in the reference's order (experts ascending; the
 * same floats), the links side by side. */
static void link_rows(const double *computed, const double *produced, int64_t E, int64_t X, double *in, double *out) {
    for (int64_t x = 0; x < X; x++) in[x] = out[x] = 0.0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t x = 0; x < X; x++) {
            in[x] += pos(computed[e * X + x] - produced[e * X + x]);
            out[x] += pos(produced[e * X + x] - computed[e * X + x]);
        }
}

static char *align64(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

void cost_place_core(const int64_t *owner, const double *T, uint8_t *P, int64_t E, int64_t D, int64_t G, int64_t t,
                     int64_t m, const CostCoefficients *c, double margin, const double *levels, int64_t num_levels,
                     double min_gain, char *scratch) {
    const int64_t N = D / G;
    const size_t bytes = fill_bytes(E, D, N);
    char *base_block = align64(scratch), *work_block = align64(base_block + bytes);
    char *ep_block = align64(work_block + bytes), *best_block = align64(ep_block + bytes);
    int64_t *node = (int64_t *)align64(best_block + bytes), *order = node + D, *open = order + D, *experts = open + D;
    double *totals = (double *)(experts + E), *made = totals + E, *rigid = made + E * N, *node_term = rigid + D,
           *node_gather = node_term + N;
    Pair *pairs = (Pair *)(node_gather + N);
    Inst in = {.owner = owner, .node = node, .T = T, .made = made, .E = E, .D = D, .G = G, .N = N,
               .t = t < E ? t : E, .margin = margin, .rigid = rigid, .c = c};
    for (int64_t d = 0; d < D; d++) node[d] = d / G;
    Fill base, ep, one, two; /* one and two: the work fill and the best so far (base until a fill wins) */
    fill_at(&base, base_block, E, D, N);
    fill_at(&ep, ep_block, E, D, N);
    fill_at(&one, work_block, E, D, N);
    fill_at(&two, best_block, E, D, N);
    memset(base_block, 0, bytes);
    /* cost_place.py: _Fill.__init__ (expert parallelism) */
    double mean = 0.0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t o = owner[e];
        double total = 0.0; /* and each node's tokens of e, in the reference's orders (a node's ranks are
                               consecutive) */
        for (int64_t n = 0; n < N; n++) {
            double sum = 0.0;
            for (int64_t d = n * G; d < (n + 1) * G; d++) {
                total += T[e * D + d];
                sum += T[e * D + d];
            }
            made[e * N + n] = sum;
        }
        base.held[e * D + o] = 1;
        base.share[e * D + o] = total;
        base.node_share[e * N + node[o]] = total;
        base.node_has[e * N + node[o]] = 1;
        base.load[o] += total;
        totals[e] = total;
        mean += total;
    }
    mean /= (double)D;
    link_rows(base.share, T, E, D, base.rin, base.rout);
    link_rows(base.node_share, made, E, N, base.nin, base.nout);
    for (int64_t d = 0; d < D; d++) base.freeD[d] = m;
    const double gain = min_gain * c->row * mean;
    memcpy(ep_block, base_block, bytes);
    int64_t num_pairs = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t n = 0; n < N; n++)
            /* the owner's node always holds e; a pair at or below the cover's cut-off is never moved */
            if (n != node[owner[e]] && made[e * N + n] * (c->intra + c->inter) > gain)
                pairs[num_pairs++] = (Pair){made[e * N + n], (int32_t)e, (int32_t)n};
    sort_pairs(pairs, pairs + E * N, num_pairs);
    cover(&in, &base, gain, pairs, num_pairs);
    double best = fill_time(&in, &base);
    Fill *work = &one, *best_fill = &base; /* work: whichever of one and two is not the best */
    /* Cover, then level; and level from expert parallelism, then cover, unless no cover can move a
     * row (no pairs: the same fills again). */
    for (int pass = 0; pass < (num_pairs ? 2 : 1); pass++) {
        const Fill *start = pass ? &ep : &base;
        const double top = max_of(start->load, D);
        for (int64_t i = 0; i < D; i++) { /* the start's ranks by load, descending (lowest id on ties) */
            int64_t j = i;
            while (j > 0 && start->load[order[j - 1]] < start->load[i]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = i;
        }
        for (int64_t i = 0; i < num_levels; i++) {
            const double level = mean * (1.0 + levels[i]);
            const double target = level / (1.0 + margin);
            if (target >= top) continue;
            memcpy(work->share, start->share, bytes); /* a fill's block begins at its share */
            const int reached = level_fill(&in, work, target, level, order, experts, node_term, node_gather, open);
            if (pass) cover(&in, work, gain, pairs, num_pairs);
            const double time = fill_time(&in, work);
            if (time < best - gain) {
                best = time;
                best_fill = work;
                work = work == &one ? &two : &one;
            }
            if (!reached) break;
        }
    }
    /* Ranks compute their own tokens of the replicated experts where that pays, on the best fill
     * itself (nothing reads it after), P keeping its placement. The cover is done: its pairs' memory
     * sorts the experts it may replicate by predicted tokens (when t binds already, the replicated
     * ones: the same order for them). */
    memcpy(P, best_fill->held, (size_t)(E * D));
    const double transfer = fill_transfer(&in, best_fill);
    const int all = *best_fill->distinct < in.t;
    int64_t num_candidates = 0;
    for (int64_t e = 0; e < E; e++)
        if (all || best_fill->replicated[e]) pairs[num_candidates++] = (Pair){totals[e], (int32_t)e, 0};
    if (!num_candidates) return;
    sort_pairs(pairs, pairs + E * N, num_candidates);
    if (localize(&in, best_fill, pairs, num_candidates) && fill_transfer(&in, best_fill) < transfer - gain)
        memcpy(P, best_fill->held, (size_t)(E * D));
}
