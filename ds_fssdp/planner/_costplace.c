/* Cost-aware placement ("replicate only what pays") in C: the same greedy, float for float, as
 * cost_materialize_reference in ds_fssdp/planner/cost_place.py (the model and the rules are
 * described there; tests compare the two). Plain C, no Python: _fastplan.c checks the arguments
 * and calls cost_place_core.
 *
 * Legend: E experts, D ranks of G per node, N nodes. owner int64 [E], T float64 [E*D] (predicted
 * tokens, finite and >= 0, checked by the caller), P uint8 [E*D] (zeroed by the caller), scratch
 * of cost_place_scratch(E, D) bytes.
 */
#include "_costplace.h"

#include <string.h>

static inline double pos(double v) { return v > 0.0 ? v : 0.0; }
static inline double maxd(double a, double b) { return a >= b ? a : b; }

size_t cost_place_scratch(int64_t E, int64_t D) {
    /* share [E*D], node_share and made [E*N], load rin rout sorted [D], nin nout [N], node_has [E*N],
     * free [D], replicated [E] */
    return (size_t)(E * D + 2 * E * D + 4 * D + 2 * D) * sizeof(double) + (size_t)(E * D) +
           (size_t)(D + E) * sizeof(int64_t) + 64;
}

/* Ranks with more rows than level: sorted_D is descending. */
static inline int64_t above(const double *sorted_D, int64_t D, double level) {
    int64_t lo = 0, hi = D;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (sorted_D[mid] > level) lo = mid + 1; else hi = mid;
    }
    return lo;
}

typedef struct {
    double rank_ds[2], rank_r[2], node_a[2], node_b[2];
    int cross; /* ds and r in different nodes */
} After;

typedef struct {
    const double *T;
    double *share, *node_share, *made, *rin, *rout, *nin, *nout;
    int64_t D, G, N;
} State;

/* The links' new (in, out) loads if x rows of e move from ds to r (cost_place.py: after). */
static inline void after(const State *st, int64_t e, int64_t ds, int64_t r, double x, After *o) {
    const int64_t D = st->D, N = st->N;
    double s = st->share[e * D + ds], sr = st->share[e * D + r], Ts = st->T[e * D + ds], Tr = st->T[e * D + r];
    double s2 = s - x, sr2 = sr + x;
    o->rank_ds[0] = st->rin[ds] - pos(s - Ts) + pos(s2 - Ts);
    o->rank_ds[1] = st->rout[ds] - pos(Ts - s) + pos(Ts - s2);
    o->rank_r[0] = st->rin[r] - pos(sr - Tr) + pos(sr2 - Tr);
    o->rank_r[1] = st->rout[r] - pos(Tr - sr) + pos(Tr - sr2);
    int64_t a = ds / st->G, b = r / st->G;
    o->cross = a != b;
    if (!o->cross) return;
    double Sa = st->node_share[e * N + a], Sb = st->node_share[e * N + b], Fa = st->made[e * N + a],
           Fb = st->made[e * N + b];
    double Sa2 = Sa - x, Sb2 = Sb + x;
    o->node_a[0] = st->nin[a] - pos(Sa - Fa) + pos(Sa2 - Fa);
    o->node_a[1] = st->nout[a] - pos(Fa - Sa) + pos(Fa - Sa2);
    o->node_b[0] = st->nin[b] - pos(Sb - Fb) + pos(Sb2 - Fb);
    o->node_b[1] = st->nout[b] - pos(Fb - Sb) + pos(Fb - Sb2);
}

