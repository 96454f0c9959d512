// Deterministic segment sums for dedup_sum and scatter_add_rows, in the order
// of hpcpax/ops/summation.py, without atomics. After a stable sort of the ids,
// segment s covers sorted positions [starts[s], starts[s+1]) (its rows in
// input order). A segment of at most HP_SUM_CHUNK rows is one chunk: one team
// of lanes sums it, each lane its columns, one row at a time
// (segment_sum_short). A longer one is cut into chunks of HP_SUM_CHUNK rows,
// one team each (segment_chunk_sums), and its chunk sums are combined by the
// fixed tree, one block per segment (segment_tree).
//
// `from_out` selects the op: 0 = dedup_sum (chunk 0 starts from +0, the sum
// goes to out row s); 1 = scatter_add_rows (chunk 0 starts from out row
// out_rows[s], the table row, and the sum replaces it).
#include "hpcpax_common.cuh"

// Heads of the runs of equal ids in a sorted array: flags[k] = 1 where a run starts.
__global__ void mark_segment_heads(const hp_index* __restrict__ sorted_ids,
                                   hp_index n, int* __restrict__ flags) {
    HP_GRID_LOOP(k, n) {
        flags[k] = (k == 0 || sorted_ids[k] != sorted_ids[k - 1]) ? 1 : 0;
    }
}

// Segments of at most HP_SUM_CHUNK rows, one team each; longer ones are skipped.
template <typename T, int VEC>
__global__ void segment_sum_short(const T* __restrict__ values, const hp_index* __restrict__ order,
                                  const hp_index* __restrict__ starts, hp_index n_unique,
                                  hp_index nvec, int group, int from_out,
                                  const hp_index* __restrict__ out_rows, T* __restrict__ out) {
    HP_TEAM_LOOP(s, lane, group, n_unique) {
        const hp_index begin = starts[s];
        const hp_index end = starts[s + 1];
        if (end - begin > HP_SUM_CHUNK) continue;
        T* row = out + (from_out ? out_rows[s] : s) * nvec * VEC;
        for (hp_index j = lane; j < nvec; j += group) {
            const hp_vec<T, VEC> start = from_out ? hp_load<T, VEC>(row, j) : hp_zero<T, VEC>();
            hp_store<T, VEC>(row, j, hp_sequential_sum<T, VEC>(start, values, order, begin, end, nvec, j));
        }
    }
}

// chunk_owner[long_first[i] + c] = i for every chunk c of long segment i
// (long_segments[i]; -1: padding, no chunks); one thread per long segment.
__global__ void long_chunk_map(const hp_index* __restrict__ long_segments,
                               const hp_index* __restrict__ long_first,
                               const hp_index* __restrict__ starts, hp_index n_long,
                               hp_index* __restrict__ chunk_owner) {
    HP_GRID_LOOP(i, n_long) {
        const hp_index s = long_segments[i];
        if (s < 0) continue;
        const hp_index chunks = (starts[s + 1] - starts[s] + HP_SUM_CHUNK - 1) / HP_SUM_CHUNK;
        for (hp_index c = 0; c < chunks; ++c) chunk_owner[long_first[i] + c] = i;
    }
}

