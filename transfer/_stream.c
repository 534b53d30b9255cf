/* transfer._stream: a host-to-host copy whose stores bypass the CPU caches, a socket
 * receive loop that keeps Python out of the way of big payloads (recv_into, below), and
 * the faulting-in of a new mapping with the GIL released (populate, below).
 *
 * glibc's memcpy switches to non-temporal stores only above x86_non_temporal_threshold,
 * which it derives from the L3 size (181 MiB on a VM reporting a 480 MiB L3), so every
 * 256 KiB-4 MiB block copy of a tier or a client ran with ordinary stores: each
 * destination line read from memory before it is overwritten, and the copy evicting the
 * caches the code around it runs from. Measured on a 2-vCPU Xeon VM, 960 MiB in blocks
 * into a destination not just written: 256 KiB 43 -> 30 us, 1 MiB 165 -> 105 us,
 * 4 MiB 655 -> 411 us. transfer/copy.py decides which copies go through here (a put's
 * into the slots it fills); without this module (no C compiler at install) they all go
 * through numpy.
 *
 * The stores are SSE2's (every x86-64 has them); other CPUs get memcpy. The GIL is
 * released while the bytes move. The two buffers must not overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

static void stream_copy(char *d, const char *s, size_t n)
{
    /* the head up to a cache-line boundary of the destination, so that every streaming
       store fills a whole line (a partial line written around the cache costs a read) */
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    while (n >= 128) {
        __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0));
        __m128i r1 = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 48));
        __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 64));
        __m128i r5 = _mm_loadu_si128((const __m128i *)(s + 80));
        __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 96));
        __m128i r7 = _mm_loadu_si128((const __m128i *)(s + 112));
        _mm_stream_si128((__m128i *)(d + 0), r0);
        _mm_stream_si128((__m128i *)(d + 16), r1);
        _mm_stream_si128((__m128i *)(d + 32), r2);
        _mm_stream_si128((__m128i *)(d + 48), r3);
        _mm_stream_si128((__m128i *)(d + 64), r4);
        _mm_stream_si128((__m128i *)(d + 80), r5);
        _mm_stream_si128((__m128i *)(d + 96), r6);
        _mm_stream_si128((__m128i *)(d + 112), r7);
        d += 128;
        s += 128;
        n -= 128;
    }
    _mm_sfence(); /* the streamed lines are visible to other cores before we return */
    memcpy(d, s, n);
}
#else
static void stream_copy(char *d, const char *s, size_t n)
{
    memcpy(d, s, n);
}
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into a buffer of %zd", src.len,
                     dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* copy_at(dst_address, src_address, nbytes): copy as `copy` does, between two host
 * addresses the caller holds as ints and vouches for (both mapped for nbytes, and kept so
 * while this runs). A same-host put of one CPU tensor copies into its slot this way: the
 * tensor's .numpy(), the slot's row and the two buffer exports cost ~5 us of a ~40 us
 * 256 KiB put, its address ~0.3. */
