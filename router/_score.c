/* The router's placement arithmetic in C loops, without numpy's per-operation overhead.
 *
 * best(running, waiting, memory, cached, ids, placed, weight, tiebreak[, finished]) -> int
 *
 * The threshold policy's decode choice (router.placement.best_of). `running`, `waiting`,
 * `memory`, `cached`: C-contiguous float64 buffers of one length n (the candidate columns);
 * `ids`: a tuple of n worker ids; `placed`: a dict of worker id -> requests the router placed
 * there; `finished`: a dict of worker id -> the router's requests that left it since its
 * `running` was measured (a worker counts max(running - finished, placed) streams, the first
 * no lower than 0; every function here takes `finished` last, optional). Returns the
 * position of the best score
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
 * CostTable(...).choose(pairs, ...) -> (decode, prefill, local, ttft, cost, cached, uncached)
 *
 * best_cost with its candidates held across decisions, taking the prompt's prefix walk as
 * it comes (router.placement.place's path where no prefill worker shares a decode worker's
 * CPUs; described above the type).
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

/* A count as a double, -1 with an error set. The ledger's Counters hold ints: read
 * directly, not through PyFloat_AsDouble (which makes and frees a float for each). */
static inline int count_double(PyObject *v, double *out) {
    if (PyFloat_CheckExact(v))
        *out = PyFloat_AS_DOUBLE(v);
    else if (PyLong_CheckExact(v))
        *out = PyLong_AsDouble(v);
    else
        *out = PyFloat_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* A dict's value as a double: 0 where `key` is absent, -1 with an error set. */
static int dict_double(PyObject *d, PyObject *key, double *out) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        *out = 0.0;
        return PyErr_Occurred() ? -1 : 0;
    }
    return count_double(v, out);
}

/* max(col[i] - less[ids[i]], counts[ids[i]]) for every i, the first term no lower than 0
 * (np.maximum over placement's np.fromiter of counts.get(id, 0), after `less`); col itself
 * where both dicts are empty. `less`: NULL, or what the router knows left a worker since
 * the load in `col` was taken (its requests that finished there: PlacementLedger.finished).
 * With `index_of` (a dict of each id to its position, ids all distinct) and fewer entries
 * than ids, by the dicts: a lookup per worker the router has something in flight on or
 * finished on, not one per candidate. */
static int at_least(const double *col, PyObject *ids, PyObject *index_of, PyObject *counts,
                    PyObject *less, double *out) {
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    Py_ssize_t nless = less == NULL ? 0 : PyDict_GET_SIZE(less);
    /* By the dicts: a lookup per entry; by the ids: one per dict that has entries. */
    if (index_of != NULL && PyDict_GET_SIZE(counts) + nless < n * (nless ? 2 : 1)) {
        memcpy(out, col, (size_t)n * sizeof(double));
        for (int pass = 0; pass < 2; pass++) {  /* `less` first, then `counts` */
            PyObject *d = pass == 0 ? less : counts;
            if (d == NULL) continue;
            Py_ssize_t it = 0;
            PyObject *key, *v;
            while (PyDict_Next(d, &it, &key, &v)) {
                PyObject *at = PyDict_GetItemWithError(index_of, key);
                if (at == NULL) {
                    if (PyErr_Occurred()) return -1;
                    continue;
                }
                Py_ssize_t i = PyLong_AsSsize_t(at);
                double c;
                if (count_double(v, &c) < 0) return -1;
                if (pass == 0)
                    out[i] = out[i] - c > 0.0 ? out[i] - c : 0.0;
                else if (c > out[i])
                    out[i] = c;
            }
        }
        return 0;
    }
    int any = PyDict_GET_SIZE(counts) > 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double r = col[i], c;
        PyObject *id = PyTuple_GET_ITEM(ids, i);
        if (nless) {
            if (dict_double(less, id, &c) < 0) return -1;
            if (c != 0.0) r = r - c > 0.0 ? r - c : 0.0;
        }
        if (any) {
            if (dict_double(counts, id, &c) < 0) return -1;
            if (c > r) r = c;
        }
        out[i] = r;
    }
    return 0;
}