// partial[g] = the sum of chunk g (of the long segment chunk_owner[g]; -1:
// no chunk), one team each. Chunk 0 of a scatter starts from the table row.
template <typename T, int VEC>
__global__ void segment_chunk_sums(const T* __restrict__ values, const hp_index* __restrict__ order,
                                   const hp_index* __restrict__ starts,
                                   const hp_index* __restrict__ long_segments,
                                   const hp_index* __restrict__ long_first,
                                   const hp_index* __restrict__ chunk_owner, hp_index max_chunks,
                                   hp_index nvec, int group, int from_out,
                                   const hp_index* __restrict__ out_rows, const T* __restrict__ out,
                                   T* __restrict__ partial) {
    HP_TEAM_LOOP(g, lane, group, max_chunks) {
        const hp_index i = chunk_owner[g];
        if (i < 0) continue;
        const hp_index s = long_segments[i];
        const hp_index c = g - long_first[i];
        const hp_index begin = starts[s] + c * HP_SUM_CHUNK;
        const hp_index stop = starts[s + 1];
        const hp_index end = begin + HP_SUM_CHUNK < stop ? begin + HP_SUM_CHUNK : stop;
        const T* row = out + (from_out ? out_rows[s] : s) * nvec * VEC;
        for (hp_index j = lane; j < nvec; j += group) {
            const hp_vec<T, VEC> start = (from_out && c == 0) ? hp_load<T, VEC>(row, j) : hp_zero<T, VEC>();
            hp_store<T, VEC>(partial + g * nvec * VEC, j,
                             hp_sequential_sum<T, VEC>(start, values, order, begin, end, nvec, j));
        }
    }
}

// The fixed tree over each long segment's chunk sums, one block per segment:
// level stride = 1, 2, 4, ... adds chunk p*2*stride + stride into chunk
// p*2*stride (pairwise left to right, an odd last one carried), then the
// result (chunk 0) goes to out row s (dedup) or out_rows[s] (scatter).
// Entries -1 of long_segments are padding.
template <typename T, int VEC>
__global__ void segment_tree(T* __restrict__ partial, const hp_index* __restrict__ long_segments,
                             const hp_index* __restrict__ long_first,
                             const hp_index* __restrict__ starts, hp_index n_long, hp_index nvec,
                             int from_out, const hp_index* __restrict__ out_rows,
                             T* __restrict__ out) {
    for (hp_index i = blockIdx.x; i < n_long; i += gridDim.x) {
        const hp_index s = long_segments[i];
        if (s < 0) continue;  // padding (the same for the whole block)
        const hp_index chunks = (starts[s + 1] - starts[s] + HP_SUM_CHUNK - 1) / HP_SUM_CHUNK;
        T* first = partial + long_first[i] * nvec * VEC;
        for (hp_index stride = 1; stride < chunks; stride *= 2) {
            const hp_index pairs = (chunks - stride + 2 * stride - 1) / (2 * stride);
            for (hp_index e = threadIdx.x; e < pairs * nvec; e += blockDim.x) {
                const hp_index p = e / nvec;
                const hp_index j = e - p * nvec;
                T* left = first + p * 2 * stride * nvec * VEC;
                hp_vec<T, VEC> a = hp_load<T, VEC>(left, j);
                const hp_vec<T, VEC> b = hp_load<T, VEC>(left + stride * nvec * VEC, j);
#pragma unroll
                for (int q = 0; q < VEC; ++q) a.v[q] += b.v[q];
                hp_store<T, VEC>(left, j, a);
            }
            __syncthreads();  // a level reads what the one before wrote
        }
        T* row = out + (from_out ? out_rows[s] : s) * nvec * VEC;
        for (hp_index j = threadIdx.x; j < nvec; j += blockDim.x) hp_store<T, VEC>(row, j, hp_load<T, VEC>(first, j));
        __syncthreads();
    }
}

#define HP_DEDUP_INSTANTIATE(T, VEC)                                                              \
    template __global__ void segment_sum_short<T, VEC>(const T*, const hp_index*, const hp_index*,  \
                                                       hp_index, hp_index, int, int,               \
                                                       const hp_index*, T*);                       \
    template __global__ void segment_chunk_sums<T, VEC>(const T*, const hp_index*, const hp_index*, \
                                                        const hp_index*, const hp_index*,          \
                                                        const hp_index*, hp_index, hp_index, int,  \
                                                        int, const hp_index*, const T*, T*);       \
    template __global__ void segment_tree<T, VEC>(T*, const hp_index*, const hp_index*,             \
                                                  const hp_index*, hp_index, hp_index, int,         \
                                                  const hp_index*, T*);
HP_FOR_EACH_VEC(HP_DEDUP_INSTANTIATE)
