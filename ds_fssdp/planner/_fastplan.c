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

typedef struct { double value; int64_t index; } HeapItem;

static inline int heap_before(HeapItem a, HeapItem b) {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

static void heap_push(HeapItem *heap, int64_t *n, double value, int64_t index) {
    int64_t i = (*n)++;
    heap[i].value = value; heap[i].index = index;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!heap_before(heap[i], heap[p])) break;
        HeapItem tmp = heap[i]; heap[i] = heap[p]; heap[p] = tmp;
        i = p;
    }
}

static void heap_pop(HeapItem *heap, int64_t *n) {
    heap[0] = heap[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, b = i;
        if (l < *n && heap_before(heap[l], heap[b])) b = l;
        if (r < *n && heap_before(heap[r], heap[b])) b = r;
        if (b == i) break;
        HeapItem tmp = heap[i]; heap[i] = heap[b]; heap[b] = tmp;
        i = b;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Joint materialization (joint.py). placement comes in as shard (| base); extended in place.
 */
static PyObject *materialize_joint(PyObject *self, PyObject *args) {
    Py_buffer owner, tokens, node, place, shard;
    long long E, D, N, t, m;
    double stop;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*LLLLLd", &owner, &tokens, &node, &place, &shard, &E, &D, &N, &t, &m,
                          &stop))
        return NULL;
    const int64_t *owner_E = owner.buf, *node_D = node.buf;
    const double *T = tokens.buf;
    uint8_t *P = place.buf;
    const uint8_t *S = shard.buf;
    double *F = calloc((size_t)(E * N + 1), sizeof(double));
    double *h = calloc((size_t)(E * N + 1), sizeof(double));
    uint8_t *repl = calloc((size_t)(E + 1), 1);
    int64_t free_D[MAX_D];
    double owned_D[MAX_D];
    double total = 0;
    if (t > E) t = E;
    if (D > MAX_D) goto done;
    for (int64_t d = 0; d < D; d++) { free_D[d] = m; owned_D[d] = 0; }
    int64_t n_repl = 0;
    for (int64_t e = 0; e < E; e++) {
        double row = 0;
        const double *Te = T + e * D;
        const uint8_t *Pe = P + e * D, *Se = S + e * D;
        double *Fe = F + e * N, *he = h + e * N;
        for (int64_t d = 0; d < D; d++) {
            Fe[node_D[d]] += Te[d];
            row += Te[d];
            if (Pe[d]) {
                he[node_D[d]] += 1;
                if (!Se[d]) { free_D[d] -= 1; repl[e] = 1; }
            }
        }
        total += row;
        owned_D[owner_E[e]] += row;
        if (repl[e]) n_repl++;
    }
    if (t == 0 || m == 0 || D == 1 || total <= 0) goto done;
    double tau = total / D;
    for (int64_t d = 0; d < D; d++) if (free_D[d] < 0) free_D[d] = 0;
    /* open[e, n]: ranks of node n that lack e and have a free slot (kept up to date) */
    int64_t *open = calloc((size_t)(E * N + 1), sizeof(int64_t));
    for (int64_t e = 0; e < E; e++)
        for (int64_t d = 0; d < D; d++)
            if (!P[e * D + d] && free_D[d] > 0) open[e * N + node_D[d]]++;
    /* v[e, n]: per-holder load (+ total while node n lacks e). A max-heap of (v, e*N + n) with
       lazy deletion finds the best open entry; the order (v descending, then index ascending)
       is the reference's argmax (first maximum). */
    double *v = malloc(sizeof(double) * (size_t)(E * N + 1));
    int64_t cap_heap = E * N + D * m + 8, hn = 0;
    HeapItem *heap = malloc(sizeof(HeapItem) * (size_t)cap_heap);
    for (int64_t i = 0; i < E * N; i++) {
        double hh = h[i], f = F[i];
        v[i] = f / (hh < 1.0 ? 1.0 : hh) + ((hh == 0 && f > 0) ? total : 0.0);
        heap_push(heap, &hn, v[i], i);
    }
    for (;;) {
        int64_t best_e = -1, best_n = -1;
        double best = -1.0;
        int limit = n_repl >= t;
        while (hn > 0) {
            HeapItem top = heap[0];
            int64_t i = top.index, e = i / N;
            if (top.value != v[i] || !open[i] || (limit && !repl[e])) { heap_pop(heap, &hn); continue; }
            best = top.value; best_e = e; best_n = i % N;
            break;
        }
        if (best_e < 0 || best < stop * tau) break;
        int64_t d_best = -1;
        for (int64_t d = 0; d < D; d++) {
            if (node_D[d] != best_n || P[best_e * D + d] || free_D[d] <= 0) continue;
            if (d_best < 0 || free_D[d] > free_D[d_best] ||
                (free_D[d] == free_D[d_best] && owned_D[d] < owned_D[d_best]))
                d_best = d;
        }
        P[best_e * D + d_best] = 1;
        open[best_e * N + best_n]--;
        free_D[d_best] -= 1;
        if (free_D[d_best] == 0)
            for (int64_t e = 0; e < E; e++)
                if (!P[e * D + d_best]) open[e * N + best_n]--;
        h[best_e * N + best_n] += 1;
        v[best_e * N + best_n] = F[best_e * N + best_n] / h[best_e * N + best_n];
        heap_push(heap, &hn, v[best_e * N + best_n], best_e * N + best_n);
        if (!repl[best_e]) { repl[best_e] = 1; n_repl++; }
    }
    free(open); free(v); free(heap);
done:
    free(F); free(h); free(repl);
    PyBuffer_Release(&owner); PyBuffer_Release(&tokens); PyBuffer_Release(&node); PyBuffer_Release(&place);
    PyBuffer_Release(&shard);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Algorithm 3 (paper dispatch): local, same node, all holders, even split with the remainder to
 * the holders following the source cyclically.
 */
static PyObject *dispatch_paper(PyObject *self, PyObject *args) {
    Py_buffer place, tokens, node, plan;
    long long E, D;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LL", &place, &tokens, &node, &plan, &E, &D)) return NULL;
    const uint8_t *P = place.buf;
    const int64_t *T = tokens.buf, *node_D = node.buf;
    int64_t *R = plan.buf;
    int64_t all[MAX_D], local[MAX_D];
    for (int64_t e = 0; e < E && D <= MAX_D; e++) {
        const uint8_t *hold = P + e * D;
        int64_t n_all = 0;
        for (int64_t d = 0; d < D; d++) if (hold[d]) all[n_all++] = d;
        for (int64_t d = 0; d < D; d++) {
            int64_t c = T[e * D + d];
            int64_t *row = R + (e * D + d) * D;
            if (hold[d]) { row[d] = c; continue; }
            if (c == 0) continue;
            /* targets: holders in d's node (ascending), else all holders */
            int64_t n = 0;
            for (int64_t i = 0; i < n_all; i++) if (node_D[all[i]] == node_D[d]) local[n++] = all[i];
            const int64_t *targets = n ? local : all;
            if (!n) n = n_all;
            int64_t q = c / n, r = c % n, first = 0;
            while (first < n && targets[first] < d) first++;
            if (first == n) first = 0;
            for (int64_t i = 0; i < n; i++) row[targets[i]] = q;
            for (int64_t k = 0; k < r; k++) row[targets[(first + k) % n]] += 1;
        }
    }
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

static PyObject *dispatch_balanced(PyObject *self, PyObject *args) {
    Py_buffer place, tokens, node, plan;
    long long E, D;
    double slack = 0.0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*LL|d", &place, &tokens, &node, &plan, &E, &D, &slack)) return NULL;
    const uint8_t *P = place.buf;
    const int64_t *T = tokens.buf, *node_D = node.buf;
    int64_t *R = plan.buf;
    int64_t base_D[MAX_D];
    memset(base_D, 0, sizeof(int64_t) * (size_t)D);
    int64_t *rep = malloc(sizeof(int64_t) * (size_t)(E + 1));
    int64_t X = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t nh = 0, owner = -1;
        for (int64_t d = 0; d < D; d++) if (P[e * D + d]) { nh++; owner = d; }
        if (nh == 1) {
            for (int64_t d = 0; d < D; d++) { R[(e * D + d) * D + owner] = T[e * D + d]; base_D[owner] += T[e * D + d]; }
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
        for (int64_t x = 0; x < X; x++) {
            int64_t *Re = R + rep[x] * D * D;
            for (int64_t h = 0; h < D; h++) {
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
    PyBuffer_Release(&place); PyBuffer_Release(&tokens); PyBuffer_Release(&node); PyBuffer_Release(&plan);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"materialize_alg1", materialize_alg1, METH_VARARGS, "Algorithm 1 in place."},
    {"materialize_joint", materialize_joint, METH_VARARGS, "Joint materialization in place."},
    {"dispatch_paper", dispatch_paper, METH_VARARGS, "Algorithm 3 into a zeroed plan."},
    {"dispatch_balanced", dispatch_balanced, METH_VARARGS, "Balancing dispatch into a zeroed plan."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastplan", "Planner hot paths in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastplan(void) { return PyModule_Create(&module); }
