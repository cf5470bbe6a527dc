/* Chained prefix-block hashes in one call: the router hashes every prompt it places.
 *
 * chain(tokens, block_size, extra, stop=None) -> list[bytes]
 *
 * For each full block of `block_size` tokens (a list or tuple of ints, packed as int32):
 * digest = BLAKE2b-128(parent || packed tokens || extra), parent starting as 16 zero bytes.
 * Tokens are converted only as far as the walk goes. Exactly what
 * pdserve.engine.block_manager.block_hashes computes with hashlib (tests compare the two on
 * random input); this only removes Python's per-block overhead (about 1 us a block, 5x the
 * hashing itself). With `stop` (a dict), the walk ends before the first digest that is not
 * a key of it: chained hashes mean no later block can be held either.
 *
 * match(tokens, block_size, extra, holders) -> list[tuple[int, int]]
 *
 * router.kv_index.KVIndex.match fused with the hashing: `holders` maps a digest to an int
 * bitmask of the workers holding that block. Walks the prompt's blocks while some worker
 * still holds every block so far and returns (depth, mask) pairs: the workers in `mask` hold
 * exactly the first `depth` blocks. Hashing stops at the first block nobody holds.
 *
 * BLAKE2b as RFC 7693 specifies it (unkeyed, 16-byte digest), written from the RFC.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 16

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

#define G(a, b, c, d, x, y)              \
    do {                                 \
        a = a + b + (x);                 \
        d = rotr64(d ^ a, 32);           \
        c = c + d;                       \
        b = rotr64(b ^ c, 24);           \
        a = a + b + (y);                 \
        d = rotr64(d ^ a, 16);           \
        c = c + d;                       \
        b = rotr64(b ^ c, 63);           \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;  /* the counter's high word stays 0: messages here are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    _Pragma("GCC unroll 12")
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of msg[0:len], one shot. */
static void blake2b_16(const uint8_t *msg, size_t len, uint8_t out[DIGEST]) {
    uint64_t h[8];
    uint8_t last[128];
    size_t off = 0;
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ DIGEST;
    while (len - off > 128) {
        compress(h, msg + off, (uint64_t)(off + 128), 0);
        off += 128;
    }
    memset(last, 0, sizeof last);
    memcpy(last, msg + off, len - off);
    compress(h, last, (uint64_t)len, 1);
    store64(out, h[0]);
    store64(out + 8, h[1]);
}

/* Packs tokens[0:block_size] (Python ints) as little-endian int32 into out, as
 * array("i", tokens).tobytes() does on the machines we run on; -1 with OverflowError set for
 * a token outside int32, as array() raises. Four bytes per token: a block of 16 with its
 * parent and a 32-byte model id is 112 bytes, one BLAKE2b compression instead of two (the
 * router placed 1.3x more requests per second for it). Only ints (no __index__): converting
 * anything else could run Python code that changes the list whose items we are reading. */
static int pack(PyObject **tokens, Py_ssize_t block_size, uint8_t *out) {
    for (Py_ssize_t j = 0; j < block_size; j++) {
        if (!PyLong_Check(tokens[j])) {
            PyErr_Format(PyExc_TypeError, "token ids must be ints, got %.100s",
                         Py_TYPE(tokens[j])->tp_name);
            return -1;
        }
        long long v = PyLong_AsLongLong(tokens[j]);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "token id outside int32");
            return -1;
        }
        store32(out + 4 * j, (uint32_t)(int32_t)v);
    }
    return 0;
}

/* The next block's digest: packs its tokens behind the parent already in `msg`, hashes, and
 * moves the digest into the parent slot for the block after it. */
static PyObject *next_digest(uint8_t *msg, size_t msg_len, PyObject **tokens,
                             Py_ssize_t block_size) {
    uint8_t digest[DIGEST];
    if (pack(tokens, block_size, msg + DIGEST) < 0) return NULL;
    blake2b_16(msg, msg_len, digest);
    memcpy(msg, digest, DIGEST);
    return PyBytes_FromStringAndSize((const char *)digest, DIGEST);
}

/* Parsed arguments shared by chain() and match(). */
typedef struct {
    PyObject *seq;  /* tokens as a list or tuple (PySequence_Fast) */
    Py_ssize_t block_size, n;
    uint8_t *msg;
    size_t msg_len;
} Walk;

