/* Planner hot paths in C: the same algorithms, step for step, as the Python references in
 * ds_fssdp/planner/{materialize,joint,dispatch,balance}.py (tests compare them on random
 * instances). Planning runs every iteration for every MoE layer; the Python versions take
 * milliseconds at E=64, D=32, these take microseconds.
 *
 * Legend: E experts, D ranks, N nodes, X replicated experts. Arrays are row-major, passed as
 * buffers: placement uint8 [E*D], tokens int64 or float64 [E*D], plan int64 [E*D*D].
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 4096

/* ---------------------------------------------------------------------------------------------
 * Algorithm 1 (paper): materialize(owner, load, t, m) -> placement (in place, starts as shard).
 */
static int pick_rank_alg1(const uint8_t *holds_D, const int64_t *free_D, const double *rank_load_D,
                          const int64_t *node_D, int64_t D, int64_t N) {
    uint8_t node_holds[MAX_D];
    memset(node_holds, 0, (size_t)N);
    for (int64_t d = 0; d < D; d++)
        if (holds_D[d]) node_holds[node_D[d]] = 1;
    int best = -1;
    for (int64_t d = 0; d < D; d++) {
        if (holds_D[d] || free_D[d] <= 0) continue;
        if (best < 0) { best = (int)d; continue; }
        int a = node_holds[node_D[d]], b = node_holds[node_D[best]];
        if (a != b) { if (a < b) best = (int)d; continue; }
        if (free_D[d] != free_D[best]) { if (free_D[d] > free_D[best]) best = (int)d; continue; }
        if (rank_load_D[d] != rank_load_D[best]) { if (rank_load_D[d] < rank_load_D[best]) best = (int)d; continue; }
    }
    return best;
}

