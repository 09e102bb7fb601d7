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
    /* receive run (d, e) starts at recv_start(d, e); computed slot-major, then source */
    pos = 0;
    for (int64_t i = 0; i < D * E; i++) { start[i] = pos; pos += recv[i]; }
    int64_t out = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t d = 0; d < D; d++) {
            int64_t e = local[s], from = start[d * E + e], n = recv[d * E + e];
            for (int64_t t = 0; t < n; t++) {
                group_perm[out + t] = from + t;
                ungroup_perm[from + t] = out + t;
            }
            out += n;
        }
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

static PyMethodDef methods[] = {
    {"route_orders", route_orders, METH_VARARGS, "A rank's send, unsend and group orders from its dispatch plan."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastroute", "route() in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastroute(void) { return PyModule_Create(&module); }