static PyObject *copy_at(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKn:copy_at", &dst, &src, &n))
        return NULL;
    if (n < 0 || (n && (!dst || !src))) {
        PyErr_SetString(PyExc_ValueError, "copy_at needs two addresses and a size >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* fence(): a full memory barrier (mfence on x86-64). A same-host put publishes its record
 * (a store), then looks whether the daemon's drainer sleeps (a load); the drainer marks
 * itself asleep (a store), then looks for records (a load). x86-64 lets a store pass a
 * later load, so each side fences between the two, or each could miss the other's. */
static PyObject *fence(PyObject *self, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* recv_into(fd, buffer, chunk): fill `buffer` from a blocking stream socket in calls of
 * at most `chunk` bytes (MSG_WAITALL), with the GIL released once for the whole loop, not
 * once per call with Python running in between (4 MiB payloads to 4 threads of one client
 * or the daemon: gets 4.1 -> 4.8 GB/s, puts 4.4 -> 5.5). Returns the bytes received: all
 * of them, or fewer once a call came back short (the socket's receive timeout ran out, the
 * peer closed, a signal, an error after some bytes): the caller checks its own deadline and
 * calls again, meeting the end or the error then. An error before any byte raises OSError
 * (BlockingIOError when the receive timeout ran out); an interrupted call is retried after
 * the signal handlers ran (an exception from one is raised). */
static PyObject *recv_into(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer buf;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "iw*n:recv_into", &fd, &buf, &chunk))
        return NULL;
    if (chunk <= 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return NULL;
    }
    char *p = (char *)buf.buf;
    Py_ssize_t n = buf.len, got = 0;
    int err = 0;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        while (got < n) {
            size_t want = (size_t)(n - got < chunk ? n - got : chunk);
            ssize_t k = recv(fd, p + got, want, MSG_WAITALL);
            if (k > 0)
                got += k;
            if (k == (ssize_t)want)
                continue;
            /* short: the socket's receive timeout ran out (the caller checks its deadline
               before calling again: a peer that sends a little at a time is bounded by it,
               not kept here), the peer closed, a signal, or an error */
            err = k < 0 ? errno : 0;
            break;
        }
        Py_END_ALLOW_THREADS
        if (err != EINTR)
            break;
        err = 0;
        if (PyErr_CheckSignals() < 0) { /* a handler raised: stop, as socket.recv_into does */
            PyBuffer_Release(&buf);
            return NULL;
        }
    }
    PyBuffer_Release(&buf);
    if (err && got == 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(got);
}

/* spin_recv(fd, buffer, spin_ns) -> int: poll a stream socket for up to spin_ns
 * nanoseconds (non-blocking receives, the GIL released) and receive what arrives into
 * buffer: the bytes received, 0 when the peer closed, -1 when nothing came in time. A
 * thread that blocks at once pays the CPU's wake-up when the bytes come: on a 2-vCPU VM
 * whose idle vCPUs halt (no guest halt-polling), a 256 KiB request/reply ping-pong between
 * two processes took 95 us at p50 blocking and 33 us with both sides polling first.
 * -2 when the polling thread was descheduled meanwhile (two looks at the clock more than
 * PREEMPTED_NS apart): the CPUs are oversubscribed, and a poller then holds a CPU that the
 * peer it waits for may need (on a 2-vCPU VM beside 2 busy processes, a 256 KiB get went
 * to ~190 us at p50 whenever both ends polled on one CPU, against ~50 on two). */
#define PREEMPTED_NS 50000LL
static PyObject *spin_recv(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer buf;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "iw*L:spin_recv", &fd, &buf, &spin_ns))
        return NULL;
    ssize_t k = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec now, end, prev;
    clock_gettime(CLOCK_MONOTONIC, &end);
    prev = end;
    end.tv_sec += spin_ns / 1000000000LL;
    end.tv_nsec += spin_ns % 1000000000LL;
    if (end.tv_nsec >= 1000000000L) {
        end.tv_sec++;
        end.tv_nsec -= 1000000000L;
    }
    for (;;) {
        k = recv(fd, buf.buf, (size_t)buf.len, MSG_DONTWAIT);
        if (k >= 0)
            break;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            err = errno;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - prev.tv_sec) * 1000000000LL + (now.tv_nsec - prev.tv_nsec)
                > PREEMPTED_NS) {
            k = -2;
            break;
        }
        prev = now;
        if (now.tv_sec > end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec >= end.tv_nsec)) {
            k = -1;
            break;
        }
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(k);
}

