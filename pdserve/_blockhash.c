/* Chained prefix-block hashes in one call: the router hashes every prompt it places.
 *
 * chain(tokens, block_size, extra, stop=None) -> list[bytes]
 *
 * For each full block of `block_size` tokens (a list or tuple of ints, packed as int32, or
 * a buffer of native int32s: array('i'), memoryview.cast('i'), read as they are):
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
 * BlockTable: the router's digest -> holders mapping (KVIndex's), a mapping of 16-byte
 * digests to non-negative int masks in one open-addressing array instead of a dict. A dict
 * lookup of a digest touches four places far apart in memory (its index array, its entry,
 * the key object to compare, the int mask), each a cache and TLB miss in a 1M-block index;
 * a slot here holds the digest and a mask below 2^64 inline (32 bytes), so one lookup is one
 * cache line, the array sits on transparent huge pages where the kernel allows
 * (madvise(MADV_HUGEPAGE)), and match() hashes block i + 1 while block i's slot is being
 * prefetched. Linear probing, backward-shift deletion, grown at 70 % load; masks of 64 bits
 * or more (a 65th worker slot) are kept as int objects. An all-zero key marks an empty
 * slot, so the all-zero digest (which anyone may publish) is kept in a slot of its own.
 *
 * BLAKE2b as RFC 7693 specifies it (unkeyed, 16-byte digest), written from the RFC.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* Parsed arguments shared by chain() and match(). */
typedef struct {
    PyObject *seq;  /* tokens as a list or tuple (PySequence_Fast); NULL: in `ids` */
    Py_buffer ids;  /* tokens as contiguous int32s (a buffer of format 'i'), when seq is NULL */
    Py_ssize_t block_size, n;
    uint8_t *msg;
    size_t msg_len;
} Walk;

/* Whether `view` is a C-contiguous run of native int32s (array('i'), memoryview.cast('i')). */
static int int32_view(const Py_buffer *view) {
    const char *f = view->format;
    if (view->itemsize != 4 || f == NULL) return 0;
    if (*f == '@' || *f == '=') f++;
    return (f[0] == 'i' || f[0] == 'l') && f[1] == '\0';
}

