/* The router's placement arithmetic in C loops, without numpy's per-operation overhead.
 *
 * best(running, waiting, memory, cached, ids, placed, weight, tiebreak) -> int
 *
 * The threshold policy's decode choice (router.placement.best_of). `running`, `waiting`,
 * `memory`, `cached`: C-contiguous float64 buffers of one length n (the candidate columns);
 * `ids`: a tuple of n worker ids; `placed`: a dict of worker id -> requests the router placed
 * there (a worker counts max(running, placed) streams). Returns the position of the best score
 *
 *     weight * cached[i] - (running'[i] + waiting[i]) / max_load + memory[i]
 *
 * (max_load: the largest running' + waiting, or 1 when that is 0), equal scores taken from
 * position `tiebreak % n` on, wrapping around.
 *
 * best_cost(...) -> (decode, prefill, local, ttft, cost)
 *
 * The cost policy's choice over every candidate, local on each decode worker and remote on
 * each (prefill, decode) pair (router.placement.best_by_cost; its docstring and
 * router.cost hold the formulas; the arguments are described above the function).
 *
 * Both compute exactly router.placement's numpy floats in its order of operations (built
 * with -ffp-contract=off, so no fused multiply-add changes a rounding), which tests compare
 * on random input. In the router a threshold decision's numpy version costs ~60 us at 64
 * workers with its caches cold between requests, a cost decision's ~40 us more; these a few.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int held;
} Column;

static int get_column(PyObject *obj, Column *col, const char *name) {
    if (PyObject_GetBuffer(obj, &col->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    col->held = 1;
    const char *fmt = col->view.format;
    if (col->view.itemsize != sizeof(double) || fmt == NULL ||
        !(fmt[0] == 'd' || ((fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') && fmt[1] == 'd'))) {
        PyErr_Format(PyExc_TypeError, "%s must be a float64 buffer", name);
        return -1;
    }
    return 0;
}

static void release(Column *cols, int k) {
    for (int i = 0; i < k; i++)
        if (cols[i].held) PyBuffer_Release(&cols[i].view);
}

static int get_columns(PyObject **objs, Column *cols, const char **names, int k,
                       Py_ssize_t n) {
    for (int i = 0; i < k; i++) {
        if (get_column(objs[i], &cols[i], names[i]) < 0) return -1;
        if (cols[i].view.len != n * (Py_ssize_t)sizeof(double)) {
            PyErr_Format(PyExc_ValueError, "%s has %zd values, ids %zd", names[i],
                         cols[i].view.len / (Py_ssize_t)sizeof(double), n);
            return -1;
        }
    }
    return 0;
}

/* max(col[i], counts[ids[i]]) for every i (np.maximum over placement's np.fromiter of
 * counts.get(id, 0)); col itself where `counts` is empty. */
static int at_least(const double *col, PyObject *ids, PyObject *counts, double *out) {
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    int any = PyDict_GET_SIZE(counts) > 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double r = col[i];
        if (any) {
            PyObject *v = PyDict_GetItemWithError(counts, PyTuple_GET_ITEM(ids, i));
            if (v == NULL && PyErr_Occurred()) return -1;
            if (v != NULL) {
                double c = PyFloat_AsDouble(v);
                if (c == -1.0 && PyErr_Occurred()) return -1;
                if (c > r) r = c;
            }
        }
        out[i] = r;
    }
    return 0;
}

static PyObject *best(PyObject *self, PyObject *args) {
    PyObject *objs[4], *ids, *placed;
    double weight;
    Py_ssize_t tiebreak;
    if (!PyArg_ParseTuple(args, "OOOOO!O!dn", &objs[0], &objs[1], &objs[2], &objs[3],
                          &PyTuple_Type, &ids, &PyDict_Type, &placed, &weight, &tiebreak))
        return NULL;
    static const char *names[4] = {"running", "waiting", "memory", "cached"};
    Column cols[4];
    memset(cols, 0, sizeof cols);
    PyObject *result = NULL;
    double *loads = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    if (get_columns(objs, cols, names, 4, n) < 0) goto done;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no decode candidates");
        goto done;
    }
    const double *running = cols[0].view.buf, *waiting = cols[1].view.buf;
    const double *memory = cols[2].view.buf, *cached = cols[3].view.buf;
    loads = PyMem_Malloc((size_t)n * sizeof(double));
    if (loads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (at_least(running, ids, placed, loads) < 0) goto done;
    double max_load = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double load = loads[i] + waiting[i];
        loads[i] = load;
        if (i == 0 || load > max_load) max_load = load;
    }
    if (max_load == 0.0) max_load = 1.0;
    /* Scores in one pass keeping the best; then the first equal one from `tiebreak` on. */
    double top = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double s = weight * cached[i] - loads[i] / max_load + memory[i];
        loads[i] = s;
        if (i == 0 || s > top) top = s;
    }
    Py_ssize_t start = tiebreak % n;
    if (start < 0) start += n;
    Py_ssize_t pick = -1;
    for (Py_ssize_t k = 0; k < n && pick < 0; k++) {
        Py_ssize_t i = start + k < n ? start + k : start + k - n;
        if (loads[i] == top) pick = i;
    }
    if (pick < 0) pick = 0;  /* only with NaN scores */
    result = PyLong_FromSsize_t(pick);