static PyObject *best(PyObject *self, PyObject *args) {
    PyObject *objs[4], *ids, *placed, *finished = NULL;
    double weight;
    Py_ssize_t tiebreak;
    if (!PyArg_ParseTuple(args, "OOOOO!O!dn|O!", &objs[0], &objs[1], &objs[2], &objs[3],
                          &PyTuple_Type, &ids, &PyDict_Type, &placed, &weight, &tiebreak,
                          &PyDict_Type, &finished))
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
    if (at_least(running, ids, NULL, placed, finished, loads) < 0) goto done;
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

/* The cost policy's inputs for one decision: decode columns (n each: tokens cached, running
 * streams, prompt tokens waiting, priced prefill rate and decode step; ids), prefill columns
 * (m each: tokens cached, priced backlog, rate and transfer seconds per token; ids), `placed`
 * and `inflight` dicts by worker id, `shares` NULL or m x n, then CostModel's numbers, the
 * class's target and TTFT weight. */
typedef struct {
    Py_ssize_t n, m;
    const double *dcached, *running, *waiting, *rate, *step;
    const double *pcached, *queued, *prate, *transfer, *shares;
    PyObject *dids, *pids, *placed, *inflight;
    PyObject *finished;  /* NULL, or at_least's `less` for the running streams */
    PyObject *dindex, *pindex;  /* NULL, or id -> position (at_least's) */
    double length, absorbed, row_fraction, stall_w, tpot_w, late_w, overhead, max_local;
    double target, ttft_w;
    Py_ssize_t tiebreak;
} CostInput;

typedef struct {
    Py_ssize_t w, p;  /* p: -1 without prefill workers */
    int local;
    double ttft, cost;
} CostChoice;

/* Doubles of scratch cost_choose needs. */
static size_t cost_scratch(Py_ssize_t n, Py_ssize_t m) { return (size_t)(7 * n + 3 * m); }

/* router.placement.best_by_cost's choice over `in` (n > 0), into `out`; -1 with an error
 * set (a `placed` or `inflight` value that is not a number). */
static int cost_choose(const CostInput *in, double *buf, CostChoice *out) {
    Py_ssize_t n = in->n, m = in->m;
    const double *dcached = in->dcached, *running = in->running, *rate = in->rate;
    const double *step = in->step, *pcached = in->pcached, *prate = in->prate;
    const double *transfer = in->transfer, *shares = in->shares;
    double length = in->length, absorbed = in->absorbed, row_fraction = in->row_fraction;
    double stall_w = in->stall_w, tpot_w = in->tpot_w, late_w = in->late_w;
    double overhead = in->overhead, max_local = in->max_local, target = in->target;
    double ttft_w = in->ttft_w;
    int with_shares = shares != NULL;
    double *streams = buf, *pending = buf + n, *ttft_l = buf + 2 * n;
    double *local_v = buf + 3 * n, *ttft_r = buf + 4 * n, *cost_r = buf + 5 * n;
    double *best_p = buf + 6 * n;  /* positions, as doubles */
    double *ppending = buf + 7 * n, *lack = ppending + m, *head = lack + m;
    if (at_least(running, in->dids, in->dindex, in->placed, in->finished, streams) < 0 ||
        at_least(in->waiting, in->dids, in->dindex, in->inflight, NULL, pending) < 0 ||
        at_least(in->queued, in->pids, in->pindex, in->inflight, NULL, ppending) < 0)
        return -1;
    for (Py_ssize_t p = 0; p < m; p++) {
        lack[p] = pos(length - pcached[p]);
        head[p] = (ppending[p] + lack[p]) / prate[p];
    }
    Py_ssize_t pstart = m ? in->tiebreak % m : 0;
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
    Py_ssize_t start = in->tiebreak % n;
    if (start < 0) start += n;
    Py_ssize_t pick = -1;
    for (Py_ssize_t k = 0; k < n && pick < 0; k++) {
        Py_ssize_t i = start + k < n ? start + k : start + k - n;
        if (local_v[i] == best || cost_r[i] == best) pick = i;
    }
    if (pick < 0) pick = 0;  /* only with NaN costs */
    out->w = pick;
    out->p = (Py_ssize_t)best_p[pick];
    out->local = local_v[pick] == best;
    out->ttft = out->local ? ttft_l[pick] : ttft_r[pick];
    out->cost = best;
    return 0;
}

/* best_cost(length, dcached, running, prompt_waiting, rate, step, dids,
 *             pcached, queued, prate, transfer, pids, placed, inflight, shares,
 *             absorbed, row_fraction, stall_weight, tpot_weight, late_weight, overhead,
 *             max_local_s, target_s, ttft_weight, tiebreak)
 *
 * CostInput's columns as float64 buffers (`shares` None or an m x n one). Returns (decode
 * position, prefill position or -1 without prefill workers, whether local, the chosen
 * candidate's TTFT and cost). */
static PyObject *best_cost(PyObject *self, PyObject *args) {
    CostInput in;
    PyObject *objs[9], *shares_obj;
    memset(&in, 0, sizeof in);
    if (!PyArg_ParseTuple(args, "dOOOOOO!OOOOO!O!O!Odddddddddn|O!", &in.length, &objs[0],
                          &objs[1], &objs[2], &objs[3], &objs[4], &PyTuple_Type, &in.dids,
                          &objs[5], &objs[6], &objs[7], &objs[8], &PyTuple_Type, &in.pids,
                          &PyDict_Type, &in.placed, &PyDict_Type, &in.inflight, &shares_obj,
                          &in.absorbed, &in.row_fraction, &in.stall_w, &in.tpot_w, &in.late_w,
                          &in.overhead, &in.max_local, &in.target, &in.ttft_w, &in.tiebreak,
                          &PyDict_Type, &in.finished))
        return NULL;
    static const char *names[10] = {"dcached", "running", "prompt_waiting", "rate", "step",
                                    "pcached", "queued", "prate", "transfer", "shares"};
    Column cols[10];
    memset(cols, 0, sizeof cols);
    PyObject *result = NULL;
    double *buf = NULL;
    Py_ssize_t n = in.n = PyTuple_GET_SIZE(in.dids), m = in.m = PyTuple_GET_SIZE(in.pids);
    int with_shares = shares_obj != Py_None;
    if (get_columns(objs, cols, names, 5, n) < 0 ||
        get_columns(objs + 5, cols + 5, names + 5, 4, m) < 0 ||
        (with_shares && get_columns(&shares_obj, cols + 9, names + 9, 1, n * m) < 0))
        goto done;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no decode candidates");
        goto done;
    }
    in.dcached = cols[0].view.buf;
    in.running = cols[1].view.buf;
    in.waiting = cols[2].view.buf;
    in.rate = cols[3].view.buf;
    in.step = cols[4].view.buf;
    in.pcached = cols[5].view.buf;
    in.queued = cols[6].view.buf;
    in.prate = cols[7].view.buf;
    in.transfer = cols[8].view.buf;
    in.shares = with_shares ? cols[9].view.buf : NULL;
    buf = PyMem_Malloc(cost_scratch(n, m) * sizeof(double));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    CostChoice c;
    if (cost_choose(&in, buf, &c) == 0)
        result = Py_BuildValue("nnOdd", c.w, c.p, c.local ? Py_True : Py_False, c.ttft, c.cost);
done:
    PyMem_Free(buf);
    release(cols, 10);
    return result;
}

