/* Compiled draft-file lookups (data/draft_file.py): the same hash, bucket search and back-off as the numpy
 * reference there, which the tests hold it equal to. A Python lookup spends ~8 us in interpreter and numpy calls
 * around ~10 memory reads; this does the reads and the copies in one call.
 *
 * Table(keys, bucket, shift, key_orders, key_totals, key_offsets, entry_tokens, entry_counts, orders, pad)
 *   holds buffers of the file's sections (read-only) and the bucket index;
 * .lookup(context, tokens, counts) -> (order, entries, total) or None: the longest matching order's entries
 *   written into tokens / counts (int64 [m, L], PAD -> -1);
 * .lookup_batch(contexts, tokens, counts, order, total): contexts int64 [B, W] (-1 = missing, left side) into
 *   tokens / counts int64 [B, m, L] (-1 / 0 past a key's entries), order / total int64 [B] (0 = no key).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ORDERS 32
static const uint64_t C1 = 0x9E3779B97F4A7C15ULL, C2 = 0xBF58476D1CE4E5B9ULL, C3 = 0x94D049BB133111EBULL;
static const uint64_t SEED = 0x2545F4914F6CDD1DULL;

typedef struct {
    PyObject_HEAD
    Py_buffer keys, bucket, key_orders, key_totals, key_offsets, entry_tokens, entry_counts;
    int shift, n_orders, max_order, orders[MAX_ORDERS]; /* orders ascending */
    Py_ssize_t n_keys, max_len;
    uint64_t pad;
} Table;

static uint64_t finish(uint64_t h, uint64_t k) {
    uint64_t z = h ^ (k << 56);
    z = (z ^ (z >> 30)) * C2;
    z = (z ^ (z >> 27)) * C3;
    return z ^ (z >> 31);
}

static uint64_t uint_at(const Py_buffer *b, Py_ssize_t i) {
    switch (b->itemsize) {
    case 1: return ((const uint8_t *)b->buf)[i];
    case 2: return ((const uint16_t *)b->buf)[i];
    case 4: return ((const uint32_t *)b->buf)[i];
    default: return ((const uint64_t *)b->buf)[i];
    }
}

/* entries of key idx (-1: none) into tokens / counts [m, L] (rows past its entries: -1 / 0); returns their number */
static Py_ssize_t copy_entries(const Table *t, Py_ssize_t idx, Py_ssize_t m, int64_t *tokens, int64_t *counts) {
    Py_ssize_t L = t->max_len, a = 0, n = 0;
    if (idx >= 0) {
        a = (Py_ssize_t)uint_at(&t->key_offsets, idx);
        n = (Py_ssize_t)uint_at(&t->key_offsets, idx + 1) - a;
    }
    if (n > m) n = m;
    for (Py_ssize_t e = 0; e < n; e++)
        for (Py_ssize_t j = 0; j < L; j++) {
            uint64_t tok = uint_at(&t->entry_tokens, (a + e) * L + j);
            tokens[e * L + j] = tok == t->pad ? -1 : (int64_t)tok;
            counts[e * L + j] = (int64_t)((const uint32_t *)t->entry_counts.buf)[(a + e) * L + j];
        }
    for (Py_ssize_t j = n * L; j < m * L; j++) { tokens[j] = -1; counts[j] = 0; }
    return n;
}

/* the newest (up to max_order) tokens of a 1-d integer context, newest first; stops at a negative token */
static int read_context(const Table *t, PyObject *obj, int64_t *out) {
    int n = 0;
    Py_buffer v;
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &v, PyBUF_STRIDES | PyBUF_FORMAT) == 0) {
        const char *f = v.format ? v.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        int is_signed = strchr("bhilq", *f) != NULL;
        if (v.ndim != 1 || !strchr("bhilqBHILQ", *f) || !f[0] || f[1]) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_TypeError, "a draft-file context is a 1-d array of integer token ids");
            return -1;
        }
        for (Py_ssize_t i = v.shape[0] - 1; i >= 0 && n < t->max_order; i--) {
            const char *p = (const char *)v.buf + i * v.strides[0];
            int64_t x;
            switch (v.itemsize) {
            case 1: x = is_signed ? *(const int8_t *)p : *(const uint8_t *)p; break;
            case 2: x = is_signed ? *(const int16_t *)p : *(const uint16_t *)p; break;
            case 4: x = is_signed ? (int64_t) * (const int32_t *)p : (int64_t) * (const uint32_t *)p; break;
            default: x = *(const int64_t *)p;
            }
            if (x < 0) break;
            out[n++] = x;
        }
        PyBuffer_Release(&v);
        return n;
    }
    PyErr_Clear();
    PyObject *seq = PySequence_Fast(obj, "a draft-file context is a sequence of token ids");
    if (!seq) return -1;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(seq) - 1; i >= 0 && n < t->max_order; i--) {
        long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (x == -1 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        if (x < 0) break;
        out[n++] = x;
    }
    Py_DECREF(seq);
    return n;
}