void cost_place_core(const int64_t *owner, const double *T, uint8_t *P, int64_t E, int64_t D, int64_t G, int64_t t,
                     int64_t m, const CostCoefficients *c, double min_gain, char *scratch) {
    const int64_t N = D / G;
    State st = {.T = T, .D = D, .G = G, .N = N};
    double *f = (double *)scratch;
    st.share = f; f += E * D;
    st.node_share = f; f += E * N;
    st.made = f; f += E * N;
    double *load = f; f += D;
    st.rin = f; f += D;
    st.rout = f; f += D;
    double *sorted = f; f += D;
    st.nin = f; f += N;
    st.nout = f; f += N;
    int64_t *freeD = (int64_t *)f;
    int64_t *replicated = freeD + D;
    uint8_t *node_has = (uint8_t *)(replicated + E);
    memset(st.share, 0, (size_t)(E * D) * sizeof(double));
    memset(st.node_share, 0, (size_t)(2 * E * N) * sizeof(double));
    memset(node_has, 0, (size_t)(E * N));
    for (int64_t e = 0; e < E; e++) {
        int64_t o = owner[e];
        double total = 0.0;
        for (int64_t d = 0; d < D; d++) {
            total += T[e * D + d];
            st.made[e * N + d / G] += T[e * D + d];
        }
        P[e * D + o] = 1;
        node_has[e * N + o / G] = 1;
        st.share[e * D + o] = total;
        st.node_share[e * N + o / G] = total;
        replicated[e] = 0;
    }
    for (int64_t d = 0; d < D; d++) {
        load[d] = st.rin[d] = st.rout[d] = 0.0;
        for (int64_t e = 0; e < E; e++) {
            load[d] += st.share[e * D + d];
            st.rin[d] += pos(st.share[e * D + d] - T[e * D + d]);
            st.rout[d] += pos(T[e * D + d] - st.share[e * D + d]);
        }
        freeD[d] = m;
    }
    for (int64_t n = 0; n < N; n++) {
        st.nin[n] = st.nout[n] = 0.0;
        for (int64_t e = 0; e < E; e++) {
            st.nin[n] += pos(st.node_share[e * N + n] - st.made[e * N + n]);
            st.nout[n] += pos(st.made[e * N + n] - st.node_share[e * N + n]);
        }
    }
    int64_t distinct = 0;
    if (t > E) t = E;
    const int64_t iterations = 2 * E * D + D * m;
    for (int64_t it = 0; it < iterations; it++) {
        int64_t ds = 0;
        for (int64_t d = 1; d < D; d++)
            if (load[d] > load[ds]) ds = d;
        const double top = load[ds];
        for (int64_t d = 0; d < D; d++) { /* insertion sort, descending */
            double v = load[d];
            int64_t i = d;
            while (i > 0 && sorted[i - 1] < v) { sorted[i] = sorted[i - 1]; i--; }
            sorted[i] = v;
        }
        const double link_ds = st.rin[ds] + st.rout[ds], link_a = st.nin[ds / G] + st.nout[ds / G];
        int found = 0;
        double best_net = 0.0, best_x = 0.0;
        int64_t best_e = -1, best_r = -1, best_h = -1;
        After o;
        for (int64_t e = 0; e < E; e++) {
            const double s = st.share[e * D + ds];
            if (s <= 0.0) continue;
            const uint8_t *held = P + e * D;
            const int can_add = replicated[e] || distinct < t;
            for (int64_t r = 0; r < D; r++) {
                if (r == ds) continue;
                double price;
                if (held[r]) price = 0.0;
                else if (freeD[r] > 0 && can_add) price = node_has[e * N + r / G] ? c->same_node : c->cross_node;
                else continue;
                double x = (top - load[r]) * 0.5;
                if (s <= x) x = s;
                if (!(x > 0.0)) continue;
                const double level = maxd(top - x, load[r] + x);
                const int64_t k = above(sorted, D, level);
                if (k == 0) continue;
                after(&st, e, ds, r, x, &o);
                const double ranks = (link_ds + st.rin[r] + st.rout[r]) -
                                     (o.rank_ds[0] + o.rank_ds[1] + (o.rank_r[0] + o.rank_r[1]));
                double nodes = 0.0;
                if (o.cross) {
                    const int64_t b = r / G;
                    nodes = (link_a + st.nin[b] + st.nout[b]) -
                            (o.node_a[0] + o.node_a[1] + (o.node_b[0] + o.node_b[1]));
                }
                const double net = c->row * (top - level) / (double)k + c->intra * ranks / (double)D +
                                   c->inter * nodes / (double)N - price;
                if (!found || net > best_net) {
                    found = 1;
                    best_net = net; best_e = e; best_r = r; best_x = x; best_h = ds;
                }
            }
        }
        /* Cover moves: rows of e a node produces but computes elsewhere, moved into it from e's
         * busiest holder outside, no rank past the slowest one. */
        int64_t order[3], no = 0;
        for (int64_t d = 0; d < D && no < 3; d++) { /* the 3 busiest ranks, lowest id on ties */
            int64_t i = no++;
            while (i > 0 && load[order[i - 1]] < load[d]) { order[i] = order[i - 1]; i--; }
            order[i] = d;
        }
        for (int64_t d = 3; d < D; d++) {
            if (!(load[d] > load[order[2]])) continue;
            int64_t i = 2;
            while (i > 0 && load[order[i - 1]] < load[d]) { order[i] = order[i - 1]; i--; }
            order[i] = d;
        }
        for (int64_t e = 0; e < E; e++) {
            const uint8_t *held = P + e * D;
            const double *sh = st.share + e * D;
            int64_t h1 = -1, h2 = -1; /* e's busiest holder; its busiest holder outside h1's node */
            for (int64_t d = 0; d < D; d++)
                if (sh[d] > 0.0 && (h1 < 0 || sh[d] > sh[h1])) h1 = d;
            if (h1 < 0) continue;
            for (int64_t d = 0; d < D; d++)
                if (d / G != h1 / G && sh[d] > 0.0 && (h2 < 0 || sh[d] > sh[h2])) h2 = d;
            const int can_add = replicated[e] || distinct < t;
            for (int64_t n = 0; n < N; n++) {
                const double need = st.made[e * N + n] - st.node_share[e * N + n];
                const int64_t h = h1 / G != n ? h1 : h2;
                if (need <= 0.0 || h < 0) continue;
                int64_t targets[2] = {-1, -1}; /* the node's least loaded holder of e, least loaded open rank */
                for (int64_t r = n * G; r < (n + 1) * G; r++) {
                    if (held[r]) {
                        if (targets[0] < 0 || load[r] < load[targets[0]]) targets[0] = r;
                    } else if (freeD[r] > 0 && can_add && (targets[1] < 0 || load[r] < load[targets[1]])) {
                        targets[1] = r;
                    }
                }
                const int64_t hn = h / G;
                for (int j = 0; j < 2; j++) {
                    const int64_t r = targets[j];
                    if (r < 0) continue;
                    const double price = held[r] ? 0.0 : node_has[e * N + n] ? c->same_node : c->cross_node;
                    double x = st.share[e * D + h];
                    if (need < x) x = need;
                    if (top - load[r] < x) x = top - load[r];
                    if (!(x > 0.0)) continue;
                    double level = 0.0;
                    for (int64_t i = 0; i < no; i++)
                        if (order[i] != h && order[i] != r) { level = load[order[i]]; break; }
                    if (load[h] - x > level) level = load[h] - x;
                    if (load[r] + x > level) level = load[r] + x;
                    after(&st, e, h, r, x, &o);
                    const double ranks = (st.rin[h] + st.rout[h] + st.rin[r] + st.rout[r]) -
                                         (o.rank_ds[0] + o.rank_ds[1] + (o.rank_r[0] + o.rank_r[1]));
                    const double nodes = (st.nin[hn] + st.nout[hn] + st.nin[n] + st.nout[n]) -
                                         (o.node_a[0] + o.node_a[1] + (o.node_b[0] + o.node_b[1]));
                    const double net = c->row * (top - level) + c->intra * ranks / (double)D +
                                       c->inter * nodes / (double)N - price;
                    if (!found || net > best_net) {
                        found = 1;
                        best_net = net; best_e = e; best_r = r; best_x = x; best_h = h;
                    }
                }
            }
        }
        if (!found || best_net <= min_gain * c->row * top) break;
        const int64_t e = best_e, r = best_r;
        const double x = best_x;
        ds = best_h;
        const int64_t a = ds / G;
        if (!P[e * D + r]) {
            P[e * D + r] = 1;
            node_has[e * N + r / G] = 1;
            freeD[r]--;
            if (!replicated[e]) { replicated[e] = 1; distinct++; }
        }
        after(&st, e, ds, r, x, &o);
        st.rin[ds] = o.rank_ds[0]; st.rout[ds] = o.rank_ds[1];
        st.rin[r] = o.rank_r[0]; st.rout[r] = o.rank_r[1];
        if (o.cross) {
            const int64_t b = r / G;
            st.nin[a] = o.node_a[0]; st.nout[a] = o.node_a[1];
            st.nin[b] = o.node_b[0]; st.nout[b] = o.node_b[1];
            st.node_share[e * N + a] -= x;
            st.node_share[e * N + b] += x;
        }
        load[ds] -= x;
        load[r] += x;
        st.share[e * D + ds] -= x;
        st.share[e * D + r] += x;
    }
}