/* CostTable(running, prompt_waiting, rate, step, dids, dpositions, queued, prate, transfer,
 *           pids, ppositions, absorbed, row_fraction, stall_weight, tpot_weight,
 *           late_weight, overhead, max_local_s)
 *
 * best_cost's candidates held across decisions (router.placement.DecodeTable keeps one per
 * candidate lists and cost model, where no prefill worker shares a decode worker's CPUs):
 * their priced columns copied in once, so that a decision passes only what changes per
 * request. `dpositions`, `ppositions`: intp buffers, index slot -> position in that list
 * (-1: none; router.placement._Columns.groups' of the one block geometry both lists share).
 *
 * choose(pairs, scale, length, placed, inflight, target_s, ttft_weight, tiebreak)
 *     -> (decode, prefill, local, ttft, cost, cached, uncached)
 *
 * `pairs`: KVIndex.walk's (depth, mask) pairs of the prompt, spread as
 * router.kv_index.spread does (depth * scale tokens cached for every slot bit with a
 * position); then best_cost's choice, with the decode worker's cached tokens and the tokens
 * left to prefill where it is prefilled (`Decision.uncached_tokens`), as ints. In the router
 * a decision runs with its caches cold: one call with nothing to allocate, convert or look up
 * in numpy, instead of two spreads, numpy's buffers and best_cost's 25 arguments. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n, m, ndpos, nppos;
    double *mem;  /* the columns, the cached tokens, then cost_choose's scratch */
    Py_ssize_t *dpos, *ppos;
    PyObject *dids, *pids;
    PyObject *dindex, *pindex;  /* id -> position; NULL where a list repeats an id */
    double absorbed, row_fraction, stall_w, tpot_w, late_w, overhead, max_local;
} CostTable;

