/* Table-major bag order for the fused host-embedding lookup (backends/bag_order.py).
 *
 * A request's ids arrive sample-major: sample 0's bags for tables 0..T-1, then sample 1's.
 * One embedding_bag call over them visits every table's rows for each sample in turn, so the
 * rows it reads span all tables at once (410 MB for rm2 at 50k rows). sixfold_table_major
 * copies the ids into table-major order (table 0's bags for samples 0..N-1, then table 1's),
 * adding each table's first row in the fused weight on the way, and writes each new bag's
 * first position. The lookup then reads one table's rows at a time. Each bag keeps its ids
 * in their order, so its sum is the same, bit for bit.
 *
 * ids: the batch's ids (sample-major; int64, or int32 for the _i32 variant); starts, lengths: [n * t] each bag's first id and count
 * (sample-major); row_offset: [t]; rows: [sum(lengths)] out; offsets: [n * t] out, in
 * table-major bag order. Called through ctypes, which releases the GIL.
 */
#include <stdint.h>

#define TABLE_MAJOR(NAME, ID_T)                                                                        \
    void NAME(const ID_T *ids, const int64_t *starts, const int64_t *lengths, int64_t n, int64_t t,     \
              const int64_t *row_offset, int64_t *rows, int64_t *offsets) {                             \
        int64_t pos = 0;                                                                               \
        for (int64_t table = 0; table < t; table++) {                                                  \
            const int64_t first_row = row_offset[table];                                               \
            for (int64_t sample = 0; sample < n; sample++) {                                           \
                const int64_t bag = sample * t + table;                                                \
                const ID_T *src = ids + starts[bag];                                                   \
                const int64_t len = lengths[bag];                                                      \
                offsets[table * n + sample] = pos;                                                     \
                for (int64_t k = 0; k < len; k++) rows[pos + k] = (int64_t)src[k] + first_row;         \
                pos += len;                                                                            \
            }                                                                                          \
        }                                                                                              \
    }

TABLE_MAJOR(sixfold_table_major, int64_t)
TABLE_MAJOR(sixfold_table_major_i32, int32_t)