/* populate(buffer, write): fault every page of a mapping in (madvise MADV_POPULATE_WRITE,
 * or _READ), the GIL released. Python 3.11's mmap.madvise holds the GIL through the call,
 * and populating a new namespace's 1 GiB arena takes ~0.5 s: every other thread of the
 * daemon (each connection's requests, the HTTP event loop) stood still meanwhile. OSError
 * as madvise's (EINVAL on kernels before 5.14: the caller falls back). */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static PyObject *populate(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    int write;
    if (!PyArg_ParseTuple(args, "y*p:populate", &buf, &write))
        return NULL;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)buf.buf & ~(page - 1);
    size_t len = (size_t)((uintptr_t)buf.buf + (uintptr_t)buf.len - start);
    int r = 0, err = 0;
    if (buf.len > 0) {
        Py_BEGIN_ALLOW_THREADS
        r = madvise((void *)start, len, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
        if (r != 0)
            err = errno;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&buf);
    if (r != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}


/* guarded_copy_runs (below): memcpy of runs between buffers, stopped where a
 * page of either side could not be reached (SIGBUS: a mapped file shrunk under the mapping)
 * instead of the process killed. The transfer library's shm backend maps peers' region
 * files by path, and a peer (buggy, or hostile: same uid, so its files are ours to map)
 * that truncated one killed every process reading it; the daemon maps only sealed
 * memfds of its own and never needs this.
 *
 * How: a SIGBUS handler of ours, in place while a guarded copy runs (guard_enter), and a
 * thread-local jump buffer set while this thread copies: a SIGBUS at an address inside
 * the copy's two ranges jumps back out of the copy; any other goes to the handler that was
 * there before ours (Python's faulthandler, say), or, where that was the default, kills
 * the process as it would have. */
/* (volatile: the compiler must not drop the stores around the memcpy, which it knows
 * reads none of them) */
static __thread sigjmp_buf *volatile guard_jump __attribute__((tls_model("initial-exec")));
static __thread const char *volatile guard_lo[2] __attribute__((tls_model("initial-exec")));
static __thread const char *volatile guard_hi[2] __attribute__((tls_model("initial-exec")));
static struct sigaction bus_before;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = guard_jump;
    const char *at = (const char *)info->si_addr;
    if (jump != NULL && ((at >= guard_lo[0] && at < guard_hi[0]) ||
                         (at >= guard_lo[1] && at < guard_hi[1]))) {
        guard_jump = NULL;
        siglongjmp(*jump, 1);
    }
    if (bus_before.sa_flags & SA_SIGINFO) {
        bus_before.sa_sigaction(sig, info, context);
    } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
        bus_before.sa_handler(sig);
    } else { /* the default: returning runs the faulting access again, which now kills */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGBUS, &dfl, NULL);
    }
}

/* Ours is in place only while some thread copies guarded (`guard_users` of them; both
 * called with the GIL held, so no two at once), the handler that was there before put back
 * after the last: kept installed, ours was chained to by a handler installed over it later
 * (faulthandler.enable()), which we then chained back to, and a fault outside any copy
 * went round the two for ever. One that took our place meanwhile is left alone. */
static int guard_users;

static int guard_enter(void)
{
    if (guard_users++ > 0)
        return 1;
    struct sigaction mine;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    if (sigaction(SIGBUS, &mine, &bus_before) != 0) {
        guard_users--;
        return 0;
    }
    return 1;
}

static void guard_leave(void)
{
    if (--guard_users > 0)
        return;
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO) &&
        now.sa_sigaction == on_sigbus)
        sigaction(SIGBUS, &bus_before, NULL);
}

/* guarded_copy_runs(dsts, dst_offs, srcs, src_offs, lengths) -> int: for each run i,
 * lengths[i] bytes from srcs[i] at src_offs[i] to dsts[i] at dst_offs[i] (buffers; the
 * three others sequences of ints), guarded as above, the handler put in place once for
 * the lot and the GIL released once: -1 when every run was copied, else
 * the index of the run that met an unreachable page (the runs before it copied, it in
 * part, none after). ValueError for a run outside its buffers, before anything is copied. */
typedef struct {
    char *d;
    const char *s;
    size_t n;
} Run;

static Py_ssize_t copy_runs_guarded(Run *runs, Py_ssize_t k)
{
    sigjmp_buf jump;
    volatile Py_ssize_t i = 0;
    if (sigsetjmp(jump, 1) != 0)
        return i;
    for (; i < k; i++) {
        guard_lo[0] = runs[i].d;
        guard_hi[0] = runs[i].d + runs[i].n;
        guard_lo[1] = runs[i].s;
        guard_hi[1] = runs[i].s + runs[i].n;
        guard_jump = &jump;
        memcpy(runs[i].d, runs[i].s, runs[i].n);
        guard_jump = NULL;
    }
    return -1;
}