static void CostTable_dealloc(CostTable *t) {
    PyMem_Free(t->mem);
    PyMem_Free(t->dpos);
    PyMem_Free(t->ppos);
    Py_XDECREF(t->dids);
    Py_XDECREF(t->pids);
    Py_XDECREF(t->dindex);
    Py_XDECREF(t->pindex);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int copy_positions(PyObject *obj, Py_ssize_t **out, Py_ssize_t *count, Py_ssize_t n,
                          const char *name) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    int rc = -1;
    const char *fmt = view.format == NULL ? "" : view.format;
    if (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<') fmt++;
    if (view.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || view.len % view.itemsize != 0 ||
        fmt[0] == '\0' || fmt[1] != '\0' || strchr("lqn", fmt[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be an intp buffer", name);
        goto done;
    }
    *count = view.len / view.itemsize;
    *out = PyMem_Malloc((size_t)(*count ? *count : 1) * sizeof(Py_ssize_t));
    if (*out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(*out, view.buf, (size_t)view.len);
    for (Py_ssize_t i = 0; i < *count; i++)
        if ((*out)[i] >= n) {
            PyErr_Format(PyExc_ValueError, "%s holds a position past its list", name);
            goto done;
        }
    rc = 0;
done:
    PyBuffer_Release(&view);
    return rc;
}

/* *out = a dict of each id of `ids` to its position, or NULL where an id repeats; -1 on error. */
static int index_of(PyObject *ids, PyObject **out) {
    PyObject *index = PyDict_New();
    if (index == NULL) return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ids); i++) {
        PyObject *at = PyLong_FromSsize_t(i);
        if (at == NULL || PyDict_SetDefault(index, PyTuple_GET_ITEM(ids, i), at) == NULL) {
            Py_XDECREF(at);
            Py_DECREF(index);
            return -1;
        }
        Py_DECREF(at);
    }
    if (PyDict_GET_SIZE(index) != PyTuple_GET_SIZE(ids)) Py_CLEAR(index);
    *out = index;
    return 0;
}

static PyObject *CostTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *objs[7], *dids, *pids, *dpos, *ppos;
    double consts[7];
    static char *kwlist[] = {"running", "prompt_waiting", "rate", "step", "dids",
                             "dpositions", "queued", "prate", "transfer", "pids",
                             "ppositions", "absorbed", "row_fraction", "stall_weight",
                             "tpot_weight", "late_weight", "overhead", "max_local_s", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO!OOOOO!Oddddddd", kwlist, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &PyTuple_Type, &dids, &dpos,
                                     &objs[4], &objs[5], &objs[6], &PyTuple_Type, &pids, &ppos,
                                     &consts[0], &consts[1], &consts[2], &consts[3], &consts[4],
                                     &consts[5], &consts[6]))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dids), m = PyTuple_GET_SIZE(pids);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no decode candidates");
        return NULL;
    }
    static const char *names[7] = {"running", "prompt_waiting", "rate", "step",
                                   "queued", "prate", "transfer"};
    Column cols[7];
    memset(cols, 0, sizeof cols);
    CostTable *t = NULL;
    if (get_columns(objs, cols, names, 4, n) < 0 ||
        get_columns(objs + 4, cols + 4, names + 4, 3, m) < 0)
        goto fail;
    t = (CostTable *)type->tp_alloc(type, 0);
    if (t == NULL) goto fail;
    t->n = n;
    t->m = m;
    t->dids = Py_NewRef(dids);
    t->pids = Py_NewRef(pids);
    t->absorbed = consts[0];
    t->row_fraction = consts[1];
    t->stall_w = consts[2];
    t->tpot_w = consts[3];
    t->late_w = consts[4];
    t->overhead = consts[5];
    t->max_local = consts[6];
    /* 4n + 3m columns, n + m cached tokens, then the scratch. */
    t->mem = PyMem_Malloc((5 * (size_t)n + 4 * (size_t)m + cost_scratch(n, m)) * sizeof(double));
    if (t->mem == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int k = 0; k < 4; k++)
        memcpy(t->mem + k * n, cols[k].view.buf, (size_t)n * sizeof(double));
    for (int k = 0; k < 3; k++)
        memcpy(t->mem + 4 * n + k * m, cols[4 + k].view.buf, (size_t)m * sizeof(double));
    if (copy_positions(dpos, &t->dpos, &t->ndpos, n, "dpositions") < 0 ||
        copy_positions(ppos, &t->ppos, &t->nppos, m, "ppositions") < 0 ||
        index_of(dids, &t->dindex) < 0 || index_of(pids, &t->pindex) < 0)
        goto fail;
    release(cols, 7);
    return (PyObject *)t;
