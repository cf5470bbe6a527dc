/* The threshold policy's decode choice in one C loop: router.placement.best_of without
 * numpy's per-operation overhead.
 *
 * best(running, waiting, memory, cached, ids, placed, weight, tiebreak) -> int
 *
 * `running`, `waiting`, `memory`, `cached`: C-contiguous float64 buffers of one length n
 * (the candidate columns); `ids`: a tuple of n worker ids; `placed`: a dict of worker id ->
 * requests the router placed there (a worker counts max(running, placed) streams). Returns
 * the position of the best score
 *
 *     weight * cached[i] - (running'[i] + waiting[i]) / max_load + memory[i]
 *
 * (max_load: the largest running' + waiting, or 1 when that is 0), equal scores taken from
 * position `tiebreak % n` on, wrapping around: exactly router.placement.best_of's floats in
 * its order of operations (built with -ffp-contract=off, so no fused multiply-add changes a
 * rounding), which tests compare on random input. In the router a decision's numpy version
 * costs ~60 us at 64 workers with its caches cold between requests; this one a few.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

static PyObject *best(PyObject *self, PyObject *args) {
    PyObject *objs[4], *ids, *placed;
    double weight;
    Py_ssize_t tiebreak;
    if (!PyArg_ParseTuple(args, "OOOOO!O!dn", &objs[0], &objs[1], &objs[2], &objs[3],
                          &PyTuple_Type, &ids, &PyDict_Type, &placed, &weight, &tiebreak))
        return NULL;
    static const char *names[4] = {"running", "waiting", "memory", "cached"};
    Column cols[4] = {{0}};
    PyObject *result = NULL;
    double *loads = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    for (int k = 0; k < 4; k++) {
        if (get_column(objs[k], &cols[k], names[k]) < 0) goto done;
        if (cols[k].view.len != n * (Py_ssize_t)sizeof(double)) {
            PyErr_Format(PyExc_ValueError, "%s has %zd values, ids %zd", names[k],
                         cols[k].view.len / (Py_ssize_t)sizeof(double), n);
            goto done;
        }
    }
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
    int any_placed = PyDict_GET_SIZE(placed) > 0;
    double max_load = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double r = running[i];
        if (any_placed) {
            PyObject *v = PyDict_GetItemWithError(placed, PyTuple_GET_ITEM(ids, i));
            if (v == NULL && PyErr_Occurred()) goto done;
            if (v != NULL) {
                double p = PyFloat_AsDouble(v);
                if (p == -1.0 && PyErr_Occurred()) goto done;
                if (p > r) r = p;  /* np.maximum, NaN aside */
            }
        }
        double load = r + waiting[i];
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

static PyMethodDef methods[] = {
    {"best", best, METH_VARARGS,
     "best(running, waiting, memory, cached, ids, placed, weight, tiebreak) -> int: "
     "router.placement.best_of's choice (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._score",
    "The threshold policy's decode choice in C (router.placement.best_of).", -1, methods,
};

PyMODINIT_FUNC PyInit__score(void) { return PyModule_Create(&module); }
