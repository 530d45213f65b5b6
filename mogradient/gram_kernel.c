/* Gram matrix of a float32 gradient stack in one read of the stack.
 *
 * Why not a BLAS call: for K x D stacks with K of a few and D in the millions, the GEMM
 * has a K x K output and nothing to reuse; measured on a 2-core AMD EPYC, MKL's batched
 * 5 x 16384 by 16384 x 5 products reach ~12 GFMA/s per core, 2.5x the time of one read of
 * the stack, where this loop takes ~1.4x (it is bound by memory bandwidth).
 *
 * Columns [begin, end) are cut into chunks small enough for the K rows to stay in L1.
 * Within a chunk every pair (i <= j) is summed in float32 over 32 interleaved lanes
 * (so each lane adds at most chunk / 32 products); the chunk's pair sums are added in
 * float64. Only the upper triangle (i <= j) of each K x K output is filled.
 *
 * Built with -fopenmp, the parts run on OpenMP threads. Loaded after torch, the library's
 * libgomp.so.1 resolves to the one torch already loaded, so both share one thread pool
 * (a second pool's threads would compete with torch's spin-waiting ones).
 */
#include <stdint.h>

typedef float float8 __attribute__((vector_size(32), aligned(4)));

static double pair_sum(const float *a, const float *b, int64_t start, int64_t stop) {
    int64_t vector_stop = start + (stop - start) / 32 * 32;
    float8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t c = start; c < vector_stop; c += 32) {
        s0 += *(const float8 *)(a + c) * *(const float8 *)(b + c);
        s1 += *(const float8 *)(a + c + 8) * *(const float8 *)(b + c + 8);
        s2 += *(const float8 *)(a + c + 16) * *(const float8 *)(b + c + 16);
        s3 += *(const float8 *)(a + c + 24) * *(const float8 *)(b + c + 24);
    }
    float8 lanes = (s0 + s1) + (s2 + s3);
    double sum = 0.0;
    for (int lane = 0; lane < 8; lane++) sum += lanes[lane];
    for (int64_t c = vector_stop; c < stop; c++) sum += (double)a[c] * (double)b[c];
    return sum;
}

static void gram_range(const float *rows, int64_t k, int64_t row_stride, int64_t begin,
                       int64_t end, int64_t chunk, double *out) {
    for (int64_t index = 0; index < k * k; index++) out[index] = 0.0;
    for (int64_t start = begin; start < end; start += chunk) {
        int64_t stop = start + chunk < end ? start + chunk : end;
        for (int64_t i = 0; i < k; i++) {
            for (int64_t j = i; j < k; j++) {
                out[i * k + j] += pair_sum(rows + i * row_stride, rows + j * row_stride,
                                           start, stop);
            }
        }
    }
}

/* Part p of `parts` sums columns [dim * p / parts, dim * (p + 1) / parts) (cut at multiples
 * of 32) into partials[p * k * k ...]: the result depends on `parts`, not on scheduling. */
void gram_float32(const float *rows, int64_t k, int64_t row_stride, int64_t dim,
                  int64_t chunk, int64_t parts, double *partials) {
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t part = 0; part < parts; part++) {
        int64_t begin = dim * part / parts / 32 * 32;
        int64_t end = part + 1 == parts ? dim : dim * (part + 1) / parts / 32 * 32;
        gram_range(rows, k, row_stride, begin, end, chunk, partials + part * k * k);
    }
}
