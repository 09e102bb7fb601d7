/* route() in C: a rank's per-layer index math from the dispatch plan, in linear time (the same
 * orders as ds_fssdp/moe/routing.py's route_reference, which sorts keys; tests compare them).
 *
 * Legend: A = T * K assignments (token t's k-th expert is assignment t * K + k), E experts, D
 * ranks, S experts held here (local slots), R rows received.
 *
 * Send order: destination, then expert, then assignment. Each expert's assignments, in order, are
 * cut into runs per destination in destination order (mine_ED[e, d] rows to rank d); so one pass
 * over the assignments, with a cursor per expert, places each at the next free row of its (d, e)
 * run. Receive order: source, then expert (runs of recv_DE[d, e] rows). Compute order: local slot
 * (local_E's order), then source: each (slot, source) run is a range of the receive order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int check(Py_buffer *b, Py_ssize_t n, const char *what) {
    if (b->len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd int64", what, b->len, n);
        return -1;
    }
    return 0;
}

/* The compute order (local slot, then source) as ranges of the receive order (source, then
 * expert): receive run (d, e) starts at start[d * E + e] (scratch of D * E). */
static void group_orders(const int64_t *recv, const int64_t *local, int64_t S, int64_t E, int64_t D, int64_t *start,
                         int64_t *group_perm, int64_t *ungroup_perm) {
    int64_t pos = 0;
    for (int64_t i = 0; i < D * E; i++) { start[i] = pos; pos += recv[i]; }
    int64_t out = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t d = 0; d < D; d++) {
            const int64_t e = local[s], from = start[d * E + e], n = recv[d * E + e];
            for (int64_t t = 0; t < n; t++) {
                group_perm[out + t] = from + t;
                ungroup_perm[from + t] = out + t;
            }
            out += n;
        }
}

/* route_orders(e_A, K, mine_ED, recv_DE, local_S, out) -> bool. e_A int64 [A]; mine_ED int64
 * [E, D]; recv_DE int64 [D, E]; local_S int64 [S]; out int64 [2A + 2R], written as send_token [A]
 * (the token of each sent row), unsend [A] (the send row of each assignment), group_perm [R]
 * (compute order <- receive order), ungroup_perm [R] (its inverse). False, with nothing written,
 * when an index is not an expert or the plan's rows per expert differ from e_A's counts (the
 * caller says which). */