static PyObject *materialize_alg1(PyObject *self, PyObject *args) {
    Py_buffer owner, load, node, place;
    long long E, D, N, t, m;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LLLLL", &owner, &load, &node, &place, &E, &D, &N, &t, &m)) return NULL;
    const int64_t *owner_E = owner.buf, *node_D = node.buf;
    const double *load_E = load.buf;
    uint8_t *P = place.buf;
    int64_t free_D[MAX_D];
    double rank_load_D[MAX_D];
    int64_t *top = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    double total = 0;
    for (int64_t e = 0; e < E; e++) total += load_E[e];
    if (t > E) t = E;
    if (m > t) m = t;
    if (t == 0 || m == 0 || D == 1 || total <= 0 || D > MAX_D) goto done;
    /* top-t by load, ties to the lower id (stable insertion order) */
    for (int64_t e = 0; e < E; e++) top[e] = e;
    for (int64_t i = 1; i < E; i++) {
        int64_t v = top[i], j = i - 1;
        while (j >= 0 && load_E[top[j]] < load_E[v]) { top[j + 1] = top[j]; j--; }
        top[j + 1] = v;
    }
    if (t <= m) {
        for (int64_t i = 0; i < t; i++) memset(P + top[i] * D, 1, (size_t)D);
        goto done;
    }
    for (int64_t d = 0; d < D; d++) { free_D[d] = m; rank_load_D[d] = 0; }
    for (int64_t e = 0; e < E; e++) rank_load_D[owner_E[e]] += load_E[e];
    int64_t slots_left = D * m;
    double load_left = 0;
    for (int64_t i = 0; i < t; i++) load_left += load_E[top[i]];
    for (int64_t i = 0; i < t; i++) {
        int64_t e = top[i];
        double l = load_E[e];
        if (slots_left == 0 || load_left <= 0) break;
        int64_t n = (int64_t)floor(slots_left * l / load_left + 0.5);
        if (n > slots_left) n = slots_left;
        load_left -= l;
        for (int64_t k = 0; k < n; k++) {
            int d = pick_rank_alg1(P + e * D, free_D, rank_load_D, node_D, D, N);
            if (d < 0) break;
            P[e * D + d] = 1;
            free_D[d] -= 1;
            slots_left -= 1;
        }
    }
done:
    free(top);
    PyBuffer_Release(&owner); PyBuffer_Release(&load); PyBuffer_Release(&node); PyBuffer_Release(&place);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Joint materialization (joint.py). placement comes in as shard (| base); extended in place.
 */
/* best_n[e] / best_v[e]: the open node with the largest v[e, n] (ties: lowest n), -1 if none. */
static void joint_best(int64_t e, int64_t N, const double *v, const int64_t *open, int64_t *best_n, double *best_v) {
    best_n[e] = -1;
    best_v[e] = -1.0;
    for (int64_t n = 0; n < N; n++)
        if (open[e * N + n] && v[e * N + n] > best_v[e]) { best_v[e] = v[e * N + n]; best_n[e] = n; }
}

static PyObject *materialize_joint(PyObject *self, PyObject *args) {
    Py_buffer owner, tokens, node, place;
    long long E, D, N, t, m;
    double stop;
    /* place: zeroed uint8 [E*D]; the shard is written here, then extended */
    if (!PyArg_ParseTuple(args, "y*y*y*w*LLLLLd", &owner, &tokens, &node, &place, &E, &D, &N, &t, &m, &stop))
        return NULL;
    const int64_t *owner_E = owner.buf, *node_D = node.buf;
    const double *T = tokens.buf;
    uint8_t *P = place.buf;
    double *F = calloc((size_t)(E * N + 1), sizeof(double));
    double *h = calloc((size_t)(E * N + 1), sizeof(double));
    int64_t *open = calloc((size_t)(E * N + 1), sizeof(int64_t));
    double *v = malloc(sizeof(double) * (size_t)(E * N + 1));
    int64_t *best_n = malloc(sizeof(int64_t) * (size_t)(E + 1));
    double *best_v = malloc(sizeof(double) * (size_t)(E + 1));
    uint8_t *repl = calloc((size_t)(E + 1), 1);
    int64_t free_D[MAX_D];
    double owned_D[MAX_D];
    double total = 0;
    if (t > E) t = E;
    if (D > MAX_D) goto done;
    for (int64_t e = 0; e < E; e++) P[e * D + owner_E[e]] = 1;
    for (int64_t d = 0; d < D; d++) { free_D[d] = m; owned_D[d] = 0; }
    /* nodes are contiguous blocks of G ranks (Topology: node of d = d // G) */
    int64_t G = D / N;
    for (int64_t e = 0; e < E; e++) {
        double row = 0;
        const double *Te = T + e * D;
        for (int64_t n = 0; n < N; n++) {
            double fn = 0;
            for (int64_t g = 0; g < G; g++) fn += Te[n * G + g];
            F[e * N + n] = fn;
        }
        for (int64_t d = 0; d < D; d++) row += Te[d];
        h[e * N + node_D[owner_E[e]]] = 1;
        total += row;
        owned_D[owner_E[e]] += row;
        /* every rank has all m slots free, so a node is open for e at all its ranks but the owner */
        for (int64_t n = 0; n < N; n++) open[e * N + n] = G - (node_D[owner_E[e]] == n);
    }
    if (t == 0 || m == 0 || D == 1 || total <= 0) goto done;
    double tau = total / D;
    int64_t n_repl = 0;
    /* v[e, n]: per-holder load, plus total while node n lacks e (cover first) */
    for (int64_t i = 0; i < E * N; i++) {
        double hh = h[i], f = F[i];
        v[i] = f / (hh < 1.0 ? 1.0 : hh) + ((hh == 0 && f > 0) ? total : 0.0);
    }
    for (int64_t e = 0; e < E; e++) joint_best(e, N, v, open, best_n, best_v);
    for (;;) {
        /* the reference's argmax over (e, n), e-major: the first largest */
        int64_t be = -1;
        double best = -1.0;
        int limit = n_repl >= t;
        for (int64_t e = 0; e < E; e++) {
            if (best_n[e] < 0 || (limit && !repl[e])) continue;
            if (best_v[e] > best) { best = best_v[e]; be = e; }
        }
        if (be < 0 || best < stop * tau) break;
        int64_t bn = best_n[be], d_best = -1;
        for (int64_t d = bn * G; d < (bn + 1) * G; d++) {
            if (P[be * D + d] || free_D[d] <= 0) continue;
            if (d_best < 0 || free_D[d] > free_D[d_best] ||
                (free_D[d] == free_D[d_best] && owned_D[d] < owned_D[d_best]))
                d_best = d;
        }
        P[be * D + d_best] = 1;
        open[be * N + bn]--;
        h[be * N + bn] += 1;
        v[be * N + bn] = F[be * N + bn] / h[be * N + bn];
        free_D[d_best] -= 1;
        if (free_D[d_best] == 0)
            for (int64_t e = 0; e < E; e++)
                if (!P[e * D + d_best] && --open[e * N + bn] == 0 && best_n[e] == bn)
                    joint_best(e, N, v, open, best_n, best_v);
        joint_best(be, N, v, open, best_n, best_v);
        if (!repl[be]) { repl[be] = 1; n_repl++; }
    }
done:
    free(F); free(h); free(open); free(v); free(best_n); free(best_v); free(repl);
    PyBuffer_Release(&owner); PyBuffer_Release(&tokens); PyBuffer_Release(&node); PyBuffer_Release(&place);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Algorithm 3 (paper dispatch): local, same node, all holders, even split with the remainder to
 * the holders following the source cyclically.
 */
/* Output layouts. Dense: plan [E*D*D] (expert, source, holder), zeroed by the caller. Compact:
 * flows [X*D*D] of the experts with more than one holder, ascending (expert, holder, source);
 * single-holder experts are implied by the placement (all their tokens go to the holder). */
#define OUT(e, x, d, h) (compact ? &R[((x) * D + (h)) * D + (d)] : &R[((e) * D + (d)) * D + (h)])

static void paper_core(const uint8_t *P, const int64_t *T, const int64_t *node_D, int64_t *R, int64_t E, int64_t D,
                       int compact) {
    int64_t all[MAX_D], local[MAX_D];
    int64_t x = -1;
    for (int64_t e = 0; e < E && D <= MAX_D; e++) {
        const uint8_t *hold = P + e * D;
        int64_t n_all = 0;
        for (int64_t d = 0; d < D; d++) if (hold[d]) all[n_all++] = d;
        if (n_all > 1) x++;
        else if (compact) continue;
        for (int64_t d = 0; d < D; d++) {
            int64_t c = T[e * D + d];
            if (hold[d]) { *OUT(e, x, d, d) = c; continue; }
            if (c == 0) continue;
            /* targets: holders in d's node (ascending), else all holders */
            int64_t n = 0;
            for (int64_t i = 0; i < n_all; i++) if (node_D[all[i]] == node_D[d]) local[n++] = all[i];
            const int64_t *targets = n ? local : all;
            if (!n) n = n_all;
            int64_t q = c / n, r = c % n, first = 0;
            while (first < n && targets[first] < d) first++;
            if (first == n) first = 0;
            for (int64_t i = 0; i < n; i++) *OUT(e, x, d, targets[i]) = q;
            for (int64_t k = 0; k < r; k++) *OUT(e, x, d, targets[(first + k) % n]) += 1;
        }
    }
}

static PyObject *dispatch_paper(PyObject *self, PyObject *args) {
    Py_buffer place, tokens, node, plan;
    long long E, D;
    int compact = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LL|p", &place, &tokens, &node, &plan, &E, &D, &compact)) return NULL;
    paper_core(place.buf, tokens.buf, node.buf, plan.buf, E, D, compact);
    PyBuffer_Release(&place); PyBuffer_Release(&tokens); PyBuffer_Release(&node); PyBuffer_Release(&plan);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Balancing dispatch (balance.py): fixed single-holder experts, the Hall bound, a greedy fill
 * under the cap, then augmenting paths (same node first), growing the cap if needed.
 */
typedef struct {
    int64_t X, D;
    const int64_t *rep;      /* [X] expert ids */
    const uint8_t *P;        /* [E*D] */
    const int64_t *node_D;
    int64_t *rows;           /* [D] */
    int64_t cap;
    int64_t *flow;           /* [X*D*D] flows of replicated expert x into holder h from source d */
    int64_t *inflow;         /* [X*D] sources with a positive flow of x into h */
    int64_t *rem;            /* [X*D] */
    int64_t **holders;       /* per x: holder list */
    int64_t *nholders;
} Fill;

static inline int64_t room(const Fill *f, int64_t h) { return f->cap - f->rows[h]; }

/* Holder-major, so a search scanning the sources that send into holder h reads one row. */
#define FLOW(f, x, d, h) ((f)->flow[((x) * (f)->D + (h)) * (f)->D + (d)])

static void fill_move(Fill *f, int64_t x, int64_t d, int64_t h, int64_t k) {
    int64_t *cell = &FLOW(f, x, d, h);
    f->inflow[x * f->D + h] += (*cell == 0 && k > 0) - (*cell > 0 && *cell + k == 0);
    *cell += k;
    f->rows[h] += k;
}

static void fill_greedy(Fill *f, const int64_t *order) {
    int64_t D = f->D;
    for (int64_t oi = 0; oi < f->X; oi++) {
        int64_t x = order[oi];
        int64_t *H = f->holders[x], nh = f->nholders[x];
        for (int64_t i = 0; i < nh; i++) {
            int64_t h = H[i];
            int64_t r = room(f, h);
            int64_t k = f->rem[x * D + h];
            if (r < 0) r = 0;
            if (k > r) k = r;
            if (k) { fill_move(f, x, h, h, k); f->rem[x * D + h] -= k; }
        }
        for (int64_t d = 0; d < D; d++) {
            while (f->rem[x * D + d]) {
                int64_t best = -1, best_room = 0;
                for (int64_t i = 0; i < nh; i++) {
                    int64_t h = H[i];
                    if (f->node_D[h] != f->node_D[d]) continue;
                    int64_t r = room(f, h);
                    if (best < 0 || r > best_room) { best = h; best_room = r; }
                }
                if (best < 0 || best_room <= 0) break;
                int64_t k = f->rem[x * D + d] < best_room ? f->rem[x * D + d] : best_room;
                fill_move(f, x, d, best, k);
                f->rem[x * D + d] -= k;
            }
        }
    }
}

/* One augmenting path; returns 1 if found and pushed. */
static void mark_seen(Fill *f, uint8_t *seen, int64_t *unseen_X, int64_t h) {
    seen[h] = 1;
    for (int64_t x = 0; x < f->X; x++)
        if (f->P[f->rep[x] * f->D + h]) unseen_X[x]--;
}

static int fill_augment(Fill *f, int cross, int64_t *prev_x, int64_t *prev_d, int64_t *prev_h, int64_t *queue,
                        uint8_t *seen, int64_t *unseen_X) {
    int64_t D = f->D, X = f->X;
    int64_t qh = 0, qt = 0;
    memset(seen, 0, (size_t)D);
    for (int64_t x = 0; x < X; x++) unseen_X[x] = f->nholders[x];
    int tiers = cross ? 2 : 1;
    for (int tier = 0; tier < tiers; tier++) {
        int same = tier == 0;
        for (int64_t x = 0; x < X; x++) {
            for (int64_t d = 0; d < D; d++) {
                if (!f->rem[x * D + d]) continue;
                for (int64_t i = 0; i < f->nholders[x]; i++) {
                    int64_t h = f->holders[x][i];
                    if (seen[h] || ((f->node_D[h] == f->node_D[d]) != same)) continue;
                    mark_seen(f, seen, unseen_X, h); prev_x[h] = x; prev_d[h] = d; prev_h[h] = -1;
                    queue[qt++] = h;
                }
            }
        }
    }
    while (qh < qt) {
        int64_t h = queue[qh++];
        if (room(f, h) > 0) {
            /* walk back: find the start, then the bottleneck */
            int64_t end = h, cur = h, x0 = -1, d0 = -1;
            int64_t k = room(f, end);
            while (cur >= 0) {
                int64_t b = prev_h[cur];
                if (b < 0) { x0 = prev_x[cur]; d0 = prev_d[cur]; }
                else {
                    int64_t fl = FLOW(f, prev_x[cur], prev_d[cur], b);
                    if (fl < k) k = fl;
                }
                cur = b;
            }
            if (f->rem[x0 * D + d0] < k) k = f->rem[x0 * D + d0];
            cur = end;
            while (cur >= 0) {
                int64_t b = prev_h[cur], x = prev_x[cur], d = prev_d[cur];
                if (b >= 0) fill_move(f, x, d, b, -k);
                fill_move(f, x, d, cur, k);
                cur = b;
            }
            f->rem[x0 * D + d0] -= k;
            return 1;
        }
        for (int64_t x = 0; x < X; x++) {
            /* skip x if every holder of x is reached already, or nothing of x is on h */
            if (!unseen_X[x] || !f->inflow[x * D + h]) continue;
            const int64_t *in = &FLOW(f, x, 0, h);
            for (int64_t d = 0; d < D && unseen_X[x]; d++) {
                if (!in[d]) continue;
                for (int tier = 0; tier < tiers; tier++) {
                    int same = tier == 0;
                    for (int64_t i = 0; i < f->nholders[x]; i++) {
                        int64_t h2 = f->holders[x][i];
                        if (seen[h2] || ((f->node_D[h2] == f->node_D[d]) != same)) continue;
                        mark_seen(f, seen, unseen_X, h2); prev_x[h2] = x; prev_d[h2] = d; prev_h[h2] = h;
                        queue[qt++] = h2;
                    }
                }
            }
        }
    }
    return 0;
}

/* Tokens left go straight to the holder with the most room, in any node (one-edge paths). */
static void fill_direct_cross(Fill *f) {
    int64_t D = f->D;
    for (int64_t x = 0; x < f->X; x++) {
        int64_t *H = f->holders[x], nh = f->nholders[x];
        for (int64_t d = 0; d < D; d++) {
            while (f->rem[x * D + d]) {
                int64_t best = -1, best_room = 0;
                for (int64_t i = 0; i < nh; i++) {
                    int64_t r = room(f, H[i]);
                    if (best < 0 || r > best_room) { best = H[i]; best_room = r; }
                }
                if (best < 0 || best_room <= 0) break;
                int64_t k = f->rem[x * D + d] < best_room ? f->rem[x * D + d] : best_room;
                fill_move(f, x, d, best, k);
                f->rem[x * D + d] -= k;
            }
        }
    }
}

static int any_rem(const Fill *f) {
    for (int64_t i = 0; i < f->X * f->D; i++) if (f->rem[i]) return 1;
    return 0;
}

static double row_bound(const uint8_t *P, const int64_t *rep, int64_t X, const int64_t *load_X,
                        const int64_t *base_D, int64_t D) {
    double bound = 0, sum = 0;
    for (int64_t d = 0; d < D; d++) { if (base_D[d] > bound) bound = (double)base_D[d]; sum += (double)base_D[d]; }
    for (int64_t x = 0; x < X; x++) sum += (double)load_X[x];
    if (sum / D > bound) bound = sum / D;
    if (X == 0) return bound;
    if (X <= 10) {
        /* reach[mask] (holder bitsets, W words) and load[mask] built from mask without its
           lowest bit; the numerator adds the base of every reached rank. */
        int64_t W = (D + 63) / 64, M = (int64_t)1 << X;
        uint64_t *reach = calloc((size_t)(M * W), sizeof(uint64_t));
        uint64_t *hb = calloc((size_t)(X * W), sizeof(uint64_t));
        int64_t *lsum = calloc((size_t)M, sizeof(int64_t));
        for (int64_t x = 0; x < X; x++)
            for (int64_t d = 0; d < D; d++)
                if (P[rep[x] * D + d]) hb[x * W + d / 64] |= (uint64_t)1 << (d % 64);
        for (int64_t mask = 1; mask < M; mask++) {
            int64_t low = __builtin_ctzll((unsigned long long)mask), rest = mask & (mask - 1);
            lsum[mask] = lsum[rest] + load_X[low];
            double num = (double)lsum[mask];
            int64_t cnt = 0;
            for (int64_t w = 0; w < W; w++) {
                uint64_t bits = reach[rest * W + w] | hb[low * W + w];
                reach[mask * W + w] = bits;
                cnt += __builtin_popcountll(bits);
                while (bits) {
                    int b = __builtin_ctzll(bits);
                    num += (double)base_D[w * 64 + b];
                    bits &= bits - 1;
                }
            }
            if (num / cnt > bound) bound = num / cnt;
        }
        free(reach); free(hb); free(lsum);
    } else {
        /* singletons and the hottest prefixes (stable order by load, descending) */
        int64_t *order = malloc(sizeof(int64_t) * (size_t)X);
        for (int64_t x = 0; x < X; x++) order[x] = x;
        for (int64_t i = 1; i < X; i++) {
            int64_t v = order[i], j = i - 1;
            while (j >= 0 && load_X[order[j]] < load_X[v]) { order[j + 1] = order[j]; j--; }
            order[j + 1] = v;
        }
        uint8_t *in = calloc((size_t)X, 1);
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t i = 0; i < X; i++) {
                if (pass == 0) { memset(in, 0, (size_t)X); in[i] = 1; } else in[order[i]] = 1;
                double num = 0;
                int64_t cnt = 0;
                for (int64_t x = 0; x < X; x++) if (in[x]) num += (double)load_X[x];
                for (int64_t d = 0; d < D; d++) {
                    int reach = 0;
                    for (int64_t x = 0; x < X && !reach; x++) if (in[x] && P[rep[x] * D + d]) reach = 1;
                    if (reach) { num += (double)base_D[d]; cnt++; }
                }
                if (num / cnt > bound) bound = num / cnt;
            }
            memset(in, 0, (size_t)X);
        }
        free(in); free(order);
    }
    return bound;
}

static void balanced_core(const uint8_t *P, const int64_t *T, const int64_t *node_D, int64_t *R, int64_t E,
                          int64_t D, double slack, int compact) {
    int64_t base_D[MAX_D];
    memset(base_D, 0, sizeof(int64_t) * (size_t)D);
    int64_t *rep = malloc(sizeof(int64_t) * (size_t)(E + 1));
    int64_t X = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t nh = 0, owner = -1;
        for (int64_t d = 0; d < D; d++) if (P[e * D + d]) { nh++; owner = d; }
        if (nh == 1) {
            for (int64_t d = 0; d < D; d++) {
                if (!compact) R[(e * D + d) * D + owner] = T[e * D + d];
                base_D[owner] += T[e * D + d];
            }
        } else if (nh > 1) {
            rep[X++] = e;
        }
    }
    if (X > 0) {
        int64_t *load_X = calloc((size_t)X, sizeof(int64_t));
        Fill f;
        f.X = X; f.D = D; f.rep = rep; f.P = P; f.node_D = node_D;
        f.rows = malloc(sizeof(int64_t) * (size_t)D);
        memcpy(f.rows, base_D, sizeof(int64_t) * (size_t)D);
        f.flow = calloc((size_t)(X * D * D), sizeof(int64_t));
        f.inflow = calloc((size_t)(X * D), sizeof(int64_t));
        f.rem = malloc(sizeof(int64_t) * (size_t)(X * D));
        f.holders = malloc(sizeof(int64_t *) * (size_t)X);
        f.nholders = calloc((size_t)X, sizeof(int64_t));
        for (int64_t x = 0; x < X; x++) {
            int64_t e = rep[x];
            f.holders[x] = malloc(sizeof(int64_t) * (size_t)D);
            for (int64_t d = 0; d < D; d++) {
                f.rem[x * D + d] = T[e * D + d];
                load_X[x] += T[e * D + d];
                if (P[e * D + d]) f.holders[x][f.nholders[x]++] = d;
            }
        }
        f.cap = (int64_t)ceil(row_bound(P, rep, X, load_X, base_D, D) * (1.0 + slack) - 1e-9);
        /* order: fewest holders, then most tokens, then id */
        int64_t *order = malloc(sizeof(int64_t) * (size_t)X);
        for (int64_t x = 0; x < X; x++) order[x] = x;
        for (int64_t i = 1; i < X; i++) {
            int64_t v = order[i], j = i - 1;
            while (j >= 0) {
                int64_t u = order[j];
                int later = f.nholders[u] > f.nholders[v] ||
                            (f.nholders[u] == f.nholders[v] && load_X[u] < load_X[v]);
                if (!later) break;
                order[j + 1] = u; j--;
            }
            order[j + 1] = v;
        }
        fill_greedy(&f, order);
        int64_t *prev_x = malloc(sizeof(int64_t) * (size_t)D), *prev_d = malloc(sizeof(int64_t) * (size_t)D);
        int64_t *prev_h = malloc(sizeof(int64_t) * (size_t)D), *queue = malloc(sizeof(int64_t) * (size_t)D);
        uint8_t *seen = malloc((size_t)D);
        int64_t *unseen_X = malloc(sizeof(int64_t) * (size_t)X);
        while (any_rem(&f) && fill_augment(&f, 0, prev_x, prev_d, prev_h, queue, seen, unseen_X)) {}
        fill_direct_cross(&f);
        while (any_rem(&f)) {
            if (!fill_augment(&f, 1, prev_x, prev_d, prev_h, queue, seen, unseen_X)) {
                int64_t grown = (int64_t)ceil((double)f.cap * 1.01);
                f.cap = grown > f.cap + 1 ? grown : f.cap + 1;
            }
        }
        if (compact) memcpy(R, f.flow, sizeof(int64_t) * (size_t)(X * D * D));
        for (int64_t x = 0; x < X; x++) {
            int64_t *Re = R + rep[x] * D * D;
            for (int64_t h = 0; h < D && !compact; h++) {
                const int64_t *in = &FLOW(&f, x, 0, h);
                if (f.inflow[x * D + h])
                    for (int64_t d = 0; d < D; d++) Re[d * D + h] = in[d];
            }
            free(f.holders[x]);
        }
        free(prev_x); free(prev_d); free(prev_h); free(queue); free(seen); free(unseen_X); free(order);
        free(f.rows); free(f.flow); free(f.inflow); free(f.rem); free(f.holders); free(f.nholders); free(load_X);
    }
    free(rep);
}

