// A mixture of experts' MLPs for generated tokens on the CPU, as an XLA FFI custom call (engine/models/moe.py).
//
//   x            f32[R, H]     the step's rows
//   pair_expert  i32[P]        pair p is row p / (P / R) with expert pair_expert[p] (this device's index); outside
//                              [0, E): no expert here
//   w_gate, w_up f32[E, H, I]
//   w_down       f32[E, I, H]
// Returns f32[P, H]: each pair's expert output, down(silu(x w_gate) * (x w_up)); zeros for a pair of no expert.
//
// Why it exists: a decode step brings each expert a few rows (64 rows, top-2 of 32 experts: ~4 each). XLA runs an
// expert's matmuls on a slice of the stacked weights, and copies the slice first: at that size the copy cost as much
// as the matmuls. Here each expert's weights are read in place, once for up to kRows of its rows.
//
// Every output element is one chain of fused multiply-adds over the reduction index in order (0, 1, 2, ...),
// starting from 0: a vector lane and the scalar tail compute it the same way, so a pair's bits depend only on its row
// and its expert, never on which other pairs share the expert, the call or the thread, nor on the vector width the
// library was built for.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "work_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 16;  // pairs of one expert per work item: its weights are read once for all of them

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#elif defined(__AVX2__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif
typedef float vf __attribute__((vector_size(kWidth * sizeof(float))));