static int out_buffer(PyObject *obj, Py_buffer *b, Py_ssize_t items, const char *name) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    if (b->itemsize != 8 || b->len < items * 8) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "%s must be a writable int64 array of at least %zd items", name, items);
        return -1;
    }
    return 0;
}

/* lookups of n rows of contexts [n, W] in stages, each prefetching what the next one reads for every row: the
 * reads of one row are dependent cache misses (bucket, keys, offsets, entries), those of different rows and of one
 * row's orders are not */
#define CHUNK 32
static Py_ssize_t find_chunk(const Table *t, const int64_t *rows, Py_ssize_t W, Py_ssize_t n, Py_ssize_t m,
                             int64_t *tokens, int64_t *counts, int64_t *order, int64_t *total) {
    uint64_t key[CHUNK][MAX_ORDERS];
    int usable[CHUNK]; /* orders[0 .. usable) fit the row's context */
    Py_ssize_t idx[CHUNK], L = t->max_len;
    const uint64_t *keys = (const uint64_t *)t->keys.buf;
    const char *bucket = t->bucket.buf;
    for (Py_ssize_t r = 0; r < n; r++) {
        uint64_t h = SEED, steps[MAX_ORDERS];
        int have = 0;
        for (Py_ssize_t i = W - 1; i >= 0 && have < t->max_order && rows[r * W + i] >= 0; i--) {
            h = (h ^ (uint64_t)(rows[r * W + i] + 1)) * C1;
            h ^= h >> 31;
            steps[have++] = h;
        }
        usable[r] = 0;
        while (usable[r] < t->n_orders && t->orders[usable[r]] <= have) usable[r]++;
        for (int o = 0; o < usable[r]; o++) {
            key[r][o] = finish(steps[t->orders[o] - 1], (uint64_t)t->orders[o]);
            __builtin_prefetch(bucket + (key[r][o] >> t->shift) * t->bucket.itemsize);
        }
    }
    for (Py_ssize_t r = 0; r < n; r++)
        for (int o = 0; o < usable[r]; o++)
            __builtin_prefetch(keys + uint_at(&t->bucket, key[r][o] >> t->shift));
    for (Py_ssize_t r = 0; r < n; r++) {
        idx[r] = -1;
        for (int o = usable[r] - 1; o >= 0 && idx[r] < 0; o--) {
            uint64_t b = key[r][o] >> t->shift;
            Py_ssize_t hi = (Py_ssize_t)uint_at(&t->bucket, b + 1);
            for (Py_ssize_t i = (Py_ssize_t)uint_at(&t->bucket, b); i < hi && keys[i] <= key[r][o]; i++)
                if (keys[i] == key[r][o]) { idx[r] = i; order[r] = t->orders[o]; break; }
        }
        if (idx[r] < 0) { order[r] = 0; continue; }
        __builtin_prefetch((const char *)t->key_offsets.buf + idx[r] * t->key_offsets.itemsize);
        __builtin_prefetch((const char *)t->key_totals.buf + idx[r] * 4);
    }
    for (Py_ssize_t r = 0; r < n; r++)
        if (idx[r] >= 0) {
            Py_ssize_t a = (Py_ssize_t)uint_at(&t->key_offsets, idx[r]);
            __builtin_prefetch((const char *)t->entry_tokens.buf + a * L * t->entry_tokens.itemsize);
            __builtin_prefetch((const char *)t->entry_counts.buf + a * L * 4);
            __builtin_prefetch((const char *)t->entry_counts.buf + a * L * 4 + 64);
        }
    Py_ssize_t got = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        total[r] = idx[r] < 0 ? 0 : (int64_t)uint_at(&t->key_totals, idx[r]);
        got = copy_entries(t, idx[r], m, tokens + r * m * L, counts + r * m * L);
    }
    return got; /* the last row's entries */
}

static PyObject *Table_lookup(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    int64_t newest_first[MAX_ORDERS], row[MAX_ORDERS], order = 0, total = 0;
    Py_buffer tok, cnt;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "lookup(context, tokens, counts)"); return NULL; }
    int n = read_context(t, args[0], newest_first);
    if (n < 0) return NULL;
    for (int i = 0; i < t->max_order; i++) row[i] = i < t->max_order - n ? -1 : newest_first[t->max_order - 1 - i];
    if (out_buffer(args[1], &tok, 0, "tokens") < 0) return NULL;
    Py_ssize_t m = tok.len / 8 / t->max_len;
    if (out_buffer(args[2], &cnt, m * t->max_len, "counts") < 0) { PyBuffer_Release(&tok); return NULL; }
    Py_ssize_t got = find_chunk(t, row, t->max_order, 1, m, tok.buf, cnt.buf, &order, &total);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&cnt);
    if (!order) Py_RETURN_NONE;
    return Py_BuildValue("(LnL)", (long long)order, got, (long long)total);
}

