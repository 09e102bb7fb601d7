/* The lower bound's shortest path over the layers (ds_fssdp/sim/bound.py, chain_bound) in C: the
 * same floating operations in the same order as its numpy path, so the same numbers bit for bit
 * (built with -ffp-contract=off: no fused multiply-add). One call runs every weight u of the
 * forward and every group b, each at every v.
 *
 * Legend: L layers, K states, C choices (state_C sorted; starts_K: each state's first choice), B
 * groups, V values of v, U values of u. Arrays are row-major float64: m_LKB, busy_LKB [L*K*B],
 * b_LCB [L*C*B], g_C, extra_C [C], v_V [V], u_U [U]; starts_K int64 [K]; out_UBV [U*B*V] (the
 * least over the choices before the all-reduce term (1 - v) all-reduce, which the caller adds). Also
 * top_rows' transposes and running sums.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

static inline double min2(double a, double b) { return b < a ? b : a; } /* np.minimum without NaN */
static inline double max2(double a, double b) { return b > a ? b : a; } /* np.maximum without NaN */

/* np.argsort(a_K, kind="stable"): a merge sort of the indices (ties keep their order). */
static void stable_order(const double *a, int64_t *order, int64_t *tmp, int64_t K) {
    for (int64_t k = 0; k < K; k++) order[k] = k;
    for (int64_t w = 1; w < K; w *= 2) {
        for (int64_t lo = 0; lo < K; lo += 2 * w) {
            int64_t mid = lo + w < K ? lo + w : K, hi = lo + 2 * w < K ? lo + 2 * w : K;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = a[order[j]] < a[order[i]] ? order[j++] : order[i++];
            while (i < mid) tmp[o++] = order[i++];
            while (j < hi) tmp[o++] = order[j++];
        }
        for (int64_t k = 0; k < K; k++) order[k] = tmp[k];
    }
}

/* np.searchsorted(sorted_K, x, side="right"): how many are <= x. */
static inline int64_t count_le(const double *sorted_K, int64_t K, double x) {
    int64_t lo = 0, hi = K;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (sorted_K[mid] <= x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* One (u, b): chain_bound's loop. value_VC: the choices' values, scratch the rest. */
static void one_chain(const double *m, const double *busy, const double *bk, const double *g, const double *extra,
                      const int64_t *starts, const double *v, double u, double attention, int64_t L, int64_t K,
                      int64_t C, int64_t B, int64_t V, int64_t b, double *value_VC, double *value_VK, double *a_K,
                      double *a_sorted, double *below_VK, double *above_VK, double *ug_C, int64_t *order,
                      int64_t *tmp, int64_t *i_C, double *out_V) {
    const double att = u * attention;
    for (int64_t c = 0; c < C; c++) ug_C[c] = u * g[c];
    for (int64_t x = 0; x < V; x++) /* layer 0: its window is its attention alone */
        for (int64_t c = 0; c < C; c++)
            value_VC[x * C + c] = max2(att, ug_C[c]) + v[x] * bk[c * B + b] + extra[c];
    for (int64_t l = 1; l < L; l++) {
        const double *m_K = m + (l - 1) * K * B, *busy_K = busy + (l - 1) * K * B, *b_C = bk + l * C * B;
        for (int64_t k = 0; k < K; k++) a_K[k] = att + u * m_K[k * B + b] - u * busy_K[k * B + b];
        for (int64_t x = 0; x < V; x++) /* the least over each state's run of choices, + busy */
            for (int64_t k = 0; k < K; k++) {
                int64_t end = k + 1 < K ? starts[k + 1] : C;
                double least = value_VC[x * C + starts[k]];
                for (int64_t c = starts[k] + 1; c < end; c++) least = min2(least, value_VC[x * C + c]);
                value_VK[x * K + k] = least + u * busy_K[k * B + b];
            }
        stable_order(a_K, order, tmp, K);
        for (int64_t k = 0; k < K; k++) a_sorted[k] = a_K[order[k]];
        for (int64_t x = 0; x < V; x++) {
            const double *vk = value_VK + x * K;
            double *below = below_VK + x * K, *above = above_VK + x * K;
            below[0] = vk[order[0]];
            for (int64_t k = 1; k < K; k++) below[k] = min2(below[k - 1], vk[order[k]]);
            above[K - 1] = vk[order[K - 1]] + a_sorted[K - 1];
            for (int64_t k = K - 2; k >= 0; k--) above[k] = min2(above[k + 1], vk[order[k]] + a_sorted[k]);
        }
        for (int64_t c = 0; c < C; c++) i_C[c] = count_le(a_sorted, K, ug_C[c]);
        for (int64_t x = 0; x < V; x++) {
            const double *below = below_VK + x * K, *above = above_VK + x * K;
            for (int64_t c = 0; c < C; c++) {
                int64_t i = i_C[c];
                double best = i == 0 ? above[0] : i == K ? below[K - 1] + ug_C[c] : min2(below[i - 1] + ug_C[c], above[i]);
                value_VC[x * C + c] = best + v[x] * b_C[c * B + b] + extra[c];
            }
        }
    }
    const double *m_K = m + (L - 1) * K * B;
    for (int64_t x = 0; x < V; x++) {
        double least = 0.0;
        for (int64_t k = 0; k < K; k++) {
            int64_t end = k + 1 < K ? starts[k + 1] : C;
            double run = value_VC[x * C + starts[k]];
            for (int64_t c = starts[k] + 1; c < end; c++) run = min2(run, value_VC[x * C + c]);
            run = run + u * m_K[k * B + b];
            least = k == 0 ? run : min2(least, run);
        }
        out_V[x] = least;
    }
}

/* chain(m_LKB, busy_LKB, b_LCB, g_C, extra_C, starts_K, v_V, u_U, out_UBV, L, B, attention_s) */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer m, busy, bk, g, extra, starts, v, u, out;
    long long L, B;
    double attention;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*w*LLd", &m, &busy, &bk, &g, &extra, &starts, &v, &u, &out, &L, &B,
                          &attention))
        return NULL;
    Py_buffer *all[] = {&m, &busy, &bk, &g, &extra, &starts, &v, &u, &out};
    int64_t K = starts.len / 8, C = g.len / 8, V = v.len / 8, U = u.len / 8;
    const int64_t *st = starts.buf;
    int ok = L >= 1 && B >= 1 && K >= 1 && V >= 1 && m.len == 8 * L * K * B && busy.len == m.len &&
             bk.len == 8 * L * C * B && extra.len == g.len && out.len == 8 * U * B * V && st[0] == 0;
    for (int64_t k = 1; ok && k < K; k++) ok = st[k] > st[k - 1];
    ok = ok && st[K - 1] < C;
    PyObject *result = NULL;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "chain: sizes disagree (m, busy [L*K*B], b [L*C*B], g, extra [C], "
                                          "starts [K] from 0, increasing, below C, out [U*B*V])");
        goto done;
    }
    size_t doubles = (size_t)(3 * V * K + 3 * K + V * C + C), ints = (size_t)(2 * K + C);
    double *work = malloc(doubles * sizeof(double) + ints * sizeof(int64_t));
    if (!work) { PyErr_NoMemory(); goto done; }
    double *value_VC = work, *value_VK = value_VC + V * C, *below = value_VK + V * K, *above = below + V * K;
    double *a_K = above + V * K, *a_sorted = a_K + K, *ug_C = a_sorted + K;
    int64_t *order = (int64_t *)(ug_C + C), *tmp = order + K, *i_C = tmp + K;
    const double *u_U = u.buf;
    for (int64_t x = 0; x < U; x++)
        for (int64_t b = 0; b < B; b++)
            one_chain(m.buf, busy.buf, bk.buf, g.buf, extra.buf, st, v.buf, u_U[x], attention, L, K, C, B, V, b,
                      value_VC, value_VK, a_K, a_sorted, below, above, ug_C, order, tmp, i_C,
                      (double *)out.buf + (x * B + b) * V);
    free(work);
    result = Py_NewRef(Py_None);
