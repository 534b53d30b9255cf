/* kvstore.tiers._slabio: the SSD tier's payload I/O with each block's checksum taken
 * beside it, in one call with the GIL released (kvstore/tiers/slabfile.py says what it
 * replaces and by how much).
 *
 * Blocks of the slab file are written and read the way slabfile.py's Python path does it:
 * a run of small blocks in pwritev / preadv calls of about a cache's worth, each block
 * hashed right after its call, while the kernel's copy has left it in cache; a big block in
 * pieces, each hashed right after its own call.
 * What Python spent around each of those calls (a slice, a call through `_io`, a hash
 * object's update: ~30 us of a 1 MiB put's ~350 on a 2-vCPU Xeon VM, with cold caches) and
 * the GIL taken back between them are gone; the system calls and the hashing are the same.
 *
 * The checksum is the tier's (kvstore.layout.checksum: xxh3_64, seed 0), computed by the
 * xxhash package's own library, which exports its XXH3 functions: `bind` looks them up in
 * the already-loaded extension module of the `xxhash` package (the pinned build does; a
 * build that does not leaves `bind` False, and slabfile.py keeps its Python path). No hash
 * is implemented here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_PAD 4096 /* a slot's stride is its block rounded up to a page */
#define MAX_RUN 500  /* blocks per call (2 iovecs each, under IOV_MAX = 1024) */
#define HEADER_BYTES 64 /* kvstore.layout's block header */
#define SUM_AT 36       /* where its payload checksum lies (little-endian u64) */

static void store_le64(char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (char)(v >> (8 * i));
}

typedef uint64_t (*oneshot_fn)(const void *, size_t);
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static oneshot_fn xxh_oneshot;
static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;
static const char zeros[MAX_PAD];

static void *find(void *lib, const char *fast, const char *plain)
{
    void *f = fast ? dlsym(lib, fast) : NULL; /* the CPU-dispatched variant where exported */
    return f ? f : dlsym(lib, plain);
}

/* bind(path) -> bool: take the XXH3 functions from the shared library at `path` (the
 * xxhash package's extension module, already loaded). False where one is missing. Once
 * bound, the functions stay (a second call changes nothing: calls in flight use them). */
static PyObject *bind(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s:bind", &path))
        return NULL;
    if (xxh_oneshot != NULL)
        Py_RETURN_TRUE;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE;
    oneshot_fn o = (oneshot_fn)find(lib, "XXH3_64bits_dispatch", "XXH3_64bits");
    create_fn c = (create_fn)find(lib, NULL, "XXH3_createState");
    free_fn f = (free_fn)find(lib, NULL, "XXH3_freeState");
    reset_fn r = (reset_fn)find(lib, NULL, "XXH3_64bits_reset");
    update_fn u = (update_fn)find(lib, "XXH3_64bits_update_dispatch", "XXH3_64bits_update");
    digest_fn d = (digest_fn)find(lib, NULL, "XXH3_64bits_digest");
    if (!(o && c && f && r && u && d))
        Py_RETURN_FALSE; /* (the handle stays: the module holds the library loaded anyway) */
    xxh_oneshot = o, xxh_create = c, xxh_free = f, xxh_reset = r, xxh_update = u;
    xxh_digest = d;
    Py_RETURN_TRUE;
}

/* one positional preadv / pwritev of every byte of iov[0..n) at `offset`, continued after
 * a short transfer. 0, or an errno (EIO for a read that met the end of the file). */
static int full_io(int fd, struct iovec *iov, int n, off_t offset, int write)
{
    while (n > 0) {
        ssize_t k = write ? pwritev(fd, iov, n, offset) : preadv(fd, iov, n, offset);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (k == 0)
            return EIO; /* the end of the file (a read), or a write that moved nothing */
        offset += k;
        while (n > 0 && (size_t)k >= iov->iov_len) {
            k -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + k;
            iov->iov_len -= (size_t)k;
        }
    }
    return 0;
}

typedef struct {
    Py_buffer *views;
    Py_ssize_t n, len;
} Blocks;

static void release(Blocks *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++)
        PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
}

static int check_span(long long offset, Py_ssize_t n, Py_ssize_t stride);