fail:
    release(cols, 7);
    Py_XDECREF(t);
    return NULL;
}

/* out[pos[base + b]] = value for every set bit b of `bits` whose slot is below npos with a
 * position. */
static void spread_word(unsigned long long bits, Py_ssize_t base, const Py_ssize_t *pos,
                        Py_ssize_t npos, double *out, double value) {
    for (; bits; bits &= bits - 1) {
        Py_ssize_t slot = base + __builtin_ctzll(bits);
        if (slot < npos && pos[slot] >= 0) out[pos[slot]] = value;
    }
}

/* out[pos[slot]] = value for every set bit `slot` of `mask` (a non-negative int) below npos
 * with a position. */
static int spread_mask(PyObject *mask, const Py_ssize_t *pos, Py_ssize_t npos, double *out,
                       double value) {
    if (!PyLong_Check(mask)) {
        PyErr_SetString(PyExc_TypeError, "masks are ints");
        return -1;
    }
    unsigned long long small = PyLong_AsUnsignedLongLong(mask);
    if (small != (unsigned long long)-1 || !PyErr_Occurred()) {
        spread_word(small, 0, pos, npos, out, value);
        return 0;
    }
    /* Negative, or 2**64 and up (a 65th worker slot or more): 64 slots at a time. */
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
    PyErr_Clear();
    PyObject *word = PyLong_FromUnsignedLongLong(~0ULL), *width = PyLong_FromLong(64);
    PyObject *zero = PyLong_FromLong(0), *rest = Py_NewRef(mask);
    int rc = -1, negative = word == NULL || width == NULL || zero == NULL
                                ? -1 : PyObject_RichCompareBool(mask, zero, Py_LT);
    if (negative > 0) PyErr_SetString(PyExc_ValueError, "masks are non-negative");
    for (Py_ssize_t base = 0; negative == 0; base += 64) {
        PyObject *low = PyNumber_And(rest, word);
        unsigned long long bits = low == NULL ? 0 : PyLong_AsUnsignedLongLong(low);
        Py_XDECREF(low);
        if (low == NULL || (bits == (unsigned long long)-1 && PyErr_Occurred())) break;
        spread_word(bits, base, pos, npos, out, value);
        Py_SETREF(rest, PyNumber_Rshift(rest, width));
        int more = rest == NULL ? -1 : PyObject_IsTrue(rest);
        if (more <= 0) {
            rc = more;
            break;
        }
        if (base + 64 >= npos) {  /* no position past here */
            rc = 0;
            break;
        }
    }
    Py_XDECREF(rest);
    Py_XDECREF(zero);
    Py_XDECREF(word);
    Py_XDECREF(width);
    return rc;
}