static PyObject *Table_lookup_batch(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer ctx, out[4]; /* tokens, counts, order, total */
    static const char *names[4] = {"tokens", "counts", "order", "total"};
    int held = 0;
    PyObject *result = NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "lookup_batch(contexts, tokens, counts, order, total)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &ctx, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    Py_ssize_t B = ctx.ndim == 2 ? ctx.shape[0] : 0, W = ctx.ndim == 2 ? ctx.shape[1] : 0, L = t->max_len, m = 0;
    if (ctx.ndim != 2 || ctx.itemsize != 8 || !strchr("lq", ctx.format[strlen(ctx.format) - 1])) {
        PyErr_SetString(PyExc_TypeError, "contexts must be a C-contiguous int64 array [B, W]");
        goto done;
    }
    for (; held < 4; held++) {
        if (out_buffer(args[held + 1], &out[held], held < 2 ? B * m * L : B, names[held]) < 0) goto done;
        if (held == 0) m = B ? out[0].len / 8 / B / L : 0;
    }
    int64_t *tokens = out[0].buf, *counts = out[1].buf, *order = out[2].buf, *total = out[3].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r0 = 0; r0 < B; r0 += CHUNK)
        find_chunk(t, (const int64_t *)ctx.buf + r0 * W, W, B - r0 < CHUNK ? B - r0 : CHUNK, m, tokens + r0 * m * L,
                   counts + r0 * m * L, order + r0, total + r0);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ctx);
    for (int i = 0; i < held; i++) PyBuffer_Release(&out[i]);
    return result;
}

static int Table_init(Table *t, PyObject *args, PyObject *kw) {
    PyObject *bufs[7], *orders;
    unsigned long long pad;
    (void)kw;
    if (!PyArg_ParseTuple(args, "OOiOOOOOOK", &bufs[0], &bufs[1], &t->shift, &bufs[2], &bufs[3], &bufs[4], &bufs[5],
                          &bufs[6], &orders, &pad))
        return -1;
    if (t->keys.obj) {
        PyErr_SetString(PyExc_RuntimeError, "a draft-file Table is initialised once");
        return -1;
    }
    Py_buffer *dst[7] = {&t->keys, &t->bucket, &t->key_orders, &t->key_totals, &t->key_offsets, &t->entry_tokens,
                         &t->entry_counts};
    for (int i = 0; i < 7; i++)
        if (PyObject_GetBuffer(bufs[i], dst[i], PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (t->keys.itemsize != 8 || t->key_totals.itemsize != 4 || t->entry_counts.itemsize != 4 ||
        t->entry_tokens.ndim != 2) {
        PyErr_SetString(PyExc_ValueError, "draft-file sections have unexpected item sizes");
        return -1;
    }
    t->n_keys = t->keys.len / 8;
    t->max_len = t->entry_tokens.shape[1];
    t->pad = pad;
    t->n_orders = (int)PySequence_Length(orders);
    if (t->n_orders < 1 || t->n_orders > MAX_ORDERS) {
        PyErr_SetString(PyExc_ValueError, "draft file orders: 1 to 32 of them");
        return -1;
    }
    for (int i = 0; i < t->n_orders; i++) {
        PyObject *o = PySequence_GetItem(orders, i);
        t->orders[i] = (int)PyLong_AsLong(o);
        Py_XDECREF(o);
        if (t->orders[i] < 1 || t->orders[i] > MAX_ORDERS || (i && t->orders[i] <= t->orders[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "draft file orders must ascend within 1..32");
            return -1;
        }
    }
    t->max_order = t->orders[t->n_orders - 1];
    return 0;
}

static void Table_dealloc(Table *t) {
    Py_buffer *bufs[7] = {&t->keys, &t->bucket, &t->key_orders, &t->key_totals, &t->key_offsets, &t->entry_tokens,
                          &t->entry_counts};
    for (int i = 0; i < 7; i++)
        if (bufs[i]->obj) PyBuffer_Release(bufs[i]);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Table_methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))Table_lookup, METH_FASTCALL, "lookup(context, tokens, counts)"},
    {"lookup_batch", (PyCFunction)(void (*)(void))Table_lookup_batch, METH_FASTCALL,
     "lookup_batch(contexts, tokens, counts, order, total)"},
    {NULL}};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "data._draft_lookup.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draft_lookup", "Compiled draft-file lookups", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__draft_lookup(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) { Py_DECREF(&TableType); Py_DECREF(m); return NULL; }
    return m;
}