static PyObject *route_orders(PyObject *self, PyObject *args) {
    Py_buffer eb, mb, rb, lb, ob;
    long long K, E, D;
    if (!PyArg_ParseTuple(args, "y*Ly*y*y*w*LL", &eb, &K, &mb, &rb, &lb, &ob, &E, &D)) return NULL;
    PyObject *result = NULL;
    int64_t *scratch = NULL;
    const int64_t *e_A = eb.buf, *mine = mb.buf, *recv = rb.buf, *local = lb.buf;
    int64_t A = eb.len / 8, S = lb.len / 8, R = 0;
    if (K < 1 || E < 1 || D < 1 || eb.len % 8 || lb.len % 8) {
        PyErr_Format(PyExc_ValueError, "bad route shapes: K %lld, E %lld, D %lld", K, E, D);
        goto done;
    }
    if (check(&mb, E * D, "mine_ED") || check(&rb, D * E, "recv_DE")) goto done;
    for (int64_t i = 0; i < D * E; i++) {
        if (mine[i] < 0 || recv[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "negative rows in the dispatch plan");
            goto done;
        }
        R += recv[i];
    }
    if (check(&ob, 2 * A + 2 * R, "out")) goto done;
    /* count[e] (e_A's rows per expert), then cursors: run[e] = its
       current destination, left[e] = rows left in that run, next[e] = its next send row;
       start[d * E + e] = first row of run (d, e); held[e]: e is in local_S */
    scratch = malloc(sizeof(int64_t) * (size_t)(5 * E + D * E + 1));
    if (!scratch) { PyErr_NoMemory(); goto done; }
    int64_t *count = scratch, *run = count + E, *left = run + E, *held = left + E;
    int64_t *next = held + E, *start = next + E, computed = 0;
    memset(held, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t s = 0; s < S; s++) {
        int64_t e = local[s];
        if (e < 0 || e >= E || held[e]) {
            PyErr_Format(PyExc_ValueError, "local_E[%lld] = %lld is not an expert or repeats one", (long long)s,
                         (long long)e);
            goto done;
        }
        held[e] = 1;
        for (int64_t d = 0; d < D; d++) computed += recv[d * E + e];
    }
    if (computed != R) {
        PyErr_SetString(PyExc_ValueError, "rows are received for experts not held here");
        goto done;
    }
    memset(count, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t a = 0; a < A; a++) {
        int64_t e = e_A[a];
        if (e < 0 || e >= E) { result = Py_False; Py_INCREF(result); goto done; }
        count[e]++;
    }
    for (int64_t e = 0; e < E; e++) { /* the plan sends each expert's rows */
        int64_t rows = 0;
        for (int64_t d = 0; d < D; d++) rows += mine[e * D + d];
        if (rows != count[e]) { result = Py_False; Py_INCREF(result); goto done; }
    }
    int64_t *send_token = ob.buf, *unsend = send_token + A, *group_perm = unsend + A, *ungroup_perm = group_perm + R;
    int64_t pos = 0;
    for (int64_t d = 0; d < D; d++)
        for (int64_t e = 0; e < E; e++) { start[d * E + e] = pos; pos += mine[e * D + d]; }
    for (int64_t e = 0; e < E; e++) { run[e] = -1; left[e] = 0; }
    for (int64_t t = 0, a = 0; a < A; t++) /* assignment a = t * K + k */
        for (int64_t k = 0; k < K && a < A; k++, a++) {
            int64_t e = e_A[a];
            if (!left[e]) { /* e's next nonempty run (the rows add up to its count: it exists) */
                do run[e]++; while (!mine[e * D + run[e]]);
                left[e] = mine[e * D + run[e]];
                next[e] = start[run[e] * E + e];
            }
            left[e]--;
            int64_t row = next[e]++;
            send_token[row] = t;
            unsend[a] = row;
        }
    group_orders(recv, local, S, E, D, start, group_perm, ungroup_perm);
    result = Py_True;
    Py_INCREF(result);
done:
    free(scratch);
    PyBuffer_Release(&eb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ob);
    return result;
}

/* The split route (routing.py: route with a presorted order): what the token all-to-all needs
 * first (the send order), the rest after it is launched. */

/* expert_order(e_A, K, E, order_A, token_A, start_E) -> bool: order_A int64 [A], the assignments
 * grouped by expert (stable: assignment order inside an expert), token_A [A] the token of each
 * (assignment / K), start_E int64 [E + 1] where each expert's group starts. False, nothing
 * written, when an index is not an expert. */