static PyObject *CostTable_choose(CostTable *t, PyObject *args) {
    PyObject *pairs;
    double scale;
    CostInput in;
    memset(&in, 0, sizeof in);
    if (!PyArg_ParseTuple(args, "O!ddO!O!ddn|O!", &PyList_Type, &pairs, &scale, &in.length,
                          &PyDict_Type, &in.placed, &PyDict_Type, &in.inflight, &in.target,
                          &in.ttft_w, &in.tiebreak, &PyDict_Type, &in.finished))
        return NULL;
    Py_ssize_t n = t->n, m = t->m;
    double *dcached = t->mem + 4 * n + 3 * m, *pcached = dcached + n;
    memset(dcached, 0, (size_t)(n + m) * sizeof(double));
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(pairs); k++) {
        PyObject *pair = PyList_GET_ITEM(pairs, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "pairs must be (depth, mask) tuples");
            return NULL;
        }
        long depth = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
        if (depth == -1 && PyErr_Occurred()) return NULL;
        if (depth < 0) {
            PyErr_SetString(PyExc_ValueError, "depths are non-negative");
            return NULL;
        }
        double value = (double)depth * scale;
        PyObject *mask = PyTuple_GET_ITEM(pair, 1);
        if (spread_mask(mask, t->dpos, t->ndpos, dcached, value) < 0 ||
            spread_mask(mask, t->ppos, t->nppos, pcached, value) < 0)
            return NULL;
    }
    in.n = n;
    in.m = m;
    in.dcached = dcached;
    in.running = t->mem;
    in.waiting = t->mem + n;
    in.rate = t->mem + 2 * n;
    in.step = t->mem + 3 * n;
    in.queued = t->mem + 4 * n;
    in.prate = in.queued + m;
    in.transfer = in.prate + m;
    in.pcached = pcached;
    in.dids = t->dids;
    in.pids = t->pids;
    in.dindex = t->dindex;
    in.pindex = t->pindex;
    in.absorbed = t->absorbed;
    in.row_fraction = t->row_fraction;
    in.stall_w = t->stall_w;
    in.tpot_w = t->tpot_w;
    in.late_w = t->late_w;
    in.overhead = t->overhead;
    in.max_local = t->max_local;
    CostChoice c;
    if (cost_choose(&in, pcached + m, &c) < 0) return NULL;
    double prefilled = c.local ? dcached[c.w] : c.p >= 0 ? pcached[c.p] : 0.0;
    return Py_BuildValue("nnOddLL", c.w, c.p, c.local ? Py_True : Py_False, c.ttft, c.cost,
                         (long long)dcached[c.w], (long long)pos(in.length - prefilled));
}

static PyMethodDef CostTable_methods[] = {
    {"choose", (PyCFunction)CostTable_choose, METH_VARARGS,
     "choose(pairs, scale, length, placed, inflight, target_s, ttft_weight, tiebreak"
     "[, finished]) -> "
     "(decode, prefill, local, ttft, cost, cached, uncached) (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CostTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._score.CostTable",
    .tp_basicsize = sizeof(CostTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "best_cost's candidates held across decisions (see the module source).",
    .tp_new = CostTable_new,
    .tp_dealloc = (destructor)CostTable_dealloc,
    .tp_methods = CostTable_methods,
};

static PyMethodDef methods[] = {
    {"best", best, METH_VARARGS,
     "best(running, waiting, memory, cached, ids, placed, weight, tiebreak[, finished]) "
     "-> int: "
     "router.placement.best_of's choice (see the module source)."},
    {"best_cost", best_cost, METH_VARARGS,
     "best_cost(length, dcached, running, prompt_waiting, rate, step, dids, pcached, queued, "
     "prate, transfer, pids, placed, inflight, shares, absorbed, row_fraction, stall_weight, "
     "tpot_weight, late_weight, overhead, max_local_s, target_s, ttft_weight, tiebreak"
     "[, finished]) -> "
     "(decode, prefill, local, ttft, cost): router.placement.best_by_cost's choice."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._score",
    "The router's placement arithmetic in C (router.placement.best_of, best_by_cost, place).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__score(void) {
    if (PyType_Ready(&CostTableType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "CostTable", (PyObject *)&CostTableType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