// Every lane x, written out: a loop of lane stores compiles to one masked broadcast a lane.
inline vf splat(float x) {
#if defined(__AVX512F__)
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif defined(__AVX2__)
  return vf{x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x};
#endif
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a * b + c rounded once (the library is built with -ffp-contract=off: only these multiply-adds are fused).
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#elif defined(__FMA__) && defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  vf r;
  for (int i = 0; i < kWidth; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// out[j, n] = sum over r of a[j][r] * b[r, n], for j < M rows (a[j]: a row of K floats), b [K, N] row-major, out rows
// `stride` apart: each element one chain of multiply-adds over r in order, from 0.
//
// Memory, not arithmetic, bounds it (a decode step reads every chosen expert's weights for a few rows each), so b is
// read along its rows: kDepth of them at a time, each whole, the pass after next's prefetched. (Walking b down a
// block of columns with the sums in registers read a 1024 x 768 expert at 12 GB/s on two Zen 4 cores, a new page
// every row; this reads it at 22.)
template <int M>
void rows_times(const float* const* a, int64_t K, const float* b, int64_t N, float* out, int64_t stride) {
  constexpr int kDepth = 8, kAhead = 2;  // rows of b a pass multiplies in, in order; passes prefetched ahead
  const int64_t vector_cols = N / kWidth * kWidth;
  for (int j = 0; j < M; ++j) std::memset(out + j * stride, 0, sizeof(float) * N);
  int64_t r = 0;
  for (; r + kDepth <= K; r += kDepth) {
    const float* rows = b + r * N;
    for (int64_t n = 0; n < vector_cols; n += kWidth) {
      vf w[kDepth];
      for (int d = 0; d < kDepth; ++d) w[d] = load(rows + d * N + n);
      if (r + (kAhead + 1) * kDepth <= K)
        for (int d = 0; d < kDepth; ++d) __builtin_prefetch(rows + (kAhead * kDepth + d) * N + n);
      for (int j = 0; j < M; ++j) {
        vf acc = load(out + j * stride + n);
        for (int d = 0; d < kDepth; ++d) acc = fma(splat(a[j][r + d]), w[d], acc);
        std::memcpy(out + j * stride + n, &acc, sizeof acc);
      }
    }
  }
  for (; r < K; ++r) {  // the last rows of b, one at a time
    for (int64_t n = 0; n < vector_cols; n += kWidth) {
      const vf w = load(b + r * N + n);
      for (int j = 0; j < M; ++j) {
        vf acc = load(out + j * stride + n);
        acc = fma(splat(a[j][r]), w, acc);
        std::memcpy(out + j * stride + n, &acc, sizeof acc);
      }
    }
  }
  for (int64_t n = vector_cols; n < N; ++n) {  // the columns past the last whole vector: the same chains, one at a time
    for (int j = 0; j < M; ++j) {
      float s = 0.f;
      for (int64_t q = 0; q < K; ++q) s = std::fma(a[j][q], b[q * N + n], s);
      out[j * stride + n] = s;
    }
  }
}

template <int M>
void rows_times_any(int m, const float* const* a, int64_t K, const float* b, int64_t N, float* out, int64_t stride) {
  if constexpr (M > 1) {
    if (m < M) return rows_times_any<M - 1>(m, a, K, b, N, out, stride);
  }
  rows_times<M>(a, K, b, N, out, stride);
}

struct Problem {
  const float *x, *w_gate, *w_up, *w_down;
  float* out;
  int64_t H, I, pairs_per_row;
};

struct Item {
  int32_t expert, count;
  int32_t pairs[kRows];
};

// One item: up to kRows pairs of one expert.
void run_item(const Problem& p, const Item& it) {
  thread_local std::vector<float> gate, up;
  gate.resize(kRows * p.I);
  up.resize(kRows * p.I);
  const float* rows[kRows];
  for (int j = 0; j < it.count; ++j) rows[j] = p.x + (it.pairs[j] / p.pairs_per_row) * p.H;
  const int64_t e = it.expert;
  rows_times_any<kRows>(it.count, rows, p.H, p.w_gate + e * p.H * p.I, p.I, gate.data(), p.I);
  rows_times_any<kRows>(it.count, rows, p.H, p.w_up + e * p.H * p.I, p.I, up.data(), p.I);
  for (int64_t i = 0; i < it.count * p.I; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.f + std::exp(-g)) * up[i];  // silu(g) * u
  }
  const float* hidden[kRows];
  for (int j = 0; j < it.count; ++j) hidden[j] = gate.data() + j * p.I;
  // Each pair's output row, written in place: rows_times writes row j at out + j * stride, so one call per pair
  // would lose the shared pass over the weights; a buffer keeps it.
  thread_local std::vector<float> y;
  y.resize(kRows * p.H);
  rows_times_any<kRows>(it.count, hidden, p.I, p.w_down + e * p.I * p.H, p.H, y.data(), p.H);
  for (int j = 0; j < it.count; ++j)
    std::memcpy(p.out + int64_t{it.pairs[j]} * p.H, y.data() + j * p.H, sizeof(float) * p.H);
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> pair_expert,
                ffi::Buffer<ffi::F32> w_gate, ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::F32> w_down,
                ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), gd = w_gate.dimensions(), ud = w_up.dimensions(), dd = w_down.dimensions();
  if (xd.size() != 2 || pair_expert.dimensions().size() != 1 || gd.size() != 3 || ud.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("bad ranks");
  const int64_t R = xd[0], H = xd[1], P = pair_expert.dimensions()[0], E = gd[0], I = gd[2];
  if (gd[1] != H || ud[0] != E || ud[1] != H || ud[2] != I || dd[0] != E || dd[1] != I || dd[2] != H)
    return ffi::Error::InvalidArgument("x and the expert weights disagree on their sizes");
  if (R == 0 || P % R != 0) return ffi::Error::InvalidArgument("pairs are not a whole number per row");
  std::memset(out->typed_data(), 0, sizeof(float) * P * H);

  // Each expert's pairs in pair order, in items of up to kRows; an expert's items first to last.
  const int32_t* ex = pair_expert.typed_data();
  std::vector<std::vector<int32_t>> by_expert(E);
  for (int64_t q = 0; q < P; ++q)
    if (ex[q] >= 0 && ex[q] < E) by_expert[ex[q]].push_back(static_cast<int32_t>(q));
  const Problem problem{x.typed_data(), w_gate.typed_data(), w_up.typed_data(), w_down.typed_data(),
                        out->typed_data(), H, I, P / R};
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    const auto& pairs = by_expert[e];
    for (size_t first = 0; first < pairs.size(); first += kRows) {
      Item it{static_cast<int32_t>(e), static_cast<int32_t>(std::min<size_t>(kRows, pairs.size() - first)), {}};
      std::copy_n(pairs.begin() + first, it.count, it.pairs);
      items.push_back(it);
    }
  }
  const size_t n = items.size();
  pagefleet::run_items(pool, n, [problem, items = std::move(items)](size_t i) { run_item(problem, items[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagefleetMoeExpertsF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