static PyObject *expert_order(PyObject *self, PyObject *args) {
    Py_buffer eb, ob, kb, sb;
    long long K, E;
    if (!PyArg_ParseTuple(args, "y*LLw*w*w*", &eb, &K, &E, &ob, &kb, &sb)) return NULL;
    PyObject *result = NULL;
    const int64_t *e_A = eb.buf;
    const int64_t A = eb.len / 8;
    int64_t *order = ob.buf, *token = kb.buf, *start = sb.buf;
    if (K < 1 || E < 1 || eb.len % 8 || A % K || check(&ob, A, "order_A") || check(&kb, A, "token_A") ||
        check(&sb, E + 1, "start_E")) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "bad expert_order shapes: K %lld, E %lld", K, E);
        goto done;
    }
    memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t a = 0; a < A; a++) {
        const int64_t e = e_A[a];
        if (e < 0 || e >= E) { result = Py_False; Py_INCREF(result); goto done; }
        start[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    /* cursors: start[e] is advanced while placing, then restored */
    for (int64_t t = 0, a = 0; a < A; t++)
        for (int64_t k = 0; k < K; k++, a++) {
            const int64_t p = start[e_A[a]]++;
            order[p] = a;
            token[p] = t;
        }
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    result = Py_True;
    Py_INCREF(result);
done:
    PyBuffer_Release(&eb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&sb);
    return result;
}

/* plan_tables(holder_E, rep_X, tokens_ED, flows_4F, rank, E, D, local_S, mine_ED, recv_DE) -> bool:
 * this rank's two tables of a compact DispatchPlan (plan.py: sent(rank), received(rank).T),
 * written in full; False when rows are received for an expert not in local_S (int64 [S], experts
 * in [0, E) checked by the caller). */
static PyObject *plan_tables(PyObject *self, PyObject *args) {
    Py_buffer hb, xb, tb, fb, lb, mb, rb;
    long long rank, E, D;
    if (!PyArg_ParseTuple(args, "y*y*y*y*LLLy*w*w*", &hb, &xb, &tb, &fb, &rank, &E, &D, &lb, &mb, &rb)) return NULL;
    uint8_t *held = NULL;
    PyObject *result = NULL;
    const int64_t *holder = hb.buf, *rep = xb.buf, *tokens = tb.buf, *fl = fb.buf;
    const int64_t X = xb.len / 8, F = fb.len / 32;
    int64_t *mine = mb.buf, *recv = rb.buf;
    if (rank < 0 || rank >= D || lb.len % 8 || check(&hb, E, "holder_E") || check(&tb, E * D, "tokens_ED") ||
        fb.len % 32 || check(&mb, E * D, "mine_ED") || check(&rb, D * E, "recv_DE")) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "bad plan_tables shapes: rank %lld of %lld", rank, D);
        goto done;
    }
    memset(mine, 0, sizeof(int64_t) * (size_t)(E * D));
    memset(recv, 0, sizeof(int64_t) * (size_t)(D * E));
    for (int64_t e = 0; e < E; e++) {
        const int64_t h = holder[e];
        if (h < -1 || h >= D) {
            PyErr_Format(PyExc_ValueError, "holder_E[%lld] = %lld is not a rank", (long long)e, (long long)h);
            goto done;
        }
        if (h < 0) continue;
        mine[e * D + h] = tokens[e * D + rank];
        if (h == rank)
            for (int64_t d = 0; d < D; d++) recv[d * E + e] = tokens[e * D + d];
    }
    for (int64_t f = 0; f < F; f++) { /* rows x, h, d, k */
        const int64_t x = fl[f], h = fl[F + f], d = fl[2 * F + f], k = fl[3 * F + f];
        if (x < 0 || x >= X || h < 0 || h >= D || d < 0 || d >= D || rep[x] < 0 || rep[x] >= E) {
            PyErr_SetString(PyExc_ValueError, "a dispatch plan flow names no replicated expert or rank");
            goto done;
        }
        const int64_t e = rep[x];
        if (d == rank) mine[e * D + h] = k;
        if (h == rank) recv[d * E + e] = k;
    }
    held = calloc((size_t)E, 1);
    if (!held) { PyErr_NoMemory(); goto done; }
    const int64_t *local = lb.buf;
    for (int64_t s = 0; s < lb.len / 8; s++) held[local[s]] = 1;
    result = Py_True;
    for (int64_t d = 0; d < D; d++)
        for (int64_t e = 0; e < E; e++)
            if (recv[d * E + e] && !held[e]) result = Py_False;
    Py_INCREF(result);
done:
    free(held);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    return result;
}

/* Run (e, d) of the send order starts at position cut[e * D + d] of e's group; -1 when the plan's
 * rows per expert differ from the groups' sizes (or are negative). */
static int cut_runs(const int64_t *start, const int64_t *mine, int64_t E, int64_t D, int64_t *cut) {
    for (int64_t e = 0; e < E; e++) {
        int64_t p = start[e];
        for (int64_t d = 0; d < D; d++) {
            if (mine[e * D + d] < 0) return -1;
            cut[e * D + d] = p;
            p += mine[e * D + d];
        }
        if (p != start[e + 1]) return -1;
    }
    return 0;
}

/* send_order(order_A, token_A, start_E, mine_ED, E, D, send_token) -> bool: the token of each sent
 * row in send order (destination, then expert, then assignment): each expert's group cut into
 * runs per destination in destination order. False, nothing written, when the plan's rows per
 * expert differ from the groups' sizes. */