/* the buffers of `seq` (contiguous, all one length, writable for a read), held until
 * release(), each of which fits its slot of `stride` bytes from `offset`; -1 with an
 * exception set (nothing held) */
static int take(PyObject *seq, int writable, long long offset, Py_ssize_t stride, Blocks *b)
{
    PyObject *fast = PySequence_Fast(seq, "blocks must be a sequence of buffers");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    b->n = 0, b->len = 0;
    b->views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (b->views == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &b->views[i], flags) < 0)
            goto fail;
        b->n = i + 1;
        if (i == 0)
            b->len = b->views[0].len;
        if (b->views[i].len != b->len) {
            PyErr_Format(PyExc_ValueError, "block %zd is %zd bytes, block 0 %zd", i,
                         b->views[i].len, b->len);
            goto fail;
        }
    }
    Py_DECREF(fast);
    if (n > 0 && (b->len <= 0 || b->len > stride || stride - b->len > MAX_PAD)) {
        PyErr_Format(PyExc_ValueError, "blocks of %zd bytes do not fit slots of %zd "
                     "(a pad of at most %d)", b->len, stride, MAX_PAD);
        release(b);
        return -1;
    }
    if (check_span(offset, b->n, stride) < 0) {
        release(b);
        return -1;
    }
    return 0;
fail:
    Py_DECREF(fast);
    release(b);
    return -1;
}

/* 0 when every slot from `offset` on, `n` of `stride` bytes, lies within off_t; -1 with
 * ValueError set otherwise (a negative offset too) */
static int check_span(long long offset, Py_ssize_t n, Py_ssize_t stride)
{
    long long span, end;
    if (offset < 0 || __builtin_mul_overflow((long long)n, (long long)stride, &span)
            || __builtin_add_overflow(offset, span, &end)) {
        PyErr_Format(PyExc_ValueError, "%zd slots of %zd bytes from offset %lld do not fit a "
                     "file", n, stride, offset);
        return -1;
    }
    return 0;
}

/* blocks per call of a run of small blocks: `per_call`, within 1..MAX_RUN */
static int group(Py_ssize_t per_call)
{
    return per_call < 1 ? 1 : per_call > MAX_RUN ? MAX_RUN : (int)per_call;
}

/* write_blocks(fd, offset, blocks, stride, per_call, piece[, hfd, heads]) -> list[int]:
 * write `blocks` (buffers of one length) into consecutive slots of `stride` bytes from
 * `offset`, each followed by zeros to its stride: `per_call` blocks a pwritev, each hashed
 * right after it, or, `piece` > 0, each block in pieces of `piece` bytes, each hashed right
 * after its own pwritev. With `heads` (a writable buffer of one 64-byte header per block,
 * their checksum fields to fill), each checksum goes into its header, and once every
 * payload is written the headers go in one pwrite at slot * 64 of `hfd` (no header before
 * the bytes it vouches for). Each block's checksum; OSError (errno) at the first failure. */
