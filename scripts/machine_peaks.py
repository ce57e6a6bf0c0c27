"""This machine's two ceilings for decoding: memory read bandwidth and the int8 dot-product peak.

A token's forward reads every weight once, so plain decode is bound by how fast memory streams;
a tree's extra rows reuse those weights, so they are bound by the int8 arithmetic the engine's
kernels run on (VNNI's `vpdpbusd` where the CPU has it, AVX2's `vpmaddubsw` chain otherwise).
Both probes run on the threads asked for, as the engine does:

- bandwidth: each thread sums its share of a buffer far larger than the last-level cache
  (best of several passes, GB/s);
- int8 peak: each thread runs chains of independent u8 x s8 dot-product instructions that never
  touch memory (GOPS, counting a multiply and an add as two operations, as FLOPs are counted).

    python scripts/machine_peaks.py --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { const uint8_t *data; size_t bytes; long iters; int64_t out; } Job;

static void *sum_bytes(void *p) {
    Job *job = p;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    for (size_t i = 0; i + 64 <= job->bytes; i += 64) {
        acc0 = _mm256_add_epi64(acc0, _mm256_load_si256((const __m256i *)(job->data + i)));
        acc1 = _mm256_add_epi64(acc1, _mm256_load_si256((const __m256i *)(job->data + i + 32)));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(acc0, acc1));
    job->out = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return NULL;
}

/* Eight independent accumulators hide the instruction's latency; the result is kept so that the
   compiler cannot drop the loop. */
static void *dot_chain(void *p) {
    Job *job = p;
#if defined(__AVX512VNNI__)
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (long i = 0; i < job->iters; i++) {
        c0 = _mm512_dpbusd_epi32(c0, a, b); c1 = _mm512_dpbusd_epi32(c1, a, b);
        c2 = _mm512_dpbusd_epi32(c2, a, b); c3 = _mm512_dpbusd_epi32(c3, a, b);
        c4 = _mm512_dpbusd_epi32(c4, a, b); c5 = _mm512_dpbusd_epi32(c5, a, b);
        c6 = _mm512_dpbusd_epi32(c6, a, b); c7 = _mm512_dpbusd_epi32(c7, a, b);
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    job->out = _mm512_reduce_add_epi32(s);
#else
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
#define STEP(c) c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
    for (long i = 0; i < job->iters; i++) {
        STEP(c0); STEP(c1); STEP(c2); STEP(c3); STEP(c4); STEP(c5); STEP(c6); STEP(c7);
        __asm__ volatile("" : "+x"(a));
    }
#undef STEP
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, s);
    job->out = lanes[0];
#endif
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double run(void *(*fn)(void *), Job *jobs, int threads) {
    pthread_t tid[64];
    double start = now();
    for (int t = 0; t < threads; t++) pthread_create(&tid[t], NULL, fn, &jobs[t]);
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    return now() - start;
}

/* Bytes a second over `passes`, best pass; the buffer is written first so that every page is
   resident. */
double probe_bandwidth(size_t bytes, int threads, int passes) {
    uint8_t *data = aligned_alloc(2 << 20, bytes);
    memset(data, 1, bytes);
    Job jobs[64];
    size_t share = bytes / threads / 64 * 64;
    for (int t = 0; t < threads; t++) jobs[t] = (Job){data + t * share, share, 0, 0};
    double best = 1e30;
    for (int p = 0; p < passes; p++) { double s = run(sum_bytes, jobs, threads); if (s < best) best = s; }
    free(data);
    return (double)share * threads / best;
}

/* int8 operations a second: one 512-bit vpdpbusd is 16 four-way u8 x s8 dot products, that is
   64 multiplies and 64 adds; one step of AVX2's three-instruction chain covers 32 bytes: 64. */
double probe_int8(long iters, int threads, int passes) {
    Job jobs[64];
    for (int t = 0; t < threads; t++) jobs[t] = (Job){NULL, 0, iters, 0};
    double best = 1e30;
    for (int p = 0; p < passes; p++) { double s = run(dot_chain, jobs, threads); if (s < best) best = s; }
#if defined(__AVX512VNNI__)
    double ops = 8.0 * 128;
#else
    double ops = 8.0 * 64;
#endif
    return ops * iters * threads / best;
}

int probe_isa(void) {
#if defined(__AVX512VNNI__)
    return 512;
#else
    return 256;
#endif
}
"""


def build() -> ctypes.CDLL:
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"machine-peaks-{digest}.so"
    if not out.exists():
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
            f.write(SOURCE)
        subprocess.run(["cc", "-O2", "-march=native", "-shared", "-fPIC", "-pthread", f.name, "-o", str(out)],
                       check=True)
    lib = ctypes.CDLL(str(out))
    lib.probe_bandwidth.restype = ctypes.c_double
    lib.probe_bandwidth.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    lib.probe_int8.restype = ctypes.c_double
    lib.probe_int8.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    return lib


def measure(threads: int, buffer_gib: float = 2.0) -> dict:
    """{"bandwidth_gbs", "int8_gops", "int8_width"}: this machine's read bandwidth and int8 peak."""
    lib = build()
    return {"threads": threads,
            "bandwidth_gbs": round(lib.probe_bandwidth(int(buffer_gib * 2**30), threads, 5) / 1e9, 1),
            "int8_gops": round(lib.probe_int8(20_000_000, threads, 3) / 1e9, 0),
            "int8_width": lib.probe_isa()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--buffer-gib", type=float, default=2.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.threads, args.buffer_gib)))


if __name__ == "__main__":
    main()