done:
    PyMem_Free(loads);
    release(cols, 4);
    return result;
}

static inline double pos(double x) { return x > 0.0 ? x : 0.0; }  /* np.maximum(0.0, x) */

/* best_cost(length, dcached, running, prompt_waiting, rate, step, dids,
 *             pcached, queued, prate, transfer, pids, placed, inflight, shares,
 *             absorbed, row_fraction, stall_weight, tpot_weight, late_weight, overhead,
 *             max_local_s, target_s, ttft_weight, tiebreak)
 *
 * Decode columns (n each: tokens cached, running streams, prompt tokens waiting, priced
 * prefill rate and decode step; ids), prefill columns (m each: tokens cached, priced backlog,
 * rate and transfer seconds per token; ids), `placed` and `inflight` dicts by worker id,
 * `shares` None or an m x n float64 buffer, then CostModel's numbers, the class's target
 * and TTFT weight. Returns (decode position, prefill position or -1 without prefill
 * workers, whether local, the chosen candidate's TTFT and cost). */
static PyObject *best_cost(PyObject *self, PyObject *args) {
    double length, absorbed, row_fraction, stall_w, tpot_w, late_w, overhead, max_local;
    double target, ttft_w;
    PyObject *objs[9], *dids, *pids, *placed, *inflight, *shares_obj;
    Py_ssize_t tiebreak;
    if (!PyArg_ParseTuple(args, "dOOOOOO!OOOOO!O!O!Odddddddddn", &length, &objs[0], &objs[1],
                          &objs[2], &objs[3], &objs[4], &PyTuple_Type, &dids, &objs[5],
                          &objs[6], &objs[7], &objs[8], &PyTuple_Type, &pids, &PyDict_Type,
                          &placed, &PyDict_Type, &inflight, &shares_obj, &absorbed,
                          &row_fraction, &stall_w, &tpot_w, &late_w, &overhead, &max_local,
                          &target, &ttft_w, &tiebreak))
        return NULL;
    static const char *names[10] = {"dcached", "running", "prompt_waiting", "rate", "step",
                                    "pcached", "queued", "prate", "transfer", "shares"};
    Column cols[10];
    memset(cols, 0, sizeof cols);
    PyObject *result = NULL;
    double *buf = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dids), m = PyTuple_GET_SIZE(pids);
    int with_shares = shares_obj != Py_None;
    if (get_columns(objs, cols, names, 5, n) < 0 ||
        get_columns(objs + 5, cols + 5, names + 5, 4, m) < 0 ||
        (with_shares && get_columns(&shares_obj, cols + 9, names + 9, 1, n * m) < 0))
        goto done;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no decode candidates");
        goto done;
    }
    const double *dcached = cols[0].view.buf, *running = cols[1].view.buf;
    const double *waiting = cols[2].view.buf, *rate = cols[3].view.buf;
    const double *step = cols[4].view.buf, *pcached = cols[5].view.buf;
    const double *queued = cols[6].view.buf, *prate = cols[7].view.buf;
    const double *transfer = cols[8].view.buf;
    const double *shares = with_shares ? cols[9].view.buf : NULL;
    buf = PyMem_Malloc((size_t)(7 * n + 3 * m) * sizeof(double));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *streams = buf, *pending = buf + n, *ttft_l = buf + 2 * n;
    double *local_v = buf + 3 * n, *ttft_r = buf + 4 * n, *cost_r = buf + 5 * n;
    double *best_p = buf + 6 * n;  /* positions, as doubles */
    double *ppending = buf + 7 * n, *lack = ppending + m, *head = lack + m;
    if (at_least(running, dids, placed, streams) < 0 ||
        at_least(waiting, dids, inflight, pending) < 0 ||
        at_least(queued, pids, inflight, ppending) < 0)
        goto done;
    for (Py_ssize_t p = 0; p < m; p++) {
        lack[p] = pos(length - pcached[p]);
        head[p] = (ppending[p] + lack[p]) / prate[p];
    }
    Py_ssize_t pstart = m ? tiebreak % m : 0;
    if (pstart < 0) pstart += m;
    double best = INFINITY;
    for (Py_ssize_t w = 0; w < n; w++) {
        double u = pos(length - dcached[w]);
        double tl = (pending[w] + u) / rate[w] + step[w];
        double stall = pos(u - absorbed) / rate[w] * streams[w];
        double compute = u / rate[w];
        double tpot = step[w] * (1.0 + row_fraction * pos(streams[w] + 1.0 - running[w]));
        double cost_l = ttft_w * tl + stall_w * stall + tpot_w * tpot;
        int allowed = 1;
        double tr = INFINITY, cr = INFINITY;
        best_p[w] = -1.0;
        if (m) {
            /* w's best prefill worker: the least key, the first from `tiebreak` on. */
            Py_ssize_t bp = -1;
            double bkey = 0.0, bstall = 0.0;
            for (Py_ssize_t k = 0; k < m; k++) {
                Py_ssize_t p = pstart + k < m ? pstart + k : pstart + k - m;
                double t = ((head[p] + u * transfer[p]) + overhead) + step[w];
                double key = t, st = 0.0;
                if (with_shares) {
                    double sh = shares[p * n + w];
                    if (sh > 0.0) t = t + pending[w] / rate[w];
                    st = sh * ((pos(lack[p] - absorbed) / rate[w]) * streams[w]);
                    key = ttft_w * (t + late_w * pos(t - target)) + stall_w * st;
                }
                if (bp < 0 || key < bkey) {
                    bp = p;
                    bkey = key;
                    bstall = st;
                    tr = t;
                }
            }
            best_p[w] = (double)bp;
            cr = ttft_w * (tr + late_w * pos(tr - target));
            cr = cr + tpot_w * tpot;
            if (with_shares) cr = cr + stall_w * bstall;
            allowed = !(tr <= target && compute > max_local);
        }
        cost_l = cost_l + ttft_w * late_w * pos(tl - target);
        ttft_l[w] = tl;
        local_v[w] = allowed ? cost_l : INFINITY;
        ttft_r[w] = tr;
        cost_r[w] = cr;
        if (local_v[w] < best) best = local_v[w];
        if (cr < best) best = cr;
    }
    Py_ssize_t start = tiebreak % n;
    if (start < 0) start += n;
    Py_ssize_t pick = -1;
    for (Py_ssize_t k = 0; k < n && pick < 0; k++) {
        Py_ssize_t i = start + k < n ? start + k : start + k - n;
        if (local_v[i] == best || cost_r[i] == best) pick = i;
    }
    if (pick < 0) pick = 0;  /* only with NaN costs */
    int local = local_v[pick] == best;
    result = Py_BuildValue("nnOdd", pick, (Py_ssize_t)best_p[pick], local ? Py_True : Py_False,
                           local ? ttft_l[pick] : ttft_r[pick], best);
done:
    PyMem_Free(buf);
    release(cols, 10);
    return result;
}

static PyMethodDef methods[] = {
    {"best", best, METH_VARARGS,
     "best(running, waiting, memory, cached, ids, placed, weight, tiebreak) -> int: "
     "router.placement.best_of's choice (see the module source)."},
    {"best_cost", best_cost, METH_VARARGS,
     "best_cost(length, dcached, running, prompt_waiting, rate, step, dids, pcached, queued, "
     "prate, transfer, pids, placed, inflight, shares, absorbed, row_fraction, stall_weight, "
     "tpot_weight, late_weight, overhead, max_local_s, target_s, ttft_weight, tiebreak) -> "
     "(decode, prefill, local, ttft, cost): router.placement.best_by_cost's choice."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._score",
    "The router's placement arithmetic in C (router.placement.best_of, best_by_cost).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__score(void) { return PyModule_Create(&module); }
