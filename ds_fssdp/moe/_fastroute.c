/* route() in C: a rank's per-layer index math from the dispatch plan, in linear time (the same
 * orders as ds_fssdp/moe/routing.py's route_reference, which sorts keys; tests compare them).
 *
 * Legend: A = T * K assignments (token t's k-th expert is assignment t * K + k), E experts, D
 * ranks, S experts held here (local slots), R rows received.
 *
 * Send order: destination, then expert, then assignment. Each expert's assignments, in order, are
 * cut into runs per destination in destination order (mine_ED[e, d] rows to rank d): grouped by
 * expert once (expert_order, no plan needed), the send order is one copy per (d, e) run
 * (send_order). Receive order: source, then expert (runs of recv_DE[d, e] rows). Compute order:
 * local slot (local_E's order), then source: each (slot, source) run is a range of the receive
 * order (finish_orders, with the unsend order, once the exchange is launched).
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

/* plan_tables(holder_E, rep_X, tokens_ED, flows_4F, rank, E, D, mine_ED, recv_DE): this rank's two
 * tables of a compact DispatchPlan (plan.py: sent(rank), received(rank).T), written in full. */
static PyObject *plan_tables(PyObject *self, PyObject *args) {
    Py_buffer hb, xb, tb, fb, mb, rb;
    long long rank, E, D;
    if (!PyArg_ParseTuple(args, "y*y*y*y*LLLw*w*", &hb, &xb, &tb, &fb, &rank, &E, &D, &mb, &rb)) return NULL;
    PyObject *result = NULL;
    const int64_t *holder = hb.buf, *rep = xb.buf, *tokens = tb.buf, *fl = fb.buf;
    const int64_t X = xb.len / 8, F = fb.len / 32;
    int64_t *mine = mb.buf, *recv = rb.buf;
    if (rank < 0 || rank >= D || check(&hb, E, "holder_E") || check(&tb, E * D, "tokens_ED") ||
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
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&hb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    return result;
}

/* check_local(local_S, recv_DE, E, D) -> bool: False when rows are received for an expert not in
 * local_S; raises ValueError when local_S names an expert outside [0, E) or repeats one. */
static PyObject *check_local(PyObject *self, PyObject *args) {
    Py_buffer lb, rb;
    long long E, D;
    if (!PyArg_ParseTuple(args, "y*y*LL", &lb, &rb, &E, &D)) return NULL;
    PyObject *result = NULL;
    uint8_t *held = NULL;
    const int64_t *local = lb.buf, *recv = rb.buf;
    if (E < 1 || lb.len % 8 || check(&rb, D * E, "recv_DE")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad check_local shapes");
        goto done;
    }
    held = calloc((size_t)E, 1);
    if (!held) { PyErr_NoMemory(); goto done; }
    for (int64_t s = 0; s < lb.len / 8; s++) {
        const int64_t e = local[s];
        if (e < 0 || e >= E || held[e]) {
            PyErr_Format(PyExc_ValueError, "local_E[%lld] = %lld is not an expert or repeats one", (long long)s,
                         (long long)e);
            goto done;
        }
        held[e] = 1;
    }
    result = Py_True;
    for (int64_t i = 0; i < D * E; i++)
        if (recv[i] && !held[i % E]) result = Py_False;
    Py_INCREF(result);
done:
    free(held);
    PyBuffer_Release(&lb);
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
 * the orders the exchange's return needs, after it is launched (the inputs as send_order and
 * check_local accepted them). */
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
    {"expert_order", expert_order, METH_VARARGS, "Assignments grouped by expert (stable) and the groups' starts."},
    {"plan_tables", plan_tables, METH_VARARGS, "This rank's sent and received tables of a compact plan."},
    {"check_local", check_local, METH_VARARGS, "The local experts are experts, distinct, and hold every row received."},
    {"send_order", send_order, METH_VARARGS, "The send order from the expert groups and this rank's sent table."},
    {"finish_orders", finish_orders, METH_VARARGS, "Unsend and group orders, after the exchange is launched."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastroute", "route() in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastroute(void) { return PyModule_Create(&module); }