done:
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) PyBuffer_Release(all[i]);
    return result;
}

/* top_rows' copies: rows_XE[x, e] = t_EX[e, x] (transpose), and out_EX[k, x] the sum of the k largest of
 * row x of asc_XE (sorted ascending): out[0] = 0, out[1] = the largest, out[k + 1] = out[k] + the
 * (k + 1)-th largest (numpy's cumsum, one addition per row in order). Blocks of columns keep both
 * sides in cache. */
#define COLUMNS 64
static PyObject *transpose(PyObject *self, PyObject *args) {
    Py_buffer in, out;
    long long E, X;
    if (!PyArg_ParseTuple(args, "y*w*LL", &in, &out, &E, &X)) return NULL;
    PyObject *result = NULL;
    if (E < 0 || X < 0 || in.len != 8 * E * X || out.len != in.len) {
        PyErr_SetString(PyExc_ValueError, "transpose: in and out must both hold E*X float64");
        goto done;
    }
    const double *t = in.buf;
    double *o = out.buf;
    for (int64_t x0 = 0; x0 < X; x0 += COLUMNS) {
        int64_t x1 = x0 + COLUMNS < X ? x0 + COLUMNS : X;
        for (int64_t e = 0; e < E; e++)
            for (int64_t x = x0; x < x1; x++) o[x * E + e] = t[e * X + x];
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *running_rows(PyObject *self, PyObject *args) {
    Py_buffer in, out;
    long long E, X;
    if (!PyArg_ParseTuple(args, "y*w*LL", &in, &out, &E, &X)) return NULL;
    PyObject *result = NULL;
    if (E < 0 || X < 0 || in.len != 8 * E * X || out.len != 8 * (E + 1) * X) {
        PyErr_SetString(PyExc_ValueError, "running_rows: asc [X*E] and out [(E+1)*X] float64");
        goto done;
    }
    const double *asc = in.buf;
    double *o = out.buf;
    for (int64_t x = 0; x < X; x++) o[x] = 0.0;
    for (int64_t x0 = 0; x0 < X && E > 0; x0 += COLUMNS) {
        int64_t x1 = x0 + COLUMNS < X ? x0 + COLUMNS : X;
        for (int64_t x = x0; x < x1; x++) o[X + x] = asc[x * E + E - 1];
        for (int64_t k = 1; k < E; k++)
            for (int64_t x = x0; x < x1; x++) o[(k + 1) * X + x] = o[k * X + x] + asc[x * E + E - 1 - k];
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain_bound's least values for every u, group and v (before the all-reduce)."},
    {"transpose", transpose, METH_VARARGS, "rows_XE = t_EX transposed (float64)."},
    {"running_rows", running_rows, METH_VARARGS, "out_EX: the sums of each row's k largest, k = 0..E (asc sorted)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastbound", "The lower bound's chain in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastbound(void) { return PyModule_Create(&module); }