static int walk_open(Walk *w, PyObject *tokens, Py_ssize_t block_size, Py_buffer *extra) {
    w->msg = NULL;
    w->seq = NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    w->seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (w->seq == NULL) return -1;
    w->block_size = block_size;
    w->n = PySequence_Fast_GET_SIZE(w->seq) / block_size;
    w->msg_len = DIGEST + 4 * (size_t)block_size + (size_t)extra->len;
    w->msg = PyMem_Malloc(w->msg_len);
    if (w->msg == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(w->msg, 0, DIGEST);  /* the first block's parent */
    memcpy(w->msg + DIGEST + 4 * block_size, extra->buf, (size_t)extra->len);
    return 0;
}

static PyObject *walk_next(Walk *w, Py_ssize_t i) {
    return next_digest(w->msg, w->msg_len, PySequence_Fast_ITEMS(w->seq) + i * w->block_size,
                       w->block_size);
}

static void walk_close(Walk *w) {
    PyMem_Free(w->msg);
    Py_XDECREF(w->seq);
}

static PyObject *chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "block_size", "extra", "stop", NULL};
    PyObject *tokens, *stop = Py_None, *out = NULL;
    Py_ssize_t block_size;
    Py_buffer extra;
    Walk w;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*|O", kwlist, &tokens, &block_size,
                                     &extra, &stop))
        return NULL;
    if (stop != Py_None && !PyDict_Check(stop)) {
        PyErr_SetString(PyExc_TypeError, "stop must be a dict or None");
        PyBuffer_Release(&extra);
        return NULL;
    }
    if (walk_open(&w, tokens, block_size, &extra) < 0 || (out = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < w.n; i++) {
        PyObject *h = walk_next(&w, i);
        if (h == NULL) goto fail;
        if (stop != Py_None) {
            int held = PyDict_Contains(stop, h);
            if (held <= 0) {
                Py_DECREF(h);
                if (held < 0) goto fail;
                break;
            }
        }
        int rc = PyList_Append(out, h);
        Py_DECREF(h);
        if (rc < 0) goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    walk_close(&w);
    PyBuffer_Release(&extra);
    return out;
}

/* holders.get(h, None) as a new reference, or NULL with an error set. */
static PyObject *lookup(PyObject *holders, PyObject *h) {
    PyObject *mask = PyDict_GetItemWithError(holders, h);
    if (mask == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(mask);
    return mask;
}

static int append_pair(PyObject *out, Py_ssize_t depth, PyObject *mask) {
    PyObject *pair = Py_BuildValue("(nO)", depth, mask);
    if (pair == NULL) return -1;
    int rc = PyList_Append(out, pair);
    Py_DECREF(pair);
    return rc;
}

static PyObject *match(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "block_size", "extra", "holders", NULL};
    PyObject *tokens, *holders, *out = NULL, *active = NULL;
    Py_ssize_t block_size;
    Py_buffer extra;
    Walk w;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*O!", kwlist, &tokens, &block_size,
                                     &extra, &PyDict_Type, &holders))
        return NULL;
    if (walk_open(&w, tokens, block_size, &extra) < 0 || (out = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t depth = 0;
    for (; depth < w.n; depth++) {
        PyObject *h = walk_next(&w, depth);
        if (h == NULL) goto fail;
        PyObject *mask = lookup(holders, h);
        Py_DECREF(h);
        if (mask == NULL) goto fail;
        if (mask == Py_None) {  /* nobody holds this block: everyone still active ends here */
            Py_DECREF(mask);
            break;
        }
        if (active == NULL) {
            active = mask;
            continue;
        }
        PyObject *still = PyNumber_And(active, mask);
        Py_DECREF(mask);
        if (still == NULL) goto fail;
        int same = PyObject_RichCompareBool(still, active, Py_EQ);
        if (same < 0) {
            Py_DECREF(still);
            goto fail;
        }
        if (!same) {
            PyObject *gone = PyNumber_Xor(active, still);
            int rc = gone == NULL ? -1 : append_pair(out, depth, gone);
            Py_XDECREF(gone);
            if (rc < 0) {
                Py_DECREF(still);
                goto fail;
            }
        }
        Py_SETREF(active, still);
        int any = PyObject_IsTrue(active);
        if (any < 0) goto fail;
        if (!any) {
            Py_CLEAR(active);
            break;
        }
    }
    if (active != NULL && PyObject_IsTrue(active) > 0 && append_pair(out, depth, active) < 0)
        goto fail;
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(active);
    walk_close(&w);
    PyBuffer_Release(&extra);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_VARARGS | METH_KEYWORDS,
     "chain(tokens, block_size, extra, stop=None) -> list[bytes]: chained BLAKE2b-128 "
     "digests of each full block of tokens (see the module source)."},
    {"match", (PyCFunction)(void (*)(void))match, METH_VARARGS | METH_KEYWORDS,
     "match(tokens, block_size, extra, holders) -> list[tuple[int, int]]: (depth, mask) "
     "pairs of a prefix walk over `holders` (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdserve._blockhash",
    "Chained prefix-block hashes in C (pdserve.engine.block_manager.block_hashes).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
