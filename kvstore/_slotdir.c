/* kvstore._slotdir: the slot directory's per-block loops (kvstore/slotdir.py) in C.
 *
 * The directory's layout, its protocol and its Python implementation are slotdir.py's; this
 * module runs the same steps over the same shared memory, and slotdir.py keeps its own
 * loops for an install without a C compiler. What they cost in Python: a drain of the
 * daemon's put drainer publishes each committed block and unpublishes each evicted one,
 * ~3.5 us a block of its ~14 (in process, warm, 30-record drains); a same-host put looks
 * its hash up first (`find`, ~1-4 us of a ~30 us 256 KiB put).
 *
 * Ordering is the protocol's (slotdir.py: "Ordering"): a writer stores a slot's owner
 * before its generation, and its generation before its table entry; a reader loads the
 * generation before the owner. On x86-64 (TSO) plain stores and loads keep that order in
 * the CPU; the __atomic accesses below (relaxed, with release/acquire where the order
 * matters) keep the compiler from reordering or tearing them. DIRECT_READS is False off
 * x86-64 and nothing reads the directory there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PROBES 8
#define SLOT_BITS 32
#define LOW ((1ULL << SLOT_BITS) - 1)
#define TAG_MASK ((1ULL << 31) - 1)
#define HASH_BYTES 16

typedef struct {
    Py_buffer gen, owner, table; /* int64[num_slots], 16 B[num_slots], int64[table_size] */
    int64_t num_slots, table_size;
    uint64_t mask;
} Dir;

static void release_dir(Dir *d)
{
    if (d->gen.obj)
        PyBuffer_Release(&d->gen);
    if (d->owner.obj)
        PyBuffer_Release(&d->owner);
    if (d->table.obj)
        PyBuffer_Release(&d->table);
}

/* the three views (gen, owner, table), checked against one another: 0, or -1 with an
 * exception set (nothing held) */
static int take_dir(PyObject *gen, PyObject *owner, PyObject *table, int writable, Dir *d)
{
    memset(d, 0, sizeof *d);
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(gen, &d->gen, flags) < 0 ||
            PyObject_GetBuffer(owner, &d->owner, flags) < 0 ||
            PyObject_GetBuffer(table, &d->table, flags) < 0) {
        release_dir(d);
        return -1;
    }
    d->num_slots = d->gen.len / 8;
    d->table_size = d->table.len / 8;
    d->mask = (uint64_t)d->table_size - 1;
    if (d->gen.len % 8 || d->table.len % 8 || d->owner.len != HASH_BYTES * d->num_slots ||
            d->table_size < PROBES || (d->table_size & (d->table_size - 1))) {
        release_dir(d);
        PyErr_SetString(PyExc_ValueError, "not the views of one slot directory (gen, owner, "
                        "table: 8 bytes a slot, 16 a slot, a power of two of 8-byte entries)");
        return -1;
    }
    return 0;
}

static void key(const unsigned char *h, uint64_t mask, uint64_t *bucket, uint64_t *tag)
{
    uint64_t b;
    uint32_t t;
    memcpy(&b, h, 8); /* little-endian, as slotdir.py's struct "<QI" */
    memcpy(&t, h + 8, 4);
    *bucket = b & mask;
    *tag = ((uint64_t)t & TAG_MASK) << SLOT_BITS;
}

/* the (slot, hash) pairs of two sequences, their slots checked whole (within the
 * directory) before anything is written; a hash is checked where it is used (`hash_at`: a
 * granted slot never published is freed under an empty one). The number of pairs, or -1
 * with an exception set. */
static Py_ssize_t take_pairs(PyObject *slots, PyObject *hashes, const Dir *d,
                             PyObject **fs, PyObject **fh)
{
    *fs = PySequence_Fast(slots, "slots must be a sequence of ints");
    if (*fs == NULL)
        return -1;
    *fh = PySequence_Fast(hashes, "hashes must be a sequence of bytes");
    if (*fh == NULL) {
        Py_CLEAR(*fs);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(*fs);
    if (PySequence_Fast_GET_SIZE(*fh) != n) {
        PyErr_SetString(PyExc_ValueError, "as many hashes as slots, please");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(*fs, i));
        if (s == -1 && PyErr_Occurred())
            goto fail;
        if (s < 0 || s >= d->num_slots) {
            PyErr_Format(PyExc_ValueError, "slot %lld is not one of the directory's %lld",
                         s, (long long)d->num_slots);
            goto fail;
        }
    }
    return n;
fail:
    Py_CLEAR(*fs);
    Py_CLEAR(*fh);
    return -1;
}