static PyObject *guarded_copy_runs(PyObject *self, PyObject *args)
{
    PyObject *dsts, *doffs, *srcs, *soffs, *lens;
    if (!PyArg_ParseTuple(args, "OOOOO:guarded_copy_runs", &dsts, &doffs, &srcs, &soffs, &lens))
        return NULL;
    PyObject *seqs[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *in[5] = {dsts, doffs, srcs, soffs, lens};
    Py_buffer *views = NULL;
    Run *runs = NULL;
    Py_ssize_t k = -1, held = 0, failed = -1;
    PyObject *result = NULL;
    for (int j = 0; j < 5; j++) {
        seqs[j] = PySequence_Fast(in[j], "guarded_copy_runs takes five sequences");
        if (seqs[j] == NULL)
            goto done;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs[j]);
        if (k >= 0 && n != k) {
            PyErr_SetString(PyExc_ValueError, "guarded_copy_runs: sequences of different lengths");
            goto done;
        }
        k = n;
    }
    views = PyMem_Calloc((size_t)(2 * k + 1), sizeof(Py_buffer));
    runs = PyMem_Calloc((size_t)(k + 1), sizeof(Run));
    if (views == NULL || runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_buffer *dv = &views[2 * i], *sv = &views[2 * i + 1];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[0], i), dv,
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        held++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[2], i), sv, PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        held++;
        Py_ssize_t doff = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seqs[1], i));
        Py_ssize_t soff = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seqs[3], i));
        Py_ssize_t n = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seqs[4], i));
        if (PyErr_Occurred())
            goto done;
        if (doff < 0 || soff < 0 || n < 0 || doff > dv->len - n || soff > sv->len - n) {
            PyErr_Format(PyExc_ValueError, "run %zd (%zd bytes from %zd to %zd) is outside "
                         "its buffers (%zd and %zd bytes)", i, n, soff, doff, sv->len, dv->len);
            goto done;
        }
        runs[i] = (Run){(char *)dv->buf + doff, (const char *)sv->buf + soff, (size_t)n};
    }
    if (!guard_enter()) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    failed = copy_runs_guarded(runs, k);
    Py_END_ALLOW_THREADS
    guard_leave();
    result = PyLong_FromSsize_t(failed);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(runs);
    for (int j = 0; j < 5; j++)
        Py_XDECREF(seqs[j]);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): src's bytes into dst (two contiguous buffers of one size), stored "
     "around the caches."},
    {"copy_at", copy_at, METH_VARARGS,
     "copy_at(dst_address, src_address, nbytes): copy between two host addresses the "
     "caller vouches for, stored around the caches."},
    {"guarded_copy_runs", guarded_copy_runs, METH_VARARGS,
     "guarded_copy_runs(dsts, dst_offs, srcs, src_offs, lengths) -> int: the runs copied "
     "with memcpy, a run that meets an unreachable page (SIGBUS: a mapped file shrunk under "
     "it) ending the copy, not the process; -1, or the index of that run."},
    {"fence", fence, METH_NOARGS,
     "fence(): a full memory barrier between this thread's stores and its later loads."},
    {"recv_into", recv_into, METH_VARARGS,
     "recv_into(fd, buffer, chunk) -> int: fill buffer from a blocking stream socket, "
     "chunk bytes a call, the GIL released once; the bytes received (fewer: the peer "
     "closed, or an error after some came)."},
    {"spin_recv", spin_recv, METH_VARARGS,
     "spin_recv(fd, buffer, spin_ns) -> int: poll the socket for up to spin_ns, the GIL "
     "released; the bytes received into buffer, 0 when the peer closed, -1 when none came, "
     "-2 when the polling thread was descheduled meanwhile (the CPUs are oversubscribed)."},
    {"populate", populate, METH_VARARGS,
     "populate(buffer, write): fault in every page of the mapping under buffer "
     "(MADV_POPULATE_WRITE, or _READ), the GIL released; OSError as madvise's."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream(void)
{
    return PyModule_Create(&module);
}