static PyObject *write_blocks(PyObject *self, PyObject *args)
{
    int fd, hfd = -1;
    long long offset;
    PyObject *seq, *heads_obj = Py_None;
    Py_ssize_t stride, per_call, piece_bytes;
    if (!PyArg_ParseTuple(args, "iLOnnn|iO:write_blocks", &fd, &offset, &seq, &stride, &per_call,
                          &piece_bytes, &hfd, &heads_obj))
        return NULL;
    if (xxh_oneshot == NULL || piece_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "write_blocks: bind() first; piece must not be negative");
        return NULL;
    }
    Py_buffer heads = {0};
    if (heads_obj != Py_None) {
        if (PyObject_GetBuffer(heads_obj, &heads, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            return NULL;
        if (hfd < 0 || stride <= 0 || offset % stride != 0) {
            PyBuffer_Release(&heads);
            PyErr_SetString(PyExc_ValueError, "write_blocks: headers need their file and an "
                            "offset at a slot's start");
            return NULL;
        }
    }
    Blocks b;
    if (take(seq, 0, offset, stride, &b) < 0) {
        if (heads.obj)
            PyBuffer_Release(&heads);
        return NULL;
    }
    if (heads.obj && heads.len != b.n * HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "write_blocks: %zd bytes of headers for %zd blocks "
                     "(%d each)", heads.len, b.n, HEADER_BYTES);
        PyBuffer_Release(&heads);
        release(&b);
        return NULL;
    }
    uint64_t *sums = PyMem_Calloc(b.n ? (size_t)b.n : 1, sizeof(uint64_t));
    struct iovec *iov = PyMem_Calloc(2 * MAX_RUN, sizeof(struct iovec));
    void *state = xxh_create();
    if (sums == NULL || iov == NULL || state == NULL) {
        PyMem_Free(sums), PyMem_Free(iov);
        if (state)
            xxh_free(state);
        release(&b);
        return PyErr_NoMemory();
    }
    size_t pad = (size_t)(stride - b.len);
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (piece_bytes > 0) {
        for (Py_ssize_t i = 0; i < b.n && !err; i++) {
            const char *p = b.views[i].buf;
            off_t base = (off_t)offset + (off_t)i * stride;
            xxh_reset(state);
            for (Py_ssize_t at = 0; at < b.len && !err; at += piece_bytes) {
                size_t piece = (size_t)(b.len - at < piece_bytes ? b.len - at : piece_bytes);
                int k = 0;
                iov[k++] = (struct iovec){(void *)(p + at), piece};
                if (at + piece_bytes >= b.len && pad)
                    iov[k++] = (struct iovec){(void *)zeros, pad};
                err = full_io(fd, iov, k, base + at, 1);
                if (!err)
                    xxh_update(state, p + at, piece);
            }
            sums[i] = xxh_digest(state);
        }
    } else {
        int per = group(per_call);
        for (Py_ssize_t i = 0; i < b.n && !err; i += per) {
            Py_ssize_t m = b.n - i < per ? b.n - i : per;
            int k = 0;
            for (Py_ssize_t j = i; j < i + m; j++) {
                iov[k++] = (struct iovec){b.views[j].buf, (size_t)b.len};
                if (pad)
                    iov[k++] = (struct iovec){(void *)zeros, pad};
            }
            err = full_io(fd, iov, k, (off_t)offset + (off_t)i * stride, 1);
            for (Py_ssize_t j = i; j < i + m && !err; j++)
                sums[j] = xxh_oneshot(b.views[j].buf, (size_t)b.len);
        }
    }
    if (heads.obj && !err && b.n) { /* each header vouches for its payload, written above */
        char *h = heads.buf;
        for (Py_ssize_t i = 0; i < b.n; i++)
            store_le64(h + i * HEADER_BYTES + SUM_AT, sums[i]);
        iov[0] = (struct iovec){h, (size_t)heads.len};
        err = full_io(hfd, iov, 1, (off_t)(offset / stride) * HEADER_BYTES, 1);
    }
    Py_END_ALLOW_THREADS
    if (heads.obj)
        PyBuffer_Release(&heads);
    xxh_free(state);
    PyMem_Free(iov);
    release(&b);
    PyObject *out = NULL;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if ((out = PyList_New(b.n)) != NULL) {
        for (Py_ssize_t i = 0; i < b.n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
            if (v == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, v);
        }
    }
    PyMem_Free(sums);
    return out;
}

/* read_blocks(fd, offset, blocks, stride, per_call, piece) -> list[int | None]: read
 * consecutive slots of `stride` bytes from `offset` into `blocks` (writable buffers of one
 * length), in calls and pieces as write_blocks writes them; each block's checksum, None for
 * one that could not be read (an error, the end of the file). A run that fails is read
 * again a block at a time: one bad spot costs only the blocks on it. */
