/* Positional row reads for the tiered table store (backends/table_store.py).
 *
 * sixfold_gather reads n rows of row_bytes each, row i from byte offsets[i] of fd, into
 * out + i * row_bytes, with one pread per row (or per aligned block span when block > 0,
 * for files opened with O_DIRECT: the span is read into an aligned scratch buffer and the
 * row copied out; consecutive rows inside the last span read are served from it).
 * Returns 0, or -(i + 1) for the first row that failed with *err set to errno (0: end of file).
 * Called through ctypes, which releases the GIL, so several threads read concurrently.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int read_full(int fd, char *buf, int64_t len, int64_t off, int *err) {
    int64_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (r == 0) { *err = 0; return -1; }
        done += r;
    }
    return 0;
}

int64_t sixfold_gather(int fd, const int64_t *offsets, int64_t n, int64_t row_bytes, char *out,
                       int64_t block, int *err) {
    if (block <= 0) {
        for (int64_t i = 0; i < n; i++)
            if (read_full(fd, out + i * row_bytes, row_bytes, offsets[i], err)) return -(i + 1);
        return 0;
    }
    int64_t cap = row_bytes + 2 * block;
    char *scratch = NULL;
    if (posix_memalign((void **)&scratch, (size_t)block, (size_t)cap)) { *err = ENOMEM; return -1; }
    int64_t lo = -1, hi = -1;  /* the span now in scratch */
    for (int64_t i = 0; i < n; i++) {
        int64_t off = offsets[i];
        if (!(off >= lo && off + row_bytes <= hi)) {
            lo = off & ~(block - 1);
            hi = (off + row_bytes + block - 1) & ~(block - 1);
            int64_t len = hi - lo;
            ssize_t r;
            int64_t done = 0;
            while (done < len) {  /* O_DIRECT may return short at end of file */
                r = pread(fd, scratch + done, (size_t)(len - done), (off_t)(lo + done));
                if (r < 0) { if (errno == EINTR) continue; *err = errno; free(scratch); return -(i + 1); }
                if (r == 0) break;
                done += r;
            }
            if (lo + done < off + row_bytes) { *err = 0; free(scratch); return -(i + 1); }
            hi = lo + done;
        }
        memcpy(out + i * row_bytes, scratch + (off - lo), (size_t)row_bytes);
    }
    free(scratch);
    return 0;
}