static PyObject *send_order(PyObject *self, PyObject *args) {
    Py_buffer ob, kb, sb, mb, tb;
    long long E, D;
    if (!PyArg_ParseTuple(args, "y*y*y*y*LLw*", &ob, &kb, &sb, &mb, &E, &D, &tb)) return NULL;
    PyObject *result = NULL;
    int64_t *cut = NULL;
    const int64_t *token_A = kb.buf, *start = sb.buf, *mine = mb.buf;
    const int64_t A = ob.len / 8;
    int64_t *token = tb.buf;
    if (E < 1 || D < 1 || ob.len % 8 || check(&kb, A, "token_A") || check(&sb, E + 1, "start_E") ||
        check(&mb, E * D, "mine_ED") || check(&tb, A, "send_token")) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "bad send_order shapes: E %lld, D %lld", E, D);
        goto done;
    }
    cut = malloc(sizeof(int64_t) * (size_t)(E * D));
    if (!cut) { PyErr_NoMemory(); goto done; }
    if (cut_runs(start, mine, E, D, cut)) { result = Py_False; Py_INCREF(result); goto done; }
    int64_t row = 0;
    for (int64_t d = 0; d < D; d++)
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = mine[e * D + d];
            memcpy(token + row, token_A + cut[e * D + d], sizeof(int64_t) * (size_t)n);
            row += n;
        }
    result = Py_True;
    Py_INCREF(result);
done:
    free(cut);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&tb);
    return result;
}

/* finish_orders(order_A, start_E, mine_ED, recv_DE, local_S, E, D, unsend, group_perm, ungroup_perm):
 * the orders the exchange's return needs, after it is launched (the inputs as send_order took
 * them). Raises ValueError when rows are received for experts not held here. */
static PyObject *finish_orders(PyObject *self, PyObject *args) {
    Py_buffer ab, sb, mb, rb, lb, ub, gb, vb;
    long long E, D;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*LLw*w*w*", &ab, &sb, &mb, &rb, &lb, &E, &D, &ub, &gb, &vb)) return NULL;
    PyObject *result = NULL;
    int64_t *start = NULL;
    const int64_t *order = ab.buf, *first = sb.buf, *mine = mb.buf, *recv = rb.buf, *local = lb.buf;
    const int64_t A = ab.len / 8, S = lb.len / 8;
    int64_t R = 0;
    if (ab.len % 8 || lb.len % 8 || check(&sb, E + 1, "start_E") || check(&mb, E * D, "mine_ED") ||
        check(&rb, D * E, "recv_DE") || check(&ub, A, "unsend")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad finish_orders shapes");
        goto done;
    }
    for (int64_t i = 0; i < D * E; i++) R += recv[i];
    if (check(&gb, R, "group_perm") || check(&vb, R, "ungroup_perm")) goto done;
    int64_t computed = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t e = local[s];
        if (e < 0 || e >= E) {
            PyErr_Format(PyExc_ValueError, "local_E[%lld] = %lld is not an expert", (long long)s, (long long)e);
            goto done;
        }
        for (int64_t d = 0; d < D; d++) computed += recv[d * E + e];
    }
    if (computed != R) {
        PyErr_SetString(PyExc_ValueError, "rows are received for experts not held here");
        goto done;
    }
    int64_t *unsend = ub.buf, *group_perm = gb.buf, *ungroup_perm = vb.buf;
    start = malloc(sizeof(int64_t) * (size_t)(D * E + 1));
    if (!start) { PyErr_NoMemory(); goto done; }
    if (cut_runs(first, mine, E, D, start)) {
        PyErr_SetString(PyExc_ValueError, "the dispatch plan's rows per expert differ from the routed counts");
        goto done;
    }
    for (int64_t d = 0, row = 0; d < D; d++)
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = mine[e * D + d], *src = order + start[e * D + d];
            for (int64_t i = 0; i < n; i++) unsend[src[i]] = row + i;
            row += n;
        }
    group_orders(recv, local, S, E, D, start, group_perm, ungroup_perm);
    result = Py_None;
    Py_INCREF(result);
done:
    free(start);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ub);
    PyBuffer_Release(&gb);
    PyBuffer_Release(&vb);
    return result;
}

static PyMethodDef methods[] = {
    {"route_orders", route_orders, METH_VARARGS, "A rank's send, unsend and group orders from its dispatch plan."},
    {"expert_order", expert_order, METH_VARARGS, "Assignments grouped by expert (stable) and the groups' starts."},
    {"plan_tables", plan_tables, METH_VARARGS, "This rank's sent and received tables of a compact plan."},
    {"send_order", send_order, METH_VARARGS, "The send order from the expert groups and this rank's sent table."},
    {"finish_orders", finish_orders, METH_VARARGS, "Unsend and group orders, after the exchange is launched."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastroute", "route() in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastroute(void) { return PyModule_Create(&module); }