static PyObject *read_blocks(PyObject *self, PyObject *args)
{
    int fd;
    long long offset;
    PyObject *seq;
    Py_ssize_t stride, per_call, piece_bytes;
    if (!PyArg_ParseTuple(args, "iLOnnn:read_blocks", &fd, &offset, &seq, &stride, &per_call,
                          &piece_bytes))
        return NULL;
    if (xxh_oneshot == NULL || piece_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "read_blocks: bind() first; piece must not be negative");
        return NULL;
    }
    Blocks b;
    if (take(seq, 1, offset, stride, &b) < 0)
        return NULL;
    uint64_t *sums = PyMem_Calloc(b.n ? (size_t)b.n : 1, sizeof(uint64_t));
    char *good = PyMem_Calloc(b.n ? (size_t)b.n : 1, 1);
    struct iovec *iov = PyMem_Calloc(2 * MAX_RUN, sizeof(struct iovec));
    char *scratch = PyMem_Malloc(MAX_PAD);
    void *state = xxh_create();
    if (!sums || !good || !iov || !scratch || !state) {
        PyMem_Free(sums), PyMem_Free(good), PyMem_Free(iov), PyMem_Free(scratch);
        if (state)
            xxh_free(state);
        release(&b);
        return PyErr_NoMemory();
    }
    size_t pad = (size_t)(stride - b.len);
    Py_BEGIN_ALLOW_THREADS
    if (piece_bytes > 0) {
        for (Py_ssize_t i = 0; i < b.n; i++) {
            char *p = b.views[i].buf;
            off_t base = (off_t)offset + (off_t)i * stride;
            int err = 0;
            xxh_reset(state);
            for (Py_ssize_t at = 0; at < b.len && !err; at += piece_bytes) {
                size_t piece = (size_t)(b.len - at < piece_bytes ? b.len - at : piece_bytes);
                iov[0] = (struct iovec){p + at, piece};
                err = full_io(fd, iov, 1, base + at, 0);
                if (!err)
                    xxh_update(state, p + at, piece);
            }
            if (!err)
                sums[i] = xxh_digest(state), good[i] = 1;
        }
    } else {
        int per = group(per_call);
        for (Py_ssize_t i = 0; i < b.n; i += per) {
            Py_ssize_t m = b.n - i < per ? b.n - i : per;
            int k = 0;
            for (Py_ssize_t j = i; j < i + m; j++) {
                iov[k++] = (struct iovec){b.views[j].buf, (size_t)b.len};
                if (pad && j + 1 < i + m) /* (the last block's pad is not read) */
                    iov[k++] = (struct iovec){scratch, pad};
            }
            off_t at = (off_t)offset + (off_t)i * stride;
            if (full_io(fd, iov, k, at, 0) == 0) {
                for (Py_ssize_t j = i; j < i + m; j++)
                    sums[j] = xxh_oneshot(b.views[j].buf, (size_t)b.len), good[j] = 1;
                continue;
            }
            for (Py_ssize_t j = i; j < i + m; j++) { /* one block at a time */
                iov[0] = (struct iovec){b.views[j].buf, (size_t)b.len};
                if (full_io(fd, iov, 1, (off_t)offset + (off_t)j * stride, 0) == 0)
                    sums[j] = xxh_oneshot(b.views[j].buf, (size_t)b.len), good[j] = 1;
            }
        }
    }
    Py_END_ALLOW_THREADS
    xxh_free(state);
    PyMem_Free(iov);
    PyMem_Free(scratch);
    release(&b);
    PyObject *out = PyList_New(b.n);
    for (Py_ssize_t i = 0; out != NULL && i < b.n; i++) {
        PyObject *v = good[i] ? PyLong_FromUnsignedLongLong(sums[i]) : Py_NewRef(Py_None);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(sums);
    PyMem_Free(good);
    return out;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(path) -> bool: use the XXH3 functions of the loaded shared library at path (the "
     "xxhash package's extension module); False where it does not export them."},
    {"write_blocks", write_blocks, METH_VARARGS,
     "write_blocks(fd, offset, blocks, stride, per_call, piece[, hfd, heads]) -> list[int]: write buffers "
     "of one length into consecutive slots of stride bytes (zero-padded) from offset, "
     "per_call blocks a pwritev or (piece > 0) each in pieces of piece bytes, each hashed "
     "(xxh3_64) right after its write; with hfd and heads (64-byte headers, one per block), "
     "the checksums filled into them and the headers written at slot * 64 of hfd after every "
     "payload; the checksums. OSError at the first failure."},
    {"read_blocks", read_blocks, METH_VARARGS,
     "read_blocks(fd, offset, blocks, stride, per_call, piece) -> list[int | None]: read "
     "consecutive slots into writable buffers of one length, in calls and pieces as "
     "write_blocks writes them, each hashed; each block's checksum, None where it could "
     "not be read."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slabio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slabio(void)
{
    return PyModule_Create(&module);
}