/* the i-th hash's bytes, or NULL with ValueError set (not bytes of HASH_BYTES) */
static const unsigned char *hash_at(PyObject *fh, Py_ssize_t i)
{
    PyObject *h = PySequence_Fast_GET_ITEM(fh, i);
    if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) != HASH_BYTES) {
        PyErr_Format(PyExc_ValueError, "hash %zd is not %d bytes", i, HASH_BYTES);
        return NULL;
    }
    return (const unsigned char *)PyBytes_AS_STRING(h);
}

/* one pair's step under `each_pair`: 0, or -1 with an exception set */
typedef int (*step_fn)(const Dir *d, int64_t slot, PyObject *fh, Py_ssize_t i);

/* slotdir.SlotDirectory.publish of one (slot, hash) */
static int publish_one(const Dir *d, int64_t slot, PyObject *fh, Py_ssize_t i)
{
    int64_t *gen = d->gen.buf, *table = d->table.buf;
    int64_t gv = __atomic_load_n(&gen[slot], __ATOMIC_RELAXED);
    if (!(gv & 1))
        return 0; /* already published */
    const unsigned char *h = hash_at(fh, i);
    if (h == NULL)
        return -1;
    memcpy((unsigned char *)d->owner.buf + HASH_BYTES * slot, h, HASH_BYTES);
    /* odd -> even: after the owner, so a reader never sees it stale */
    __atomic_store_n(&gen[slot], gv + 1, __ATOMIC_RELEASE);
    uint64_t b, tag;
    key(h, d->mask, &b, &tag);
    int64_t entry = (int64_t)(tag | (uint64_t)(slot + 1));
    for (int k = 0; k < PROBES; k++) {
        uint64_t at = (b + (uint64_t)k) & d->mask;
        int64_t cur = (int64_t)((uint64_t)__atomic_load_n(&table[at], __ATOMIC_RELAXED) & LOW) - 1;
        if (cur < 0 || cur >= d->num_slots ||
                (__atomic_load_n(&gen[cur], __ATOMIC_RELAXED) & 1)) {
            __atomic_store_n(&table[at], entry, __ATOMIC_RELEASE);
            return 0;
        }
    }
    __atomic_store_n(&table[b], entry, __ATOMIC_RELEASE); /* a crowded bucket: that other
                                                             block loses its hint */
    return 0;
}

/* slotdir.SlotDirectory.unpublish of one (slot, hash) */
static int unpublish_one(const Dir *d, int64_t slot, PyObject *fh, Py_ssize_t i)
{
    int64_t *gen = d->gen.buf, *table = d->table.buf;
    int64_t gv = __atomic_load_n(&gen[slot], __ATOMIC_RELAXED);
    if (gv & 1)
        return 0; /* never published (a reservation given back) */
    /* even -> odd first: a copy in flight now fails its re-check (the entry is cleared
     * below, found by its hash: a hash that is none leaves it, a stale hint) */
    __atomic_store_n(&gen[slot], gv + 1, __ATOMIC_RELEASE);
    const unsigned char *h = hash_at(fh, i);
    if (h == NULL)
        return -1;
    uint64_t b, tag;
    key(h, d->mask, &b, &tag);
    for (int k = 0; k < PROBES; k++) {
        uint64_t at = (b + (uint64_t)k) & d->mask;
        if (((uint64_t)__atomic_load_n(&table[at], __ATOMIC_RELAXED) & LOW) ==
                (uint64_t)(slot + 1)) {
            __atomic_store_n(&table[at], 0, __ATOMIC_RELEASE);
            break;
        }
    }
    return 0;
}