static int walk_open(Walk *w, PyObject *tokens, Py_ssize_t block_size, Py_buffer *extra) {
    w->msg = NULL;
    w->seq = NULL;
    w->ids.obj = NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    /* Packed int32s are read as they are: no int object per token to reach (each a cache
     * miss in a cold walk). Any other buffer is a sequence like any other. */
    if (PyObject_CheckBuffer(tokens)) {
        if (PyObject_GetBuffer(tokens, &w->ids, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            PyErr_Clear();
        else if (!int32_view(&w->ids))
            PyBuffer_Release(&w->ids);
    }
    if (w->ids.obj != NULL) {
        w->n = w->ids.len / 4 / block_size;
    } else {
        w->seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
        if (w->seq == NULL) return -1;
        w->n = PySequence_Fast_GET_SIZE(w->seq) / block_size;
    }
    w->block_size = block_size;
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

/* Block i's tokens packed behind the parent already in `msg`. */
static int pack_block(Walk *w, Py_ssize_t i) {
    uint8_t *out = w->msg + DIGEST;
    if (w->seq == NULL) {
        const uint8_t *src = (const uint8_t *)w->ids.buf + 4 * i * w->block_size;
        for (Py_ssize_t j = 0; j < w->block_size; j++) {
            int32_t v;
            memcpy(&v, src + 4 * j, 4);
            store32(out + 4 * j, (uint32_t)v);
        }
        return 0;
    }
    PyObject **tokens = PySequence_Fast_ITEMS(w->seq) + i * w->block_size;
    /* The block after this one's int objects are read next: their cache misses (a prompt's
     * ids are spread over a vocabulary's worth of objects) overlap this block's hashing. */
    if (i + 1 < w->n) {
        for (Py_ssize_t j = w->block_size; j < 2 * w->block_size; j++)
            __builtin_prefetch(tokens[j]);
    }
    return pack(tokens, w->block_size, out);
}

/* Block i's digest into `out`, and into the parent slot for the block after it. */
static int walk_digest(Walk *w, Py_ssize_t i, uint8_t out[DIGEST]) {
    if (pack_block(w, i) < 0) return -1;
    blake2b_16(w->msg, w->msg_len, out);
    memcpy(w->msg, out, DIGEST);
    return 0;
}

/* walk_digest as a bytes object. */
static PyObject *walk_next(Walk *w, Py_ssize_t i) {
    uint8_t digest[DIGEST];
    if (walk_digest(w, i, digest) < 0) return NULL;
    return PyBytes_FromStringAndSize((const char *)digest, DIGEST);
}

static void walk_close(Walk *w) {
    PyMem_Free(w->msg);
    Py_XDECREF(w->seq);
    if (w->ids.obj != NULL) PyBuffer_Release(&w->ids);
}

static int stop_holds(PyObject *stop, const uint8_t d[DIGEST], PyObject *h);
static PyTypeObject BlockTableType;

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
    if (stop != Py_None && !PyDict_Check(stop) && !Py_IS_TYPE(stop, &BlockTableType)) {
        PyErr_SetString(PyExc_TypeError, "stop must be a dict, a BlockTable or None");
        PyBuffer_Release(&extra);
        return NULL;
    }
    if (walk_open(&w, tokens, block_size, &extra) < 0 || (out = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < w.n; i++) {
        PyObject *h = walk_next(&w, i);
        if (h == NULL) goto fail;
        if (stop != Py_None) {
            int held = stop_holds(stop, (const uint8_t *)PyBytes_AS_STRING(h), h);
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

/* ------------------------------------------------------------------ BlockTable */

typedef struct {
    uint64_t k0, k1;  /* the digest; both 0: an empty slot */
    uint64_t small;   /* the mask, when big is NULL */
    PyObject *big;    /* the mask as an int object, when it does not fit in 64 bits */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t cap;  /* a power of two */
    size_t len;
    Slot zero;   /* the all-zero digest's slot, in use when has_zero */
    int has_zero;
} BlockTable;

#define HUGE_PAGE ((size_t)2 << 20)
#define MIN_CAP 64

static Slot *slots_alloc(size_t cap) {
    size_t size = cap * sizeof(Slot);
    void *p = NULL;
    if (size < HUGE_PAGE) return PyMem_Calloc(cap, sizeof(Slot));
    if (posix_memalign(&p, HUGE_PAGE, size) != 0) return NULL;
    (void)madvise(p, size, MADV_HUGEPAGE);  /* advice: without THP it is simply 4 KiB pages */
    memset(p, 0, size);
    return p;
}

static void slots_free(Slot *slots, size_t cap) {
    if (slots == NULL) return;
    if (cap * sizeof(Slot) < HUGE_PAGE)
        PyMem_Free(slots);
    else
        free(slots);
}

static inline void key_of(const uint8_t d[DIGEST], uint64_t *k0, uint64_t *k1) {
    *k0 = load64(d);
    *k1 = load64(d + 8);
}

/* The slot holding (k0, k1), or the empty slot where it would go. */
static inline Slot *table_probe(const BlockTable *t, uint64_t k0, uint64_t k1) {
    size_t m = t->cap - 1, i = (size_t)k0 & m;
    for (;;) {
        Slot *s = &t->slots[i];
        if ((s->k0 == k0 && s->k1 == k1) || (s->k0 == 0 && s->k1 == 0)) return s;
        i = (i + 1) & m;
    }
}

static inline int slot_used(const Slot *s) { return s->k0 != 0 || s->k1 != 0; }

/* The slot holding (k0, k1), or NULL. */
static inline const Slot *table_lookup(const BlockTable *t, uint64_t k0, uint64_t k1) {
    if (k0 == 0 && k1 == 0) return t->has_zero ? &t->zero : NULL;
    const Slot *s = table_probe(t, k0, k1);
    return slot_used(s) ? s : NULL;
}

/* A key argument: 16-byte bytes -> 1 with (k0, k1); anything else -> 0 (no such key) or -1
 * with ValueError when `strict`. */
static int parse_key(PyObject *key, uint64_t *k0, uint64_t *k1, int strict) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != DIGEST) {
        if (strict) PyErr_SetString(PyExc_ValueError, "BlockTable keys are 16-byte digests");
        return strict ? -1 : 0;
    }
    key_of((const uint8_t *)PyBytes_AS_STRING(key), k0, k1);
    return 1;
}

static PyObject *slot_value(const Slot *s) {
    if (s->big != NULL) return Py_NewRef(s->big);
    return PyLong_FromUnsignedLongLong(s->small);
}

static int table_grow(BlockTable *t) {
    size_t cap = t->cap * 2;
    Slot *old = t->slots, *slots = slots_alloc(cap);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = t->cap;
    t->slots = slots;
    t->cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (slot_used(&old[i])) *table_probe(t, old[i].k0, old[i].k1) = old[i];
    slots_free(old, old_cap);
    return 0;
}

/* Empties slot s, shifting the entries of its probe run back (no tombstones). */
static void table_remove(BlockTable *t, Slot *s) {
    size_t m = t->cap - 1, i = (size_t)(s - t->slots), j = i;
    Py_CLEAR(s->big);
    for (;;) {
        j = (j + 1) & m;
        Slot *e = &t->slots[j];
        if (!slot_used(e)) break;
        size_t home = (size_t)e->k0 & m;
        /* e may move back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            t->slots[i] = *e;
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(Slot));
    t->len--;
}

static PyObject *BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "BlockTable() takes no arguments");
        return NULL;
    }
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->cap = MIN_CAP;
    t->len = 0;
    t->slots = slots_alloc(t->cap);
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void BlockTable_dealloc(BlockTable *t) {
    Py_XDECREF(t->zero.big);
    if (t->slots != NULL)
        for (size_t i = 0; i < t->cap; i++) Py_XDECREF(t->slots[i].big);
    slots_free(t->slots, t->cap);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t BlockTable_len(BlockTable *t) { return (Py_ssize_t)t->len; }

static PyObject *BlockTable_subscript(BlockTable *t, PyObject *key) {
    uint64_t k0, k1;
    const Slot *s = parse_key(key, &k0, &k1, 0) > 0 ? table_lookup(t, k0, k1) : NULL;
    if (s != NULL) return slot_value(s);
    PyErr_SetObject(PyExc_KeyError, key);
    return NULL;
}

static int BlockTable_ass_subscript(BlockTable *t, PyObject *key, PyObject *value) {
    uint64_t k0, k1;
    if (value == NULL) {  /* del t[key] */
        const Slot *s = parse_key(key, &k0, &k1, 0) > 0 ? table_lookup(t, k0, k1) : NULL;
        if (s == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        if (s == &t->zero) {
            Py_CLEAR(t->zero.big);
            t->has_zero = 0;
            t->len--;
        } else {
            table_remove(t, (Slot *)s);
        }
        return 0;
    }
    if (parse_key(key, &k0, &k1, 1) < 0) return -1;
    PyObject *mask = PyNumber_Index(value);  /* an exact int: its & runs no Python code */
    if (mask == NULL) return -1;
    PyObject *zero = PyLong_FromLong(0);
    int neg = zero == NULL ? -1 : PyObject_RichCompareBool(mask, zero, Py_LT);
    Py_XDECREF(zero);
    if (neg != 0) {
        if (neg > 0) PyErr_SetString(PyExc_ValueError, "BlockTable masks are non-negative");
        Py_DECREF(mask);
        return -1;
    }
    uint64_t small = PyLong_AsUnsignedLongLong(mask);
    PyObject *big = NULL;
    if (small == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            Py_DECREF(mask);
            return -1;
        }
        PyErr_Clear();
        big = mask;  /* 64 bits or more: kept as the object */
        small = 0;
    } else {
        Py_DECREF(mask);
    }
    Slot *s;
    if (k0 == 0 && k1 == 0) {
        s = &t->zero;
        t->len += !t->has_zero;
        t->has_zero = 1;
    } else if (!slot_used(s = table_probe(t, k0, k1))) {
        if ((t->len + 1) * 10 > t->cap * 7) {
            if (table_grow(t) < 0) {
                Py_XDECREF(big);
                return -1;
            }
            s = table_probe(t, k0, k1);
        }
        s->k0 = k0;
        s->k1 = k1;
        t->len++;
    }
    Py_XSETREF(s->big, big);
    s->small = small;
    return 0;
}

static int BlockTable_contains(BlockTable *t, PyObject *key) {
    uint64_t k0, k1;
    return parse_key(key, &k0, &k1, 0) > 0 && table_lookup(t, k0, k1) != NULL;
}

static PyObject *BlockTable_get(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    uint64_t k0, k1;
    const Slot *s = parse_key(args[0], &k0, &k1, 0) > 0 ? table_lookup(t, k0, k1) : NULL;
    if (s != NULL) return slot_value(s);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* Position i of the table, 0 <= i <= cap (cap: the all-zero digest's slot): NULL if empty. */
static const Slot *table_nth(const BlockTable *t, size_t i) {
    if (i == t->cap) return t->has_zero ? &t->zero : NULL;
    return slot_used(&t->slots[i]) ? &t->slots[i] : NULL;
}

static PyObject *slot_key(const Slot *s) {
    uint8_t d[DIGEST];
    store64(d, s->k0);
    store64(d + 8, s->k1);
    return PyBytes_FromStringAndSize((const char *)d, DIGEST);
}

static PyObject *BlockTable_items(BlockTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t i = 0; i <= t->cap; i++) {
        const Slot *s = table_nth(t, i);
        if (s == NULL) continue;
        PyObject *k = slot_key(s), *v = k == NULL ? NULL : slot_value(s);
        PyObject *pair = v == NULL ? NULL : PyTuple_Pack(2, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *BlockTable_iter(BlockTable *t) {
    PyObject *keys = PyList_New(0);
    if (keys == NULL) return NULL;
    for (size_t i = 0; i <= t->cap; i++) {
        const Slot *s = table_nth(t, i);
        if (s == NULL) continue;
        PyObject *k = slot_key(s);
        if (k == NULL || PyList_Append(keys, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(keys);
            return NULL;
        }
        Py_DECREF(k);
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *BlockTable_sizeof(BlockTable *t, PyObject *Py_UNUSED(ignored)) {
    size_t total = sizeof(BlockTable) + t->cap * sizeof(Slot);
    for (size_t i = 0; i <= t->cap; i++) {
        const Slot *s = table_nth(t, i);
        if (s != NULL && s->big != NULL) total += _PySys_GetSizeOf(s->big);
    }
    return PyLong_FromSize_t(total);
}

static PyMethodDef BlockTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockTable_get, METH_FASTCALL,
     "get(key, default=None): the mask held for a digest"},
    {"items", (PyCFunction)BlockTable_items, METH_NOARGS, "items() -> list of (digest, mask)"},
    {"__sizeof__", (PyCFunction)BlockTable_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods BlockTable_as_mapping = {
    (lenfunc)BlockTable_len, (binaryfunc)BlockTable_subscript,
    (objobjargproc)BlockTable_ass_subscript,
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_contains = (objobjproc)BlockTable_contains,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve._blockhash.BlockTable",
    .tp_doc = "BlockTable(): 16-byte digest -> non-negative int mask (see the module source)",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockTable_new,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_as_mapping = &BlockTable_as_mapping,
    .tp_as_sequence = &BlockTable_as_sequence,
    .tp_iter = (getiterfunc)BlockTable_iter,
    .tp_methods = BlockTable_methods,
};

/* Is `d` a key of `stop` (a dict or a BlockTable)? 1/0, -1 with an error set. */
static int stop_holds(PyObject *stop, const uint8_t d[DIGEST], PyObject *h) {
    if (Py_IS_TYPE(stop, &BlockTableType)) {
        uint64_t k0, k1;
        key_of(d, &k0, &k1);
        return table_lookup((BlockTable *)stop, k0, k1) != NULL;
    }
    return PyDict_Contains(stop, h);
}

/* match() over a BlockTable: while some worker holds every block so far, the next block is
 * hashed while this one's slot is fetched from memory. Masks below 2^64 are ANDed as
 * integers; a wider one switches the walk to int objects. */
typedef struct {
    uint64_t small;
    PyObject *big;  /* owned; NULL: `small` is the mask */
} Mask;

static PyObject *mask_object(const Mask *m) {
    return m->big != NULL ? Py_NewRef(m->big) : PyLong_FromUnsignedLongLong(m->small);
}

/* a = a & s (the slot's mask); the workers that left appended at `depth`. 1: some worker is
 * still active, 0: none, -1: error. */
static int mask_narrow(Mask *a, const Slot *s, PyObject *out, Py_ssize_t depth) {
    if (a->big == NULL && s->big == NULL) {
        uint64_t still = a->small & s->small;
        if (still != a->small) {
            PyObject *gone = PyLong_FromUnsignedLongLong(a->small ^ still);
            int rc = gone == NULL ? -1 : append_pair(out, depth, gone);
            Py_XDECREF(gone);
            if (rc < 0) return -1;
        }
        a->small = still;
        return still != 0;
    }
    PyObject *cur = mask_object(a), *other = slot_value(s), *still = NULL, *gone = NULL;
    int rc = -1;
    if (cur == NULL || other == NULL || (still = PyNumber_And(cur, other)) == NULL) goto done;
    int same = PyObject_RichCompareBool(still, cur, Py_EQ);
    if (same < 0) goto done;
    if (!same && ((gone = PyNumber_Xor(cur, still)) == NULL || append_pair(out, depth, gone) < 0))
        goto done;
    rc = PyObject_IsTrue(still);
    if (rc >= 0) {
        Py_XSETREF(a->big, Py_NewRef(still));
        a->small = 0;
    }
done:
    Py_XDECREF(cur);
    Py_XDECREF(other);
    Py_XDECREF(still);
    Py_XDECREF(gone);
    return rc;
}

/* Packed ids: blocks hashed before their slots are looked up, in batches, the slots then
 * fetched one right after another, so that their misses (in a cold walk, a TLB miss each: a
 * 1M-block table spans 64 MiB) overlap one another instead of each waiting out the last. At
 * most BATCH - 1 blocks past where the walk ends are hashed for nothing. Python ints: the
 * next block hashed while this one's slot arrives (their int objects' misses, overlapped
 * with the lookup, weigh more there: batches made that form slower; bench/walk_cold.py). */
#define BATCH 8

static PyObject *match_table(Walk *w, BlockTable *t) {
    PyObject *out = PyList_New(0);
    Mask active = {0, NULL};
    int have = 0;
    uint64_t keys[BATCH][2];
    uint8_t d[DIGEST];
    Py_ssize_t depth = 0, hashed = 0;
    if (out == NULL) return NULL;
    for (; depth < w->n; depth++) {
        if (w->seq != NULL) {  /* Python ints: this block and the next hashed */
            for (; hashed < w->n && hashed <= depth + 1; hashed++) {
                uint64_t *k = keys[hashed % BATCH];
                if (walk_digest(w, hashed, d) < 0) goto fail;
                key_of(d, &k[0], &k[1]);
                __builtin_prefetch(&t->slots[(size_t)k[0] & (t->cap - 1)]);
            }
        } else if (depth == hashed) {  /* packed ids: the next batch hashed, then fetched */
            Py_ssize_t n = w->n - depth < BATCH ? w->n - depth : BATCH;
            for (Py_ssize_t j = 0; j < n; j++) {
                uint64_t *k = keys[(depth + j) % BATCH];
                if (walk_digest(w, depth + j, d) < 0) goto fail;
                key_of(d, &k[0], &k[1]);
            }
            for (Py_ssize_t j = 0; j < n; j++) {
                size_t at = (size_t)keys[(depth + j) % BATCH][0] & (t->cap - 1);
                __builtin_prefetch(&t->slots[at]);
            }
            hashed = depth + n;
        }
        uint64_t k0 = keys[depth % BATCH][0], k1 = keys[depth % BATCH][1];
        const Slot *s = table_lookup(t, k0, k1);
        if (s == NULL) break;  /* nobody holds this block: everyone still active ends here */
        if (!have) {
            if (s->big == NULL && s->small == 0) break;  /* held by no one, as a dict's 0 */
            have = 1;
            active.small = s->small;
            active.big = s->big != NULL ? Py_NewRef(s->big) : NULL;
        } else {
            int any = mask_narrow(&active, s, out, depth);
            if (any < 0) goto fail;
            if (!any) {
                have = 0;
                break;
            }
        }
    }
    if (have) {
        PyObject *m = mask_object(&active);
        int rc = m == NULL ? -1 : append_pair(out, depth, m);
        Py_XDECREF(m);
        if (rc < 0) goto fail;
    }
    Py_XDECREF(active.big);
    return out;
fail:
    Py_XDECREF(active.big);
    Py_DECREF(out);
    return NULL;
}

static PyObject *match(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "block_size", "extra", "holders", NULL};
    PyObject *tokens, *holders, *out = NULL, *active = NULL;
    Py_ssize_t block_size;
    Py_buffer extra;
    Walk w;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*O", kwlist, &tokens, &block_size,
                                     &extra, &holders))
        return NULL;
    if (Py_IS_TYPE(holders, &BlockTableType)) {
        if (walk_open(&w, tokens, block_size, &extra) == 0)
            out = match_table(&w, (BlockTable *)holders);
        walk_close(&w);
        PyBuffer_Release(&extra);
        return out;
    }
    if (!PyDict_Check(holders)) {
        PyErr_SetString(PyExc_TypeError, "holders must be a dict or a BlockTable");
        PyBuffer_Release(&extra);
        return NULL;
    }
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

/* spread(pairs, positions, out, scale): the walk's answer (match()'s (depth, mask) pairs)
 * written where a caller keeps its candidates: out[positions[slot]] = depth * scale for every
 * slot bit of each mask whose slot has a position (>= 0; slots past the end of `positions`
 * have none). One call per prompt instead of a Python step per worker: the router's
 * placement (router.placement._cached). */
typedef struct {
    const Py_ssize_t *pos;
    Py_ssize_t npos;
    double *out;
    Py_ssize_t nout;
} Spread;

static int spread_slot(const Spread *sp, Py_ssize_t slot, double value) {
    if (slot >= sp->npos || sp->pos[slot] < 0) return 0;
    if (sp->pos[slot] >= sp->nout) {
        PyErr_SetString(PyExc_IndexError, "a position is past the end of out");
        return -1;
    }
    sp->out[sp->pos[slot]] = value;
    return 0;
}

static int spread_big(const Spread *sp, PyObject *mask, double value) {
    PyObject *bits = PyObject_CallMethod(mask, "bit_length", NULL);
    if (bits == NULL) return -1;
    Py_ssize_t nbits = PyLong_AsSsize_t(bits);
    Py_DECREF(bits);
    if (nbits < 0) return -1;
    PyObject *bytes = PyObject_CallMethod(mask, "to_bytes", "ns", (nbits + 7) / 8, "little");
    if (bytes == NULL) return -1;
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(bytes);
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyBytes_GET_SIZE(bytes) && 8 * i < sp->npos; i++)
        for (unsigned v = b[i]; rc == 0 && v; v &= v - 1)
            rc = spread_slot(sp, 8 * i + __builtin_ctz(v), value);
    Py_DECREF(bytes);
    return rc;
}

static PyObject *spread(PyObject *self, PyObject *args) {
    PyObject *pairs;
    Py_buffer pos, out;
    double scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!y*w*d", &PyList_Type, &pairs, &pos, &out, &scale))
        return NULL;
    PyObject *result = NULL;
    if (pos.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || pos.len % pos.itemsize != 0
            || out.itemsize != (Py_ssize_t)sizeof(double) || out.len % out.itemsize != 0) {
        PyErr_SetString(PyExc_TypeError,
                        "positions must be a buffer of intp (ssize_t), out one of float64");
        goto done;
    }
    Spread sp = {(const Py_ssize_t *)pos.buf, pos.len / pos.itemsize, (double *)out.buf,
                 out.len / out.itemsize};
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(pairs); k++) {
        PyObject *pair = PyList_GET_ITEM(pairs, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "pairs must be (depth, mask) tuples");
            goto done;
        }
        long depth = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
        if (depth == -1 && PyErr_Occurred()) goto done;
        PyObject *mask = PyTuple_GET_ITEM(pair, 1);
        int overflow = 0;
        long long small = PyLong_AsLongLongAndOverflow(mask, &overflow);
        if (small == -1 && PyErr_Occurred()) goto done;
        if (depth < 0 || overflow < 0 || (overflow == 0 && small < 0)) {
            PyErr_SetString(PyExc_ValueError, "depths and masks are non-negative");
            goto done;
        }
        double value = (double)depth * scale;
        if (overflow == 0) {
            for (unsigned long long v = (unsigned long long)small; v; v &= v - 1)
                if (spread_slot(&sp, __builtin_ctzll(v), value) < 0) goto done;
        } else if (spread_big(&sp, mask, value) < 0) {  /* 2**63 and up: an int object */
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pos);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_VARARGS | METH_KEYWORDS,
     "chain(tokens, block_size, extra, stop=None) -> list[bytes]: chained BLAKE2b-128 "
     "digests of each full block of tokens (see the module source)."},
    {"match", (PyCFunction)(void (*)(void))match, METH_VARARGS | METH_KEYWORDS,
     "match(tokens, block_size, extra, holders) -> list[tuple[int, int]]: (depth, mask) "
     "pairs of a prefix walk over `holders` (see the module source)."},
    {"spread", (PyCFunction)spread, METH_VARARGS,
     "spread(pairs, positions, out, scale) -> None: out[positions[slot]] = depth * scale "
     "for every slot bit of match()'s (depth, mask) pairs (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdserve._blockhash",
    "Chained prefix-block hashes in C (pdserve.engine.block_manager.block_hashes).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__blockhash(void) {
    if (PyType_Ready(&BlockTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
