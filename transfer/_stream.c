/* transfer._stream: a host-to-host copy whose stores bypass the CPU caches.
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
#include <stdint.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): src's bytes into dst (two contiguous buffers of one size), stored "
     "around the caches."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream(void)
{
    return PyModule_Create(&module);
}