/* (gen, owner, table, slots, hashes) parsed by `format`, then `step` for each pair in
 * order (the slots all checked first), stopping at the first that fails */
static PyObject *each_pair(PyObject *args, const char *format, step_fn step)
{
    PyObject *g, *o, *t, *slots, *hashes, *fs, *fh;
    Dir d;
    if (!PyArg_ParseTuple(args, format, &g, &o, &t, &slots, &hashes))
        return NULL;
    if (take_dir(g, o, t, 1, &d) < 0)
        return NULL;
    Py_ssize_t n = take_pairs(slots, hashes, &d, &fs, &fh);
    if (n < 0) {
        release_dir(&d);
        return NULL;
    }
    int failed = 0;
    for (Py_ssize_t i = 0; i < n && !failed; i++)
        failed = step(&d, PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fs, i)), fh, i) < 0;
    Py_DECREF(fs);
    Py_DECREF(fh);
    release_dir(&d);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* publish(gen, owner, table, slots, hashes): slotdir.SlotDirectory.publish */
static PyObject *publish(PyObject *self, PyObject *args)
{
    return each_pair(args, "OOOOO:publish", publish_one);
}

/* unpublish(gen, owner, table, slots, hashes): slotdir.SlotDirectory.unpublish */
static PyObject *unpublish(PyObject *self, PyObject *args)
{
    return each_pair(args, "OOOOO:unpublish", unpublish_one);
}

/* find(gen, owner, table, block_hash) -> (slot, gen) | None: slotdir's reader `find`
 * (the caller checked the directory is open and the hash is 16 bytes) */
static PyObject *find(PyObject *self, PyObject *args)
{
    PyObject *g, *o, *t;
    const char *h;
    Py_ssize_t hlen;
    Dir d;
    if (!PyArg_ParseTuple(args, "OOOy#:find", &g, &o, &t, &h, &hlen))
        return NULL;
    if (hlen != HASH_BYTES)
        Py_RETURN_NONE;
    if (take_dir(g, o, t, 0, &d) < 0)
        return NULL;
    const int64_t *gen = d.gen.buf, *table = d.table.buf;
    const unsigned char *owner = d.owner.buf;
    uint64_t b, tag;
    key((const unsigned char *)h, d.mask, &b, &tag);
    for (int k = 0; k < PROBES; k++) {
        uint64_t e = (uint64_t)__atomic_load_n(&table[(b + (uint64_t)k) & d.mask],
                                               __ATOMIC_ACQUIRE);
        if ((e & ~LOW) != tag)
            continue;
        int64_t slot = (int64_t)(e & LOW) - 1;
        if (slot < 0 || slot >= d.num_slots)
            continue;
        /* the generation before the owner: an even one read first vouches for the owner
         * read after it (the writer stores them the other way round) */
        int64_t gv = __atomic_load_n(&gen[slot], __ATOMIC_ACQUIRE);
        if (gv & 1)
            continue;
        unsigned char who[HASH_BYTES];
        for (int j = 0; j < HASH_BYTES; j++)
            who[j] = __atomic_load_n(&owner[HASH_BYTES * slot + j], __ATOMIC_RELAXED);
        if (memcmp(who, h, HASH_BYTES) == 0) {
            release_dir(&d);
            return Py_BuildValue("(LL)", (long long)slot, (long long)gv);
        }
    }
    release_dir(&d);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"publish", publish, METH_VARARGS,
     "publish(gen, owner, table, slots, hashes): the blocks are readable in these slots "
     "(kvstore.slotdir.SlotDirectory.publish)."},
    {"unpublish", unpublish, METH_VARARGS,
     "unpublish(gen, owner, table, slots, hashes): the blocks leave these slots "
     "(kvstore.slotdir.SlotDirectory.unpublish)."},
    {"find", find, METH_VARARGS,
     "find(gen, owner, table, block_hash) -> (slot, gen) | None: a published slot holding "
     "block_hash (kvstore.slotdir.SlotDirectoryReader.find)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotdir", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slotdir(void)
{
    return PyModule_Create(&module);
}