static PyObject *dispatch_balanced(PyObject *self, PyObject *args) {
    Py_buffer place, tokens, node, plan;
    long long E, D;
    double slack = 0.0;
    int compact = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LL|dp", &place, &tokens, &node, &plan, &E, &D, &slack, &compact))
        return NULL;
    balanced_core(place.buf, tokens.buf, node.buf, plan.buf, E, D, slack, compact);
    PyBuffer_Release(&place); PyBuffer_Release(&tokens); PyBuffer_Release(&node); PyBuffer_Release(&plan);
    Py_RETURN_NONE;
}

/* The compact plan in one call: (holder_E, rep_X, flows_XHD) as bytes (int64). */
static PyObject *dispatch_compact(PyObject *self, PyObject *args) {
    Py_buffer place, tokens, node;
    long long E, D;
    double slack = 0.0;
    int balanced = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*LLdp", &place, &tokens, &node, &E, &D, &slack, &balanced)) return NULL;
    const uint8_t *P = place.buf;
    PyObject *holder = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(int64_t) * (size_t)E));
    int64_t *H = holder ? (int64_t *)PyBytes_AS_STRING(holder) : NULL;
    int64_t X = 0, missing = -1;
    for (int64_t e = 0; H && e < E; e++) {
        int64_t nh = 0, last = -1;
        for (int64_t d = 0; d < D; d++) if (P[e * D + d]) { nh++; last = d; }
        if (nh == 0 && missing < 0) missing = e;
        H[e] = nh == 1 ? last : -1;
        X += nh > 1;
    }
    PyObject *rep = NULL, *flows = NULL, *out = NULL;
    if (!holder) goto fail;
    if (missing >= 0) {
        PyErr_Format(PyExc_ValueError, "every expert needs at least one holder in placement_ED (expert %lld has none)",
                     (long long)missing);
        goto fail;
    }
    rep = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(int64_t) * (size_t)X));
    flows = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(int64_t) * (size_t)(X * D * D)));
    if (!rep || !flows) goto fail;
    int64_t *RX = (int64_t *)PyBytes_AS_STRING(rep), *FL = (int64_t *)PyBytes_AS_STRING(flows);
    for (int64_t e = 0, x = 0; e < E; e++) if (H[e] < 0) RX[x++] = e;
    memset(FL, 0, sizeof(int64_t) * (size_t)(X * D * D));
    if (balanced) balanced_core(P, tokens.buf, node.buf, FL, E, D, slack, 1);
    else paper_core(P, tokens.buf, node.buf, FL, E, D, 1);
    out = PyTuple_Pack(3, holder, rep, flows);
fail:
    Py_XDECREF(holder); Py_XDECREF(rep); Py_XDECREF(flows);
    PyBuffer_Release(&place); PyBuffer_Release(&tokens); PyBuffer_Release(&node);
    return out;
}

static PyMethodDef methods[] = {
    {"materialize_alg1", materialize_alg1, METH_VARARGS, "Algorithm 1 in place."},
    {"materialize_joint", materialize_joint, METH_VARARGS, "Joint materialization in place."},
    {"dispatch_paper", dispatch_paper, METH_VARARGS, "Algorithm 3 into a zeroed plan."},
    {"dispatch_balanced", dispatch_balanced, METH_VARARGS, "Balancing dispatch into a zeroed plan."},
    {"dispatch_compact", dispatch_compact, METH_VARARGS, "Either dispatch as (holder_E, rep_X, flows_XHD) bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastplan", "Planner hot paths in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastplan(void) { return PyModule_Create(&module); }
