// Ragged paged attention for the CPU, as an XLA FFI custom call (see engine/cpu_attention.py).
//
// Same inputs, layout and result as engine.attention.reference_ragged_paged_attention:
//   q            f32[T, H, D]            new tokens of all sequences, concatenated
//   kv_pages     f32[P, page, 2*KVH, D]  K and V interleaved per KV head (k0 v0 k1 v1 ...)
//   kv_lens      i32[S]                  tokens in each sequence's cache, this step's included
//   page_indices i32[S, pages_per_seq]
//   cu_q_lens    i32[S + 1]              sequence s owns q rows cu_q_lens[s]:cu_q_lens[s+1]
//   num_seqs     i32[1]
// Returns f32[T, H, D]; rows of no sequence are zero. Query head h reads KV head h / (H / KVH); a query
// at position p sees cached positions k <= p (and p - k < window when window > 0). With soft_cap C > 0
// (Gemma 2's attention logit soft-capping) each score s becomes C * tanh(s / C) before the mask, as in
// the reference; both paths below call the one out-of-line `soft_cap_scores`, so a row's bits do not
// depend on the path its item takes.
//
// Why it exists: the plain-JAX reference must gather every KV block into a dense copy before XLA can
// multiply it, and on a CPU that copy (plus tiny batched matmuls) was most of a step. Here each work item
// (a sequence's up-to-kRowsPerItem query tokens, with one KV head or, for a decoding sequence, all of
// them) reads its pages in place, page by page, with an online softmax: nothing is materialised.
//
// A score (q . k for one query row and one key) is summed in one fixed order in every path, so that a row
// gets the same bits whichever path its item takes (a prompt's row in a long chunk, the same row alone when
// a sequence is recomputed after preemption): 16 partial sums, partial l adding q[d] * k[d] for
// d = l, l + 16, l + 32, ... in order with fused multiply-adds (columns past head_dim count as 0 * 0), then
// a tree: l + (l + 8) for l < 8, then + 4, + 2, + 1. The all-heads path reduces 16 keys' partial-sum
// vectors together with shuffles (reduce16; scores8 with AVX registers), reading each key's K row as it lies
// in the page; run_lanes keeps one accumulator per partial sum with query rows in the lanes (16 with AVX-512,
// 8 with AVX2). The vector paths are tested against the same source built with no AVX at all, where every
// multiply-add is std::fma and every tree is summed in plain C++ (tests/engine/kernels/test_cpu_kernel_isa.py).
//
// On a CPU with AVX2 but no AVX-512 (16 vector registers of 8 floats), every loop keeps its live vectors
// within 16 registers: a 16-lane vector there is two registers, and loops sized for AVX-512's 32 spilled to
// the stack on every multiply-add (prefill attention ran at about 8 GFLOP/s on two AMD EPYC cores; now ~45).
// There, with two loads a cycle, the loops are limited by their loads as much as by their multiply-adds: P times
// V keeps each key's probabilities in registers (fma_regs), a prompt's rows move into lanes by 8 x 8 transposes,
// and a page that every row sees whole skips the softmax's masks (~70 GFLOP/s on the same cores, same bits).
//
// Decoding sequences whose first pages are the same physical pages (a prefix cache hit: a few-shot block, the n
// samples of one prompt) walk those pages together, in shared items: the rows of several sequences in vector lanes
// (run_lanes), each page read once for all of them instead of once per sequence, each row's softmax state kept;
// each sequence's own item then walks the rest of its pages from that state (share_groups). A row's steps are the
// same as when it walks its pages alone, page by page in the same order, so its bits are too.
//
// Each query row's arithmetic depends only on its own sequence's chunk (its q rows, pages and positions),
// never on which other sequences share the call or where they sit: results are bit-identical whatever
// else is in the step. (How a prompt is cut into chunks can change the rounding, as it changes the
// matmul shapes elsewhere in the step.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "work_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowsPerItem = 16;  // query tokens per work item: a page of K/V is reused this many times
constexpr int kMinLaneRows = 8;   // items with at least this many (token, head) rows put rows in vector lanes
constexpr float kMasked = -1e30f;  // as in the reference: finite, so an all-masked page gives no inf - inf

struct Problem {
  const float* q;
  const float* kv;
  const int32_t* kv_lens;
  const int32_t* pages;
  const int32_t* cu;
  float* out;
  int64_t num_heads, head_dim, page_size, num_kv_heads, pages_per_seq;
  float scale;
  int32_t window;  // <= 0: none
  float soft_cap;  // <= 0: none
};

struct Item {
  int32_t seq, kv_head, row_begin, row_end;  // rows: global q rows; kv_head < 0: every head
  int64_t cost;
  // A decoding row whose first pages it shares with other sequences (the same physical pages, as a prefix cache
  // hit leaves them) walks those pages with theirs first, in a shared item (group >= 0: seq is then the group,
  // rows its (member, head in KV group) rows), which keeps each row's softmax state; its own item then starts at
  // page done_pages from that state (`state`: its head 0's, state_floats(D) floats a head). See share_groups.
  int32_t group = -1, done_pages = 0;
  float* state = nullptr;
};

// One query row's online softmax between pages: running max, running sum, then the unnormalised output.
inline int64_t state_floats(int64_t head_dim) { return 2 + head_dim; }

// 16 query rows as the lanes of one vector (GCC vector extensions: AVX-512 registers where the CPU has
// them, pairs of AVX registers otherwise).
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

// run_lanes keeps query rows in the lanes of one register: 16 with AVX-512, 8 otherwise (a 16-lane vector
// is two AVX registers there, and the score loop's accumulators would no longer fit the 16 it has). Each
// lane's arithmetic is the same whatever the width, so the width changes no bits.
#if defined(__AVX512F__)
constexpr int kRowLanes = 16;
#else
constexpr int kRowLanes = 8;
#endif
typedef float rf __attribute__((vector_size(kRowLanes * sizeof(float))));
typedef int32_t ri __attribute__((vector_size(kRowLanes * sizeof(int32_t))));

template <class V>
struct Lanes {
  static constexpr int n = sizeof(V) / sizeof(float);
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
};

// Every lane x (a broadcast; `vf{} + x` would be 0.0f + x, an add the compiler must keep for x = -0.0f).
// (Written out: a loop of lane stores compiles to inserts, not to one broadcast.)
template <class V>
inline V splat_as(float x) {
  static_assert(Lanes<V>::n == 8 || Lanes<V>::n == 16);
  if constexpr (Lanes<V>::n == 8) return V{x, x, x, x, x, x, x, x};
  else return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
inline vf splat(float x) { return splat_as<vf>(x); }

// a * b + c rounded once. The kernel is built with -ffp-contract=off, so that the compiler never fuses a
// multiply-add in one path and not in another (a row must get the same bits whichever path its item takes);
// the multiply-adds of the dot products are fused here explicitly, the same way in every path.
template <class V>
inline V fma(V a, V b, V c) {
  constexpr int n = Lanes<V>::n;
#if defined(__AVX512F__)
  if constexpr (n == 16)
    return reinterpret_cast<V>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#endif
#if defined(__FMA__)
  if constexpr (n == 8) {
    return reinterpret_cast<V>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
  } else if constexpr (n == 16) {
    typedef float half_vf __attribute__((vector_size(8 * sizeof(float))));
    struct Halves { half_vf lo, hi; };
    const Halves x = reinterpret_cast<const Halves&>(a), y = reinterpret_cast<const Halves&>(b),
                 z = reinterpret_cast<const Halves&>(c);
    Halves r{fma(x.lo, y.lo, z.lo), fma(x.hi, y.hi, z.hi)};
    return reinterpret_cast<const V&>(r);
  }
#endif
  V r;
  for (int i = 0; i < n; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
// fma with every operand in a register, for an operand reused by several multiply-adds: GCC folds such a load into
// each multiply-add that reads it. P times V (two groups, 4 columns) then made 12 loads per 8 multiply-adds, and
// with AVX's two loads a cycle it waited on them; in registers, 6. The same instruction, so the same bits.
inline rf fma_regs(rf a, rf b, rf c) {
#if defined(__FMA__) && !defined(__AVX512F__)
  asm("vfmadd231ps %2, %1, %0" : "+x"(c) : "x"(a), "x"(b));
  return c;
#else
  return fma(a, b, c);
#endif
}
template <class I = ri>
inline I splat_ri(int32_t x) {  // (a broadcast)
  if constexpr (sizeof(I) == 8 * sizeof(int32_t)) return I{x, x, x, x, x, x, x, x};
  else return I{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

// C * tanh(s / C) lane by lane (the reference's order: divide, tanh, multiply). Out of line, so that both
// paths run the same instructions whatever the compiler would do with it inlined.
__attribute__((noinline)) float soft_cap_score(float s, float cap) { return cap * std::tanh(s / cap); }
template <class V>
V soft_cap_scores(V s, float cap) {
  for (int i = 0; i < Lanes<V>::n; ++i) s[i] = soft_cap_score(s[i], cap);
  return s;
}

// The score tree's last steps (see the top): partial sums P[0..15] of one score per lane -> the score.
inline vf tree16(vf* P) {
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) P[l] = P[l] + P[l + 8];
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) P[l] = P[l] + P[l + 4];
  P[0] = P[0] + P[2];
  P[1] = P[1] + P[3];
  return P[0] + P[1];
}

// reduce16 puts slot s's score in lane slot_lane(s); the all-heads path feeds slot s the key that lane
// should hold, slot_lane(s) (the map is its own inverse: a 4 x 4 transpose).
constexpr int slot_lane(int s) { return 4 * (s % 4) + s / 4; }

// 16 keys' partial sums (P[s]: slot s's 16 partial sums) -> one vector of 16 scores, each summed as
// tree16 sums it: lane slot_lane(s) holds slot s's score.
inline vf reduce16(const vf* P) {
#if defined(__AVX512F__)
  const auto m = [](vf x) { return reinterpret_cast<__m512>(x); };
  __m512 r[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // [a0-7 + a8-15, b0-7 + b8-15]: l + (l + 8)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(m(P[2 * i]), m(P[2 * i + 1]), _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(m(P[2 * i]), m(P[2 * i + 1]), _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // four slots' 4 sums, one slot per 128-bit chunk: + 4
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // + 2, within each chunk
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 out = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                                   _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return reinterpret_cast<const vf&>(out);
#else
  vf out;
  for (int s = 0; s < kLanes; ++s) {
    vf part[kLanes];
    for (int l = 0; l < kLanes; ++l) part[l] = splat(P[s][l]);
    out[slot_lane(s)] = tree16(part)[0];
  }
  return out;
#endif
}

// 16 floats from p; with valid < 16, those past `valid` read as 0 (and are not touched in memory).
inline vf load16(const float* p, int64_t valid) {
  vf x;
  if (valid >= kLanes) {
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
#if defined(__AVX512F__)
  const __m512 y = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1u), p);
  return reinterpret_cast<const vf&>(y);
#else
  x = vf{};
  for (int64_t l = 0; l < valid; ++l) x[l] = p[l];
  return x;
#endif
}

#if defined(__FMA__) && !defined(__AVX512F__)
// reduce16's sums with AVX registers, 8 keys at a time, key c's score in lane c (k[c]: its K row for this
// query head; qv: the query's 16-column blocks). Each key's two halves of partial sums are added as soon as
// they are done (l + (l + 8)), then the tree's + 4, + 2 and + 1 run across keys with shuffles, so the live
// registers stay within AVX's 16 (reduce16's generic form, used without AVX, extracts one lane at a time).
inline __m256 key_pairs(const vf* qv, int64_t blocks, const float* k, int64_t D) {  // l + (l + 8), l < 8
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const vf kb = load16(k + b * kLanes, D - b * kLanes);
    __m256 q2[2], k2[2];
    std::memcpy(q2, &qv[b], sizeof(q2));
    std::memcpy(k2, &kb, sizeof(k2));
    lo = _mm256_fmadd_ps(q2[0], k2[0], lo);
    hi = _mm256_fmadd_ps(q2[1], k2[1], hi);
  }
  return _mm256_add_ps(lo, hi);
}
inline __m256 plus4(__m256 a, __m256 b) {  // [a_l + a_(l+4), b_l + b_(l+4)], l < 4
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256 plus2(__m256 x, __m256 y) {  // per 128 bits: [x_0 + x_2, x_1 + x_3, y_0 + y_2, y_1 + y_3]
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m256 plus1(__m256 z, __m256 w) {  // per 128 bits: [z_0 + z_1, z_2 + z_3, w_0 + w_1, w_2 + w_3]
  return _mm256_add_ps(_mm256_shuffle_ps(z, w, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(z, w, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m256 scores8(const vf* qv, int64_t blocks, const float* const* k, int64_t D) {
  // plus4 of keys (c, c + 4) puts them in the two 128-bit halves; plus2 of (0, 4) with (1, 5) gives
  // [0 0 1 1 | 4 4 5 5], of (2, 6) with (3, 7) [2 2 3 3 | 6 6 7 7]; plus1 of the two: [0 1 2 3 | 4 5 6 7].
  const __m256 z = plus2(plus4(key_pairs(qv, blocks, k[0], D), key_pairs(qv, blocks, k[4], D)),
                         plus4(key_pairs(qv, blocks, k[1], D), key_pairs(qv, blocks, k[5], D)));
  const __m256 w = plus2(plus4(key_pairs(qv, blocks, k[2], D), key_pairs(qv, blocks, k[6], D)),
                         plus4(key_pairs(qv, blocks, k[3], D), key_pairs(qv, blocks, k[7], D)));
  return plus1(z, w);
}
#endif

// exp(x) lane by lane: Cephes' single-precision polynomial (about 1 ulp), x clamped to [-87.3, 88.3].
template <class V>
inline V vexp(V x) {
  typedef typename Lanes<V>::I I;
  x = x < splat_as<V>(-87.3f) ? splat_as<V>(-87.3f) : x;
  x = x > splat_as<V>(88.3f) ? splat_as<V>(88.3f) : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  V n;  // floor(fx): truncated, less one where that rounded up (the round instruction gives the same value)
#if defined(__AVX512F__)
  if constexpr (Lanes<V>::n == 16) {
    const __m512 f = _mm512_roundscale_ps(reinterpret_cast<__m512>(fx), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    n = reinterpret_cast<const V&>(f);
  } else
#endif
#if defined(__AVX__)
  if constexpr (Lanes<V>::n == 8) {
    const __m256 f = _mm256_floor_ps(reinterpret_cast<__m256>(fx));
    n = reinterpret_cast<const V&>(f);
  } else
#endif
  {
    n = __builtin_convertvector(__builtin_convertvector(fx, I), V);
    n = n > fx ? n - 1.f : n;
  }
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  V y = splat_as<V>(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return y * reinterpret_cast<const V&>(e);
}

// Keeps v in a register where it is read: GCC would otherwise fold its load into each multiply-add that reads it
// (one more load per multiply-add, and the loops here are limited by their loads). No arithmetic changes.
template <class V>
inline void in_register(V& v) {
#if defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// Scores of keys ka and kb (K rows of one head) for the rows in lanes (qt[d]: column d of the rows' q, zero
// past D), each summed in the fixed order (see the top), with 16 lanes: the partial sums are taken in two
// halves, l in {0-3, 8-11} then {4-7, 12-15}, so that each half's l + (l + 8) sums can be added before the
// next half starts: 16 accumulators, 8 kept sums and a q column fit AVX-512's 32 registers.
template <int kHeadDim>
inline void scores2(const rf* qt, const float* ka, const float* kb, int64_t head_dim, rf* out_a, rf* out_b) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;  // a constant where the head size is compiled in
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;
  rf sa[4], sb[4];
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    rf pa[8] = {}, pb[8] = {};
    for (int64_t d0 = 0; d0 < D16; d0 += kLanes) {
      const bool whole = d0 + kLanes <= D;
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const int64_t d = d0 + half * 4 + (u < 4 ? u : u + 4);
        const rf qd = qt[d];
        pa[u] = fma(qd, splat_as<rf>(whole || d < D ? ka[d] : 0.f), pa[u]);
        pb[u] = fma(qd, splat_as<rf>(whole || d < D ? kb[d] : 0.f), pb[u]);
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {  // l + (l + 8); then, after the second half, + 4
      sa[u] = half == 0 ? pa[u] + pa[u + 4] : sa[u] + (pa[u] + pa[u + 4]);
      sb[u] = half == 0 ? pb[u] + pb[u + 4] : sb[u] + (pb[u] + pb[u + 4]);
    }
  }
  *out_a = (sa[0] + sa[2]) + (sa[1] + sa[3]);
  *out_b = (sb[0] + sb[2]) + (sb[1] + sb[3]);
}

// The same scores for three keys at a time, for AVX's 16 registers: a quarter of each key's partial sums at a
// time, l in {u, u + 8, u + 4, u + 12} for u = 0..3, which is what one of the tree's four sums after + 4
// needs ((l + (l + 8)) + ((l + 4) + (l + 12))): 12 accumulators, a q column and a broadcast K element.
template <int kHeadDim>
inline void scores3(const rf* qt, const float* const* k, int64_t head_dim, rf* out) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;  // as in scores2
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;
  constexpr int kQuarter[4] = {0, 8, 4, 12};
  rf sq[3][4];
#pragma GCC unroll 1
  for (int u = 0; u < 4; ++u) {
    rf a[3][4] = {};
    for (int64_t d0 = 0; d0 < D16; d0 += kLanes) {
      const bool whole = d0 + kLanes <= D;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int64_t d = d0 + u + kQuarter[i];
        rf qd = qt[d];
        in_register(qd);
#pragma GCC unroll 3
        for (int j = 0; j < 3; ++j) a[j][i] = fma(qd, splat_as<rf>(whole || d < D ? k[j][d] : 0.f), a[j][i]);
      }
    }
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) sq[j][u] = (a[j][0] + a[j][1]) + (a[j][2] + a[j][3]);
  }
#pragma GCC unroll 3
  for (int j = 0; j < 3; ++j) out[j] = (sq[j][0] + sq[j][2]) + (sq[j][1] + sq[j][3]);
}

// The lowest and highest position of a group's rows (pos: kRowLanes of them), for page_softmax.
struct PosRange {
  int32_t lo, hi;
};
inline PosRange pos_range(const int32_t* pos) {
  PosRange r{pos[0], pos[0]};
  for (int k = 1; k < kRowLanes; ++k) r.lo = std::min(r.lo, pos[k]), r.hi = std::max(r.hi, pos[k]);
  return r;
}

// One page's step of the online softmax for kRowLanes rows in vector lanes (run_lanes, and the all-heads path's
// row groups): key j's scores for the rows lie at s[j * kRowLanes]; they are soft-capped and masked (keys after a
// row's position or outside its window) in place, then replaced by their probabilities exp(score - max) (0 where
// masked), summed in key order. The rows' running max `m` and sum `l` move on; returns the factor that rescales
// what the rows summed before this page.
// `rows`: the range of `pos`. A page that every row sees whole (all its keys at or before each row's position, and
// inside its window) is not masked: its masks would select every lane. Padding rows (position -1) keep the masks.
inline rf page_softmax(const Problem& p, float* s, int32_t n, int32_t t0, ri pos, PosRange rows, rf& m, rf& l) {
  auto visible = [&](int32_t j) {
    const ri key = splat_ri(t0 + j);
    ri seen = key <= pos;
    if (p.window > 0) seen &= (pos - key) < splat_ri(p.window);
    return seen;
  };
  const bool whole = t0 + n - 1 <= rows.lo && (p.window <= 0 || rows.hi - t0 < p.window);
  rf mx = m;
  auto max_pass = [&](auto masked) {
    for (int32_t j = 0; j < n; ++j) {
      rf v;
      std::memcpy(&v, &s[j * kRowLanes], sizeof(v));
      if (p.soft_cap > 0.f) v = soft_cap_scores(v, p.soft_cap);
      if constexpr (decltype(masked)::value) v = visible(j) ? v : splat_as<rf>(kMasked);
      std::memcpy(&s[j * kRowLanes], &v, sizeof(v));
      mx = mx > v ? mx : v;
    }
  };
  if (whole) max_pass(std::false_type{});
  else max_pass(std::true_type{});
  const rf alpha = vexp(m - mx);
  rf sum = rf{};
  auto exp_pass = [&](auto masked) {
    for (int32_t j = 0; j < n; ++j) {
      rf v;
      std::memcpy(&v, &s[j * kRowLanes], sizeof(v));
      if constexpr (decltype(masked)::value) v = visible(j) ? vexp(v - mx) : rf{};
      else v = vexp(v - mx);
      std::memcpy(&s[j * kRowLanes], &v, sizeof(v));
      sum = sum + v;
    }
  };
  if (whole) exp_pass(std::false_type{});
  else exp_pass(std::true_type{});
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

// One column d of the scores of keys ka and kb for two groups of rows (q0, q1: their q column d): the four
// multiply-adds into the partial sums a (group 0 key a, group 0 key b, group 1 key a, group 1 key b). `valid`: d < D
// (past it the K element is 0, as q is).
inline void fma2x2(rf q0, rf q1, const float* ka, const float* kb, int64_t d, bool valid, rf& a0, rf& a1, rf& a2,
                   rf& a3) {
  const rf x = splat_as<rf>(valid ? ka[d] : 0.f), y = splat_as<rf>(valid ? kb[d] : 0.f);
  a0 = fma(q0, x, a0);
  a1 = fma(q0, y, a1);
  a2 = fma(q1, x, a2);
  a3 = fma(q1, y, a3);
}

// Quarter qi's sum T4 (qi-th of the order 0, 2, 1, 3) into the two halves of a score's tree: T4[0] + T4[2] in s02,
// T4[1] + T4[3] in s13.
inline void add_quarter(int qi, rf t4, rf& s02, rf& s13) {
  if (qi == 0) s02 = t4;
  else if (qi == 1) s02 = s02 + t4;
  else if (qi == 2) s13 = t4;
  else s13 = s13 + t4;
}

// The scores of keys ka and kb for two groups of rows in lanes (qt0, qt1), in the fixed order (see the top), for
// AVX-512's 32 registers: a quarter of each score's partial sums at a time, l in {u, u + 8, u + 4, u + 12} (as
// scores3), which gives one of the tree's four sums after + 4, T4[u] = (P[u] + P[u + 8]) + (P[u + 4] + P[u + 12]);
// quarters in the order 0, 2, 1, 3, so that T4[0] + T4[2] and T4[1] + T4[3] are summed as they come, and the score
// is their sum, as scores2's. Each K element broadcast serves both groups: a load per multiply-add (scores2: 1.5).
template <int kHeadDim>
inline void scores2x2(const rf* qt0, const rf* qt1, const float* ka, const float* kb, int64_t head_dim, rf* out) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;  // as in scores2
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;
  constexpr int kQuarter[4] = {0, 8, 4, 12}, kOrder[4] = {0, 2, 1, 3};
  rf s02[4], s13[4];  // per (group, key): T4[0] + T4[2], T4[1] + T4[3]
#pragma GCC unroll 1
  for (int qi = 0; qi < 4; ++qi) {
    const int u = kOrder[qi];
    rf a[4][4] = {};  // [(group, key)][i]: partial sum u + kQuarter[i]
    for (int64_t d0 = 0; d0 < D16; d0 += kLanes) {
      const bool whole = d0 + kLanes <= D;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int64_t d = d0 + u + kQuarter[i];
        fma2x2(qt0[d], qt1[d], ka, kb, d, whole || d < D, a[0][i], a[1][i], a[2][i], a[3][i]);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      add_quarter(qi, (a[c][0] + a[c][1]) + (a[c][2] + a[c][3]), s02[c], s13[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) out[c] = s02[c] + s13[c];
}

// scores2x2 for two groups of 8 lanes (AVX's 16 registers): an eighth of each score's partial sums at a time,
// l in {u + a, u + a + 8}, which gives P[u + a] + P[u + a + 8]; a = 0 then 4 make T4[u], and the quarters come in
// scores2x2's order, so every score is summed in the same tree. Each K element broadcast serves both groups (scores3:
// one row group, a broadcast per multiply-add; on Zen 3 a broadcast from memory costs a fifth of a multiply-add's
// slot).
template <int kHeadDim>
inline void scores2x2_eighths(const rf* qt0, const rf* qt1, const float* ka, const float* kb, int64_t head_dim,
                              rf* out) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;  // as in scores2
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;
  constexpr int kOrder[4] = {0, 2, 1, 3};
  rf s02[4], s13[4], t2[4];  // per (group, key): as scores2x2's; t2: P[u] + P[u + 8]
#pragma GCC unroll 1
  for (int qi = 0; qi < 4; ++qi) {
    const int u = kOrder[qi];
#pragma GCC unroll 1
    for (int a = 0; a <= 4; a += 4) {
      rf acc[4][2] = {};  // [(group, key)][i]: partial sum u + a + 8 i
      for (int64_t d0 = 0; d0 < D16; d0 += kLanes) {
        const bool whole = d0 + kLanes <= D;
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {
          const int64_t d = d0 + u + a + 8 * i;
          rf q0 = qt0[d], q1 = qt1[d];
          in_register(q0);
          in_register(q1);
          fma2x2(q0, q1, ka, kb, d, whole || d < D, acc[0][i], acc[1][i], acc[2][i], acc[3][i]);
        }
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const rf t = acc[c][0] + acc[c][1];
        if (a == 0) {
          t2[c] = t;
          continue;
        }
        add_quarter(qi, t2[c] + t, s02[c], s13[c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) out[c] = s02[c] + s13[c];
}

// A group's rows' q into lanes: lane k of qt[d] = q[k][d] * scale, d < D (nullptr: a padding row, zeros). With 8
// lanes and AVX, 8 x 8 blocks are transposed in registers: storing lane by lane left each column's vector load
// waiting on 8 stores.
inline void q_to_lanes(const float* const* q, float scale, int64_t D, rf* qt) {
  int64_t d0 = 0;
  if constexpr (kRowLanes == 8) {
#if defined(__AVX__)
    const __m256 zero = _mm256_setzero_ps();
    for (; d0 + 8 <= D; d0 += 8) {
      __m256 r[8], t[8];
      for (int k = 0; k < 8; ++k) r[k] = q[k] ? _mm256_loadu_ps(q[k] + d0) : zero;
      for (int k = 0; k < 8; k += 2) {  // rows k, k + 1 interleaved: [k0 k+1_0 k1 k+1_1 | k4 ...], [k2 ... | k6 ...]
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
      }
      for (int k = 0; k < 8; k += 4) {  // rows k .. k + 3 of columns (0, 4), (1, 5), (2, 6), (3, 7)
        r[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int c = 0; c < 4; ++c) {  // columns c and c + 4 of all 8 rows
        const __m256 lo = _mm256_permute2f128_ps(r[c], r[c + 4], 0x20);
        const __m256 hi = _mm256_permute2f128_ps(r[c], r[c + 4], 0x31);
        qt[d0 + c] = reinterpret_cast<const rf&>(lo) * scale;
        qt[d0 + c + 4] = reinterpret_cast<const rf&>(hi) * scale;
      }
    }
#endif
  }
  for (; d0 < D; ++d0)
    for (int k = 0; k < kRowLanes; ++k) qt[d0][k] = q[k] ? q[k][d0] * scale : 0.f;
}

// Query rows of one KV head in vector lanes, walked over the same pages: an item's rows (token, head in group),
// or a shared item's rows of several sequences over the pages they share. Up to kMaxLaneGroups groups of
// kRowLanes rows.
constexpr int kMaxLaneGroups = 2;  // two groups share each K and V element loaded (scores2x2, scores2x2_eighths)
struct LaneRows {
  int32_t kv_head;
  const float* q[kMaxLaneGroups * kRowLanes];  // the lane's q row; nullptr: padding (sees no key, gives nothing)
  int32_t pos[kMaxLaneGroups * kRowLanes];     // the lane's position
  float* out[kMaxLaneGroups * kRowLanes];      // where its result goes; nullptr: its softmax state is kept in state
  float* state[kMaxLaneGroups * kRowLanes];    // its state to start from when `resume` (else fresh), and to keep
  bool resume;
};

// The rows of `ln` (kGroups groups of kRowLanes lanes) over the keys [begin, end) of the pages `seq_pages`, with
// the rows in vector lanes: a key's scores for the rows are 64 multiply-adds of a q column by one broadcast K
// element (plus the 15 adds of the score's tree), and a P row times V is 64 more, so there are no horizontal sums
// and each K/V element loaded serves kRowLanes rows (kGroups x kRowLanes with two groups).
template <int kHeadDim, int kGroups>  // kHeadDim: as run_item's
void run_lanes(const Problem& p, const LaneRows& ln, const int32_t* seq_pages, int32_t begin, int32_t end) {
  static_assert(kGroups == 1 || kGroups == 2);
  // P times V's output columns kept in registers at a time: 8 a group, or 4 with two groups of 8 lanes (AVX)
  constexpr int64_t kCols = kGroups == 2 && kRowLanes == 8 ? 4 : 8;
  const int64_t D = kHeadDim > 0 ? kHeadDim : p.head_dim, ps = p.page_size;
  const int64_t combined = 2 * p.num_kv_heads;
  const int32_t h = ln.kv_head;
  const int64_t D8 = (D + 7) / 8 * 8;  // accumulators are moved 8 columns at a time
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;  // the score's partial sums: whole blocks of 16
  std::vector<rf> qt(kGroups * D16, rf{}), acc(kGroups * D8, rf{});  // group g at g * D16, g * D8; q past D: 0
  alignas(64) int32_t pos_lanes[kGroups * kRowLanes];
  alignas(64) float m_lanes[kGroups * kRowLanes], l_lanes[kGroups * kRowLanes];
  for (int lane = 0; lane < kGroups * kRowLanes; ++lane) {
    const int g = lane / kRowLanes, k = lane % kRowLanes;
    m_lanes[lane] = kMasked;
    l_lanes[lane] = 0.f;
    const float* src = ln.q[lane];
    if (!src) {
      pos_lanes[lane] = -1;
      continue;
    }
    pos_lanes[lane] = ln.pos[lane];
    if (ln.resume) {
      const float* st = ln.state[lane];
      m_lanes[lane] = st[0];
      l_lanes[lane] = st[1];
      for (int64_t d = 0; d < D; ++d) acc[g * D8 + d][k] = st[2 + d];
    }
  }
  for (int g = 0; g < kGroups; ++g) q_to_lanes(&ln.q[g * kRowLanes], p.scale, D, &qt[g * D16]);
  ri pos[kGroups];
  rf m[kGroups], l[kGroups];
  std::memcpy(pos, pos_lanes, sizeof(pos));
  PosRange range[kGroups];
  for (int g = 0; g < kGroups; ++g) range[g] = pos_range(&pos_lanes[g * kRowLanes]);
  std::memcpy(m, m_lanes, sizeof(m));
  std::memcpy(l, l_lanes, sizeof(l));
  const int64_t sc_keys = (ps + 7) / 8 * 8 + 2;  // scores are stored 8 keys at a time (and 3 computed at a time)
  std::vector<rf> sc(kGroups * sc_keys);  // group g's key j at sc[g * sc_keys + j]
  for (int32_t page_slot = begin / ps; page_slot * ps < end; ++page_slot) {
    const float* base = p.kv + static_cast<int64_t>(seq_pages[page_slot]) * ps * combined * D;
    const int32_t t0 = page_slot * static_cast<int32_t>(ps);
    const int32_t n = std::min<int32_t>(ps, end - t0);
    auto key = [&](int32_t j) { return base + (std::min(j, n - 1) * combined + 2 * h) * D; };  // past n: ignored
    if constexpr (kGroups == 2) {
      for (int32_t j = 0; j < n; j += 2) {
        rf o[4];
        if constexpr (kRowLanes == 16) scores2x2<kHeadDim>(qt.data(), qt.data() + D16, key(j), key(j + 1), D, o);
        else scores2x2_eighths<kHeadDim>(qt.data(), qt.data() + D16, key(j), key(j + 1), D, o);
        sc[j] = o[0], sc[j + 1] = o[1], sc[sc_keys + j] = o[2], sc[sc_keys + j + 1] = o[3];
      }
    } else if constexpr (kRowLanes == 16) {
      for (int32_t j = 0; j < n; j += 2) scores2<kHeadDim>(qt.data(), key(j), key(j + 1), D, &sc[j], &sc[j + 1]);
    } else {
      for (int32_t j = 0; j < n; j += 3) {
        const float* k[3] = {key(j), key(j + 1), key(j + 2)};
        scores3<kHeadDim>(qt.data(), k, D, &sc[j]);
      }
    }
    rf alpha[kGroups];
    for (int g = 0; g < kGroups; ++g)
      alpha[g] = page_softmax(p, reinterpret_cast<float*>(&sc[g * sc_keys]), n, t0, pos[g], range[g], m[g], l[g]);
    for (int64_t d0 = 0; d0 < D; d0 += kCols) {  // kCols output columns at a time, kept in registers over the keys
      const int64_t nd = std::min<int64_t>(kCols, D - d0);
      rf a[kGroups][kCols];
#pragma GCC unroll 2
      for (int g = 0; g < kGroups; ++g)
#pragma GCC unroll 8
        for (int u = 0; u < kCols; ++u) a[g][u] = acc[g * D8 + d0 + u] * alpha[g];  // columns past D: never read out
      auto keys = [&](auto whole) {  // whole: all kCols columns exist (no per-column test in the loop)
        const rf* s0 = sc.data();
        for (int32_t j = 0; j < n; ++j) {
          const float* v = base + (j * combined + 2 * h + 1) * D + d0;
          rf p0, p1;
          std::memcpy(&p0, s0 + j, sizeof(rf));
          if constexpr (kGroups == 2) std::memcpy(&p1, s0 + sc_keys + j, sizeof(rf));
#pragma GCC unroll 8
          for (int u = 0; u < kCols; ++u) {
            const rf vu = splat_as<rf>(v[decltype(whole)::value || u < nd ? u : 0]);
            a[0][u] = fma_regs(p0, vu, a[0][u]);
            if constexpr (kGroups == 2) a[kGroups - 1][u] = fma_regs(p1, vu, a[kGroups - 1][u]);
          }
        }
      };
      if (nd == kCols) keys(std::true_type{});
      else keys(std::false_type{});
#pragma GCC unroll 2
      for (int g = 0; g < kGroups; ++g)
#pragma GCC unroll 8
        for (int u = 0; u < kCols; ++u) acc[g * D8 + d0 + u] = a[g][u];
    }
  }
  for (int lane = 0; lane < kGroups * kRowLanes; ++lane) {
    if (!ln.q[lane]) continue;
    const int g = lane / kRowLanes, k = lane % kRowLanes;
    if (float* dst = ln.out[lane]) {
      const float inv = l[g][k] > 0.f ? 1.f / l[g][k] : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[g * D8 + d][k] * inv;
    } else {
      float* st = ln.state[lane];
      st[0] = m[g][k];
      st[1] = l[g][k];
      for (int64_t d = 0; d < D; ++d) st[2 + d] = acc[g * D8 + d][k];
    }
  }
}

// Rows [row0, row0 + rows) of a walk, in one or two groups of lanes (`lane_row(lane)` fills lane `lane`).
template <int kHeadDim, class Fill>
void run_lane_rows(const Problem& p, LaneRows& ln, int64_t rows, const int32_t* seq_pages, int32_t begin,
                   int32_t end, Fill lane_row) {
  for (int64_t row0 = 0; row0 < rows;) {
    const int groups = rows - row0 > kRowLanes ? kMaxLaneGroups : 1;
    for (int lane = 0; lane < groups * kRowLanes; ++lane) {
      ln.q[lane] = nullptr;
      if (row0 + lane < rows) lane_row(lane, row0 + lane);
    }
    if (groups == 2) run_lanes<kHeadDim, kMaxLaneGroups>(p, ln, seq_pages, begin, end);
    else run_lanes<kHeadDim, 1>(p, ln, seq_pages, begin, end);
    row0 += groups * kRowLanes;
  }
}

// Per-thread buffers of the all-heads path, kept between items (an item is a few microseconds of work).
struct Scratch {
  std::vector<float> f[6];
  std::vector<int32_t> i[2];
  std::vector<PosRange> ranges;  // each row group's position range (page_softmax)
  float* take(int k, int64_t n, float fill) {
    f[k].assign(n, fill);
    return f[k].data();
  }
  int32_t* take_i(int k, int64_t n) {
    i[k].assign(n, 0);
    return i[k].data();
  }
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// reduce16's result for head dims past 256 (more q blocks than registers): the same sums, one key at a time.
void score_wide(const float* q, const float* const* key, int32_t kv_off, int64_t D, float* out) {
  for (int u = 0; u < kLanes; ++u) {
    vf part[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      float a = 0.f;
      for (int64_t d = l; d < (D + kLanes - 1) / kLanes * kLanes; d += kLanes)
        a = std::fma(q[d], d < D ? key[u][kv_off + d] : 0.f, a);
      part[l] = splat(a);
    }
    out[slot_lane(u)] = tree16(part)[0];
  }
}

// kRows rows' P times V over a page's n keys (row r: probabilities pr[r + j * stride], rescale alpha[r],
// K/V offset kv_off[r], accumulator acc[r * kHeadDim ...]): each row's columns in registers, keys in order,
// the same multiply-adds as the row-by-row loop (a key of probability 0 is skipped there and here).
template <int kHeadDim, int kRows>
void pv_rows(const float* base, int64_t combined, int32_t n, const float* pr, int64_t stride, const float* alpha,
             const int32_t* kv_off, float* acc) {
  constexpr int kBlocks = kHeadDim / kRowLanes;
  rf a[kRows][kBlocks];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < kBlocks; ++b) {
      std::memcpy(&a[r][b], acc + r * kHeadDim + b * kRowLanes, sizeof(rf));
      a[r][b] = a[r][b] * alpha[r];
    }
  for (int32_t j = 0; j < n; ++j) {
    const float* slot = base + j * combined * kHeadDim + kHeadDim;  // V of KV head 0; kv_off picks the head
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float w = pr[r + j * stride];
      if (w == 0.f) continue;
#pragma GCC unroll 8
      for (int b = 0; b < kBlocks; ++b) {
        rf v;
        std::memcpy(&v, slot + kv_off[r] + b * kRowLanes, sizeof(v));
        a[r][b] = fma(splat_as<rf>(w), v, a[r][b]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < kBlocks; ++b) std::memcpy(acc + r * kHeadDim + b * kRowLanes, &a[r][b], sizeof(rf));
}

// A work item's rows over its pages. Items with few rows per KV head (decoding sequences: one token) hold
// every head (kv_head < 0) and walk each page once, whole and in order, fetching the page after next into
// L2 ahead, spread over the page's work: pages are scattered in the pool, so the hardware prefetcher
// cannot guess them. (64 sequences decoding at 1,400 tokens of context, 8 heads over 4 KV heads of 64,
// pages of 16: 21 ms a call with a whole page of prefetches at once and the keys gathered column by
// column; 9-10 ms, about 20 GB/s of KV, with K rows read as they lie, P times V in registers and the
// prefetches spread.) Its softmax is run_lanes' (page_softmax), a group of rows in vector lanes: a max, an exp
// and a sum along one row's keys each took a chain of dependent steps per row. Items with more rows take one KV
// head and put the rows in vector lanes (run_lanes).
template <int kHeadDim>  // > 0: head_dim known at compile time (loops unrolled); 0: any
void run_item(const Problem& p, const Item& it) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : p.head_dim, G = p.num_heads / p.num_kv_heads, ps = p.page_size;
  const int64_t combined = 2 * p.num_kv_heads;
  const int32_t s = it.seq;
  const bool all_heads = it.kv_head < 0;
  const int64_t heads = all_heads ? p.num_heads : G;  // query heads per token in this item
  const int64_t head0 = all_heads ? 0 : it.kv_head * G;
  const int32_t q_begin = p.cu[s], q_len = p.cu[s + 1] - p.cu[s], kv_len = p.kv_lens[s];
  const int64_t rows = static_cast<int64_t>(it.row_end - it.row_begin) * heads;  // (token, head)
  int32_t first_pos = kv_len - q_len + (it.row_begin - q_begin), last_pos = first_pos + (it.row_end - it.row_begin) - 1;
  const int32_t end = std::min(kv_len, last_pos + 1);
  const int32_t begin = it.done_pages > 0 ? it.done_pages * static_cast<int32_t>(ps)  // (no window: share_groups)
                                          : p.window > 0 ? std::max(0, first_pos - p.window + 1) : 0;
  const int32_t* seq_pages = p.pages + static_cast<int64_t>(s) * p.pages_per_seq;
  const int64_t state_stride = state_floats(D);
  if (!all_heads) {
    LaneRows ln{};
    ln.kv_head = it.kv_head;
    ln.resume = it.state != nullptr;
    run_lane_rows<kHeadDim>(p, ln, rows, seq_pages, begin, end, [&](int lane, int64_t i) {
      const int64_t r = it.row_begin + i / G, hq = head0 + i % G;
      ln.q[lane] = p.q + (r * p.num_heads + hq) * D;
      ln.pos[lane] = kv_len - q_len + static_cast<int32_t>(r - q_begin);
      ln.out[lane] = p.out + (r * p.num_heads + hq) * D;
      if (it.state) ln.state[lane] = it.state + hq * state_stride;  // (one token: share_groups)
    });
    return;
  }

  const int64_t ps_lanes = (ps + kLanes - 1) / kLanes * kLanes;  // score buffers in whole vectors
  const int64_t D16 = (D + kLanes - 1) / kLanes * kLanes;  // a q row with its columns past D as 0
  // Rows in groups of kRowLanes for the softmax: a group's scores (then probabilities) lie key by key, the
  // group's rows in the lanes of one vector (row i's key j at st[((i / R) * ps_lanes + j) * R + i % R]), so that
  // the max, exp and key-ordered sum run for the group's rows at once instead of along one row's lanes.
  constexpr int64_t R = kRowLanes;
  const int64_t groups = (rows + R - 1) / R;
  Scratch& buf = scratch();
  float* qbuf = buf.take(0, rows * D16, 0.f);
  float* acc = buf.take(1, rows * D, 0.f);
  float* m = buf.take(2, groups * R, kMasked);
  float* l = buf.take(3, groups * R, 0.f);
  float* alpha = buf.take(4, groups * R, 0.f);
  float* st = buf.take(5, groups * ps_lanes * R, 0.f);
  int32_t* pos = buf.take_i(0, groups * R);  // a group's padding rows past `rows`: computed, never read
  int32_t* kv_off = buf.take_i(1, rows);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = it.row_begin + i / heads, hq = head0 + i % heads;
    pos[i] = kv_len - q_len + static_cast<int32_t>(r - q_begin);
    kv_off[i] = static_cast<int32_t>(2 * (hq / G) * D);  // this head's K row within a token's slot; V follows
    const float* src = p.q + (r * p.num_heads + hq) * D;
    for (int64_t d = 0; d < D; ++d) qbuf[i * D16 + d] = src[d] * p.scale;
    if (it.state) {  // the state its shared item left (one token: share_groups)
      const float* st = it.state + hq * state_stride;
      m[i] = st[0];
      l[i] = st[1];
      for (int64_t d = 0; d < D; ++d) acc[i * D + d] = st[2 + d];
    }
  }
  buf.ranges.resize(groups);
  for (int64_t g = 0; g < groups; ++g) buf.ranges[g] = pos_range(&pos[g * R]);
  const int64_t page_floats = ps * combined * D;
  const int32_t last_slot = (end - 1) / static_cast<int32_t>(ps);
  for (int32_t page_slot = begin / ps; page_slot <= last_slot && end > 0; ++page_slot) {
    const float* base = p.kv + static_cast<int64_t>(seq_pages[page_slot]) * page_floats;
    const int32_t t0 = page_slot * static_cast<int32_t>(ps);
    const int32_t n = std::min<int32_t>(ps, end - t0);
    // The page after next is fetched into L2 a slice at a time, one slice per (16 keys, row) of this page's
    // scores, per row of its softmax and per row group of its P times V: a whole page of prefetches at once
    // fills the CPU's queue of outstanding misses and stalls the walk where a spread one overlaps it (on two
    // AVX2 cores, slices over the scores alone still stalled a fifth of the kernel's time on the prefetches;
    // over the whole page's work, decoding 64 x 1,400 tokens went from ~19 to ~15-16 ms).
    const char* ahead = page_slot + 2 <= last_slot
        ? reinterpret_cast<const char*>(p.kv + static_cast<int64_t>(seq_pages[page_slot + 2]) * page_floats) : nullptr;
    const int64_t ahead_lines = (page_floats * static_cast<int64_t>(sizeof(float)) + 63) / 64;
    const int64_t score_steps = (n + kLanes - 1) / kLanes * rows + 2 * rows;
    const int64_t lines_per_step = (ahead_lines + score_steps - 1) / score_steps;
    int64_t line = 0;
    auto prefetch = [&](int64_t steps) {
      for (const int64_t stop = std::min(ahead_lines, line + lines_per_step * steps); ahead && line < stop; ++line)
        __builtin_prefetch(ahead + line * 64, 0, 2);
    };
    // Scores, 16 keys at a time: each key's K row is read as it lies (16 columns a load) into its 16
    // partial sums, then reduce16 sums the 16 keys' partials together, keys in lanes. Lanes past the page's
    // keys repeat its last key; the mask below hides them.
    for (int32_t j0 = 0; j0 < n; j0 += kLanes) {
      const int32_t nj = std::min<int32_t>(kLanes, n - j0);
      const float* key[kLanes];  // slot -> its key's slot in the page
      for (int u = 0; u < kLanes; ++u) key[u] = base + std::min(j0 + slot_lane(u), j0 + nj - 1) * combined * D;
      for (int64_t i = 0; i < rows; ++i) {
        prefetch(1);
        alignas(64) float out[kLanes];  // row i's scores of keys j0 .. j0 + 15
        constexpr int64_t kMaxBlocks = kHeadDim > 0 ? (kHeadDim + kLanes - 1) / kLanes : 16;
        vf qv[kMaxBlocks];
        const int64_t blocks = D16 / kLanes;
        if (blocks > kMaxBlocks) {  // head_dim past 256: more q blocks than registers hold; same arithmetic
          score_wide(&qbuf[i * D16], key, kv_off[i], D, out);
        } else {
          for (int64_t b = 0; b < blocks; ++b) std::memcpy(&qv[b], &qbuf[i * D16 + b * kLanes], sizeof(vf));
#if defined(__FMA__) && !defined(__AVX512F__)
          const float* by_lane[kLanes];  // lane c's key: slot slot_lane(c)'s
          for (int c = 0; c < kLanes; ++c) by_lane[c] = key[slot_lane(c)] + kv_off[i];
          _mm256_store_ps(out, scores8(qv, blocks, by_lane, D));
          _mm256_store_ps(out + 8, scores8(qv, blocks, by_lane + 8, D));
#else
          vf P[kLanes];
#pragma GCC unroll 16
          for (int u = 0; u < kLanes; ++u) {
            const float* k = key[u] + kv_off[i];
            vf a = vf{};
            for (int64_t b = 0; b < blocks; ++b) a = fma(qv[b], load16(k + b * kLanes, D - b * kLanes), a);
            P[u] = a;
          }
          const vf o = reduce16(P);
          std::memcpy(out, &o, sizeof(o));
#endif
        }
        float* dst = &st[((i / R) * ps_lanes + j0) * R + i % R];
        for (int c = 0; c < kLanes; ++c) dst[c * R] = out[c];
      }
    }
    // Mask, max, exp and the key-ordered sum, a group of rows at a time (vector lanes = rows).
    for (int64_t g = 0; g < groups; ++g) {
      prefetch(std::min(R, rows - g * R));
      ri position;
      rf m_g, l_g;
      std::memcpy(&position, &pos[g * R], sizeof(position));
      std::memcpy(&m_g, &m[g * R], sizeof(m_g));
      std::memcpy(&l_g, &l[g * R], sizeof(l_g));
      const rf a = page_softmax(p, &st[g * ps_lanes * R], n, t0, position, buf.ranges[g], m_g, l_g);
      std::memcpy(&alpha[g * R], &a, sizeof(a));
      std::memcpy(&l[g * R], &l_g, sizeof(l_g));
      std::memcpy(&m[g * R], &m_g, sizeof(m_g));
    }
    // P times V, row by row in key order; kPvRows rows at a time keep their accumulators in registers.
    int64_t i = 0;
    // Rows at a time: as many as 16 accumulator registers hold with AVX-512 (32 in all), 8 with AVX (16). A
    // multiple of kPvRows never crosses a group (kPvRows divides R).
    constexpr int kPvRows = kHeadDim > 0 ? (kRowLanes == 16 ? 16 : 8) * kRowLanes / kHeadDim : 0;
    static_assert(kPvRows == 0 || R % kPvRows == 0);
    if constexpr (kPvRows > 0 && kHeadDim % kRowLanes == 0) {
      for (; i + kPvRows <= rows; i += kPvRows) {
        prefetch(kPvRows);
        pv_rows<kHeadDim, kPvRows>(base, combined, n, &st[(i / R) * ps_lanes * R + i % R], R, &alpha[i], &kv_off[i],
                                   &acc[i * D]);
      }
    }
    for (; i < rows; ++i) {
      float* a = &acc[i * D];
      const float* pr = &st[(i / R) * ps_lanes * R + i % R];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha[i];
      for (int32_t j = 0; j < n; ++j) {
        const float w = pr[j * R];
        if (w == 0.f) continue;
        const float* v = base + kv_off[i] + j * combined * D + D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] = std::fma(w, v[d], a[d]);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = it.row_begin + i / heads, hq = head0 + i % heads;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    float* dst = p.out + (r * p.num_heads + hq) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
  }
}

// Sequences that decode one token each and whose first pages are the same physical pages (a prefix cache hit:
// few-shot prompts, several samples of one prompt).
struct ShareGroup {
  std::vector<int32_t> seqs;
  int32_t pages;        // shared: the first `pages` of every member's page list
  int64_t first_state;  // member m's head hq keeps its state at state[(first_state + m) * num_heads + hq]
};

// A shared item: rows [row_begin, row_end) of group g's (member, head in KV group) rows of KV head kv_head, over
// the shared pages, in vector lanes; each row's softmax state is kept for its own item.
template <int kHeadDim>
void run_shared(const Problem& p, const Item& it, const ShareGroup& g, float* state) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : p.head_dim, G = p.num_heads / p.num_kv_heads;
  LaneRows ln{};
  ln.kv_head = it.kv_head;
  ln.resume = false;
  run_lane_rows<kHeadDim>(p, ln, it.row_end - it.row_begin, p.pages + static_cast<int64_t>(g.seqs[0]) * p.pages_per_seq,
                          0, g.pages * static_cast<int32_t>(p.page_size), [&](int lane, int64_t i) {
    const int32_t member = static_cast<int32_t>((it.row_begin + i) / G), s = g.seqs[member];
    const int64_t hq = it.kv_head * G + (it.row_begin + i) % G;
    ln.q[lane] = p.q + (static_cast<int64_t>(p.cu[s]) * p.num_heads + hq) * D;
    ln.pos[lane] = p.kv_lens[s] - 1;
    ln.out[lane] = nullptr;
    ln.state[lane] = state + ((g.first_state + member) * p.num_heads + hq) * state_floats(D);
  });
}

// The groups of sequences that share their first pages (ShareGroup). A member decodes one token, has at least
// kMinSharedPages whole pages before it, and has the same first pages as the group's first sequence; the group
// shares the K pages that maximise K x members (a member that shares fewer is left out: it runs alone) and has at
// least kMinLaneRows rows a KV head. No sliding window (its first visible page differs by row).
constexpr int32_t kMinSharedPages = 2;
std::vector<ShareGroup> share_groups(const Problem& p, int32_t n_seqs) {
  std::vector<ShareGroup> groups;
  if (p.window > 0) return groups;
  const int64_t G = p.num_heads / p.num_kv_heads;
  auto pages = [&](int32_t s) { return p.pages + static_cast<int64_t>(s) * p.pages_per_seq; };
  std::vector<std::pair<int32_t, int32_t>> by_first;  // (first page, seq) of every candidate
  for (int32_t s = 0; s < n_seqs; ++s) {
    if (p.cu[s + 1] - p.cu[s] == 1 && (p.kv_lens[s] - 1) / p.page_size >= kMinSharedPages)
      by_first.push_back({pages(s)[0], s});
  }
  std::stable_sort(by_first.begin(), by_first.end());
  int64_t states = 0;
  for (size_t a = 0, b; a < by_first.size(); a = b) {
    for (b = a + 1; b < by_first.size() && by_first[b].first == by_first[a].first;) ++b;
    if (static_cast<int64_t>(b - a) * G < kMinLaneRows) continue;
    const int32_t lead = by_first[a].second;
    std::vector<std::pair<int32_t, int32_t>> common;  // (pages shared with lead, seq)
    for (size_t i = a; i < b; ++i) {
      const int32_t s = by_first[i].second;
      const int32_t whole = static_cast<int32_t>(std::min((p.kv_lens[s] - 1) / p.page_size,
                                                          (p.kv_lens[lead] - 1) / p.page_size));
      int32_t k = 0;
      while (k < whole && pages(s)[k] == pages(lead)[k]) ++k;
      common.push_back({k, s});
    }
    std::stable_sort(common.begin(), common.end(), [](auto x, auto y) { return x.first > y.first; });
    int64_t best = 0;
    size_t take = 0;
    for (size_t i = 0; i < common.size(); ++i) {
      const int64_t gain = common[i].first * static_cast<int64_t>(i + 1);  // pages x members
      if (gain > best) best = gain, take = i + 1;
    }
    if (take == 0 || static_cast<int64_t>(take) * G < kMinLaneRows || common[take - 1].first < kMinSharedPages)
      continue;
    ShareGroup g{{}, common[take - 1].first, states};
    for (size_t i = 0; i < take; ++i) g.seqs.push_back(common[i].second);
    std::sort(g.seqs.begin(), g.seqs.end());
    states += static_cast<int64_t>(take);
    groups.push_back(std::move(g));
  }
  return groups;
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pages,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t sliding_window,
                float soft_cap, bool share_pages) {
  const auto qd = q.dimensions(), kd = kv_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2) return ffi::Error::InvalidArgument("bad ranks");
  Problem p{q.typed_data(), kv_pages.typed_data(), kv_lens.typed_data(), page_indices.typed_data(),
            cu_q_lens.typed_data(), out->typed_data(), qd[1], qd[2], kd[1], kd[2] / 2, pd[1], sm_scale,
            sliding_window, soft_cap};
  if (kd[3] != p.head_dim || p.num_heads % p.num_kv_heads != 0)
    return ffi::Error::InvalidArgument("q and kv_pages disagree on head_dim or heads");
  std::memset(p.out, 0, sizeof(float) * qd[0] * qd[1] * qd[2]);

  const int32_t n_seqs = std::min<int64_t>(num_seqs.typed_data()[0], pd[0]);
  const int64_t G = p.num_heads / p.num_kv_heads;
  auto groups = std::make_shared<std::vector<ShareGroup>>(share_pages ? share_groups(p, n_seqs)
                                                                      : std::vector<ShareGroup>{});
  // Two rounds: the shared items with every other sequence's, then the sharing sequences' own items, which start
  // from the states the shared items keep.
  std::vector<Item> items, own;
  std::vector<int32_t> member_of(n_seqs, -1), shared_pages(n_seqs, 0);  // seq -> its index among all members
  auto state = std::make_shared<std::vector<float>>();
  for (size_t gi = 0; gi < groups->size(); ++gi) {
    const ShareGroup& g = (*groups)[gi];
    for (size_t m = 0; m < g.seqs.size(); ++m) {
      member_of[g.seqs[m]] = static_cast<int32_t>(g.first_state + m);
      shared_pages[g.seqs[m]] = g.pages;
    }
    const int32_t rows = static_cast<int32_t>(g.seqs.size() * G);
    for (int32_t h = 0; h < p.num_kv_heads; ++h) {
      for (int32_t r = 0; r < rows; r += kRowsPerItem * 2) {  // (as many rows as a prompt's item of G = 2)
        const int32_t r_end = std::min(rows, r + kRowsPerItem * 2);
        Item it{static_cast<int32_t>(gi), h, r, r_end, static_cast<int64_t>(g.pages) * p.page_size * (r_end - r) / G};
        it.group = static_cast<int32_t>(gi);
        items.push_back(it);
      }
    }
  }
  if (!groups->empty()) {
    const ShareGroup& last = groups->back();
    state->resize((last.first_state + last.seqs.size()) * p.num_heads * state_floats(p.head_dim));
  }
  for (int32_t s = 0; s < n_seqs; ++s) {
    const int32_t begin = p.cu[s], end = p.cu[s + 1];
    for (int32_t r = begin; r < end; r += kRowsPerItem) {
      const int32_t r_end = std::min(end, r + kRowsPerItem);
      const int64_t ctx = std::max<int64_t>(1, p.kv_lens[s] - (end - r_end));  // the last row's context
      const int64_t per_head = (ctx - static_cast<int64_t>(shared_pages[s]) * p.page_size) * (r_end - r);
      Item it{s, -1, r, r_end, per_head * p.num_kv_heads};
      it.done_pages = shared_pages[s];
      if (member_of[s] >= 0) it.state = state->data() + member_of[s] * p.num_heads * state_floats(p.head_dim);
      std::vector<Item>& to = member_of[s] < 0 ? items : own;
      if ((r_end - r) * G >= kMinLaneRows) {
        for (int32_t h = 0; h < p.num_kv_heads; ++h) {
          it.kv_head = h;
          it.cost = per_head;
          to.push_back(it);
        }
      } else {
        to.push_back(it);
      }
    }
  }
  for (std::vector<Item>* round : {&items, &own}) {
    // Biggest first, then hand items out one at a time: the threads finish together.
    std::stable_sort(round->begin(), round->end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const size_t n = round->size();
    pagefleet::run_items(pool, n, [p, groups, state, items = std::move(*round)](size_t i) {
      const Item& it = items[i];
      if (it.group >= 0) {
        const ShareGroup& g = (*groups)[it.group];
        if (p.head_dim == 64) run_shared<64>(p, it, g, state->data());
        else if (p.head_dim == 128) run_shared<128>(p, it, g, state->data());
        else run_shared<0>(p, it, g, state->data());
      } else if (p.head_dim == 64) {
        run_item<64>(p, it);
      } else if (p.head_dim == 128) {
        run_item<128>(p, it);
      } else {
        run_item<0>(p, it);
      }
    });
  }
  return ffi::Error::Success();
}

// RoPE in Hugging Face's rotate-half layout: out = x * cos + rotate_half(x) * sin, each product rounded before the
// sum (built with -ffp-contract=off), as torch computes it. x: [T, heads, D]; cos, sin: [T, D].
ffi::Error RopeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 3 || cos.dimensions().size() != 2) return ffi::Error::InvalidArgument("bad ranks");
  const int64_t T = xd[0], H = xd[1], D = xd[2], half = D / 2;
  const float *xs = x.typed_data(), *c = cos.typed_data(), *sn = sin.typed_data();
  float* o = out->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const float *ct = c + t * D, *st = sn + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = xs + (t * H + h) * D;
      float* orow = o + (t * H + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float a = xr[d] * ct[d], b = -xr[d + half] * st[d];
        orow[d] = a + b;
      }
      for (int64_t d = half; d < D; ++d) {
        const float a = xr[d] * ct[d], b = xr[d - half] * st[d];
        orow[d] = a + b;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagefleetRopeF32, RopeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagefleetRaggedPagedAttentionF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("share_pages"));
