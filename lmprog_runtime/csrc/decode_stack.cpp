// A decode step of every decoder layer in one native call (CPU).
//
// At batch 1 a decode step of a 30-layer model is some 400 small kernels; launched one by
// one from Python, the interpreter's share of the step rivals the arithmetic. `DecodeStack`
// holds the layers' weights (float, Q8_0 or Q4_1 linears) and the KV pool's buffers, and
// runs the same kernels in the same order as the Python forward (`LlamaForCausalLM` with
// `NativeOps` and the native attention backend), so its results are identical to it:
// RMSNorm, fused QKV projection, RoPE, KV store, paged decode attention, output projection,
// residual + RMSNorm, gate/up projection, SiLU-and-mul, down projection, residual + RMSNorm.
// It covers the plain case only; the caller keeps the Python path for anything else
// (prefills, cascade attention over shared prefixes, Q/K norms).
//
// With quantized (or AMX bfloat16) layers at decode batch sizes, every kernel is short (tens
// to hundreds of microseconds) and forking OpenMP threads for each one cost more than its
// arithmetic: the helper threads slept between kernels and waking them took longer than the
// kernel (on a 2-vCPU VM, a step of SmolLM2-135M took 10 ms this way and 6.5 ms with the
// helpers spinning, by timers around each kernel). libgomp lets them sleep at once whenever
// the process holds more of its threads than there are CPUs, as it does when the main
// thread and the engine's loop thread each have a team. So such a step runs in one parallel
// region: the threads split each linear layer's outputs, and the attention's requests,
// between them and wait for each other at a spin barrier, and one thread does the small
// steps in between (norms, RoPE, the KV store, readying the next kernel's input). The
// spinning lasts as long as the step, no longer.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "native_ops.h"

namespace {

// One linear layer: `kind` "dense" (weight [out, in]), "amx" (bfloat16 weight [out, in] and,
// as `scales`, the same packed for AMX tiles), "q8_0" (weight int8, scales), "q4_1"
// (weight packed, scales, mins), "w8a8" (weight int8, scales per output and, as `mins`,
// the weight packed by w8a8_pack or undefined) or "w8a8_gated" (a gated MLP's gate/up
// projection, `mins` packed gated: its output is the activation, silu(gate) * up) or
// "amx_gated" (the same for bfloat16: weight [out, in] and, as `scales`, packed by pairs of
// gate and up blocks for amx_gated); bias optional (undefined when absent).
struct Linear {
  std::string kind;
  torch::Tensor weight, scales, mins, bias;
  int64_t dense_rows;  // quantized: from this many rows, dequantize and run a dense matmul
  int64_t amx_rows;    // amx: up to this many rows on the packed weight

  bool quantized() const { return kind == "q8_0" || kind == "q4_1"; }
  bool gated() const { return kind == "w8a8_gated" || kind == "amx_gated"; }
  // A gate/up projection's output to the MLP's activation (a gated kind's output already is).
  torch::Tensor activation(const torch::Tensor& out) const {
    return gated() ? out : silu_and_mul(out);
  }

  // Whether `rows` rows can run split among a parallel region's threads (`prepare`).
  bool splits(int64_t rows) const {
    return (quantized() && rows < dense_rows) || (kind == "amx" && rows <= amx_rows) ||
           (kind == "w8a8" && mins.defined() && w8a8_packed_available() &&
            rows <= w8a8_packed_max_rows()) ||
           gated();
  }

  // For the threads of a parallel region: ready the input of x @ w.T (+ bias).
  std::unique_ptr<SplitWork> prepare(const torch::Tensor& x) const {
    if (kind == "amx") return prepare_amx_linear(x, scales, bias);
    if (kind == "amx_gated") return prepare_amx_gated(x, scales);
    if (kind == "w8a8" || kind == "w8a8_gated") return prepare_w8a8_linear(x, mins, scales, bias, false, gated());
    return prepare_quantized_linear(kind, weight, scales, mins, x);
  }

  torch::Tensor finish(const SplitWork& work) const {
    const bool biased = kind != "amx" && kind != "w8a8" && !gated();  // those add it themselves
    return bias.defined() && biased ? work.output() + bias : work.output();
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == "amx" && x.size(0) <= amx_rows) return amx_linear(x, scales, bias);
    if (kind == "dense" || kind == "amx") return at::linear(x, weight, bias);
    if (kind == "w8a8") return w8a8_linear(x, weight, scales, mins, bias, false);
    if (kind == "amx_gated") return amx_gated(x, scales);
    if (gated()) return w8a8_gated(x, scales, mins);
    torch::Tensor out;
    if (x.size(0) >= dense_rows) {
      const bool bf16 = x.scalar_type() == torch::kBFloat16;
      auto dense = kind == "q8_0" ? q8_0_dequantize(weight, scales, bf16)
                                  : q4_1_dequantize(weight, scales, mins, bf16);
      out = at::linear(x, dense);
    } else {
      out = kind == "q8_0" ? q8_0_linear(x, weight, scales, false)
                           : q4_1_linear(x, weight, scales, mins, false);
    }
    return bias.defined() ? out + bias : out;
  }
};

// buf[slots[t]] = rows[t] for every token t: a row copy each (what `buf[slots] = rows`
// does in torch, without advanced indexing's set-up cost for a handful of rows).
void store_rows(const torch::Tensor& buf, const torch::Tensor& rows, const torch::Tensor& slots) {
  const int64_t tokens = rows.size(0), row = buf.stride(0);
  const bool plain = rows.scalar_type() == buf.scalar_type() && buf.is_contiguous() &&
                     rows.stride(2) == 1 && rows.stride(1) == rows.size(2) &&
                     rows.size(1) * rows.size(2) == row && slots.scalar_type() == torch::kInt64 &&
                     slots.is_contiguous();
  if (!plain) {
    buf.index_put_({slots}, rows);
    return;
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = row * buf.element_size();
  auto* dst = static_cast<char*>(buf.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < buf.size(0), "KV slot ", slot[t], " out of range");
    std::memcpy(dst + slot[t] * bytes, src + t * rows.stride(0) * buf.element_size(), bytes);
  }
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  torch::Tensor k_buf, v_buf;

  bool splits(int64_t rows) const {
    return qkv.splits(rows) && o.splits(rows) && gate_up.splits(rows) && down.splits(rows);
  }
};

// Threads of one parallel region wait here for each other: they spin (the wait is a few
// microseconds, the time of a short kernel), then yield the CPU if it goes on, as it does
// when the machine has fewer free cores than threads.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 16;  // some milliseconds
  const int threads_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

// The steps of one parallel region, in the same order on every thread, each followed by a
// barrier. No exception may leave an OpenMP region: the first one is kept, the remaining
// steps are skipped (every thread still reaches every barrier), and it is rethrown after.
class RegionSteps {
 public:
  RegionSteps(int thread, int threads, SpinBarrier& barrier, std::exception_ptr& error,
              std::atomic<bool>& failed)
      : thread_(thread), threads_(threads), barrier_(barrier), error_(error), failed_(failed) {}

  // fn() on the first thread only.
  template <typename Fn>
  void serial(Fn&& fn) {
    if (thread_ == 0) guarded(fn);
    barrier_.wait();
  }

  // work->run(...) on every thread, each for its share of the outputs.
  void split(const std::unique_ptr<SplitWork>& work) {
    guarded([&] { work->run(thread_, threads_); });
    barrier_.wait();
  }

 private:
  template <typename Fn>
  void guarded(Fn&& fn) {
    if (failed_.load(std::memory_order_acquire)) return;
    try {
      fn();
    } catch (...) {
      if (!failed_.exchange(true)) error_ = std::current_exception();
    }
  }

  const int thread_, threads_;
  SpinBarrier& barrier_;
  std::exception_ptr& error_;
  std::atomic<bool>& failed_;
};

// What a decode step's attention reads besides its layer: positions, KV slots, the table.
struct StepInputs {
  const torch::Tensor &positions, &out_cache_loc, &req_to_token, &req_rows, &seq_lens,
      &key_starts, &order;
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window, torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        sliding_window_(sliding_window),
        cos_(std::move(cos)),
        sin_(std::move(sin)),
        final_norm_(std::move(final_norm)) {}

  // Linears are given as (kind, weight, scales, mins, bias) tuples, unused parts None.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, py::tuple qkv, py::tuple o,
                 py::tuple gate_up, py::tuple down, torch::Tensor k_buf, torch::Tensor v_buf,
                 int64_t dense_rows, int64_t amx_rows) {
    auto make = [&](const py::tuple& t) { return linear(t, dense_rows, amx_rows); };
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), make(qkv), make(o),
                            make(gate_up), make(down), std::move(k_buf), std::move(v_buf)});
  }

  // Whether a step of `tokens` tokens runs as one parallel region: every linear layer splits
  // at that many rows (quantized below its dense threshold, AMX up to its most rows).
  bool runs_in_one_region(int64_t tokens) const {
    return omp_get_max_threads() > 1 &&
           std::all_of(layers_.begin(), layers_.end(), [&](const Layer& l) { return l.splits(tokens); });
  }

  // residual: the embeddings of the batch's tokens [batch, hidden] (consumed: it is the
  // residual stream). Returns the final norm's output [batch, hidden].
  torch::Tensor forward(torch::Tensor residual, torch::Tensor positions, torch::Tensor out_cache_loc,
                        torch::Tensor req_to_token, torch::Tensor req_rows, torch::Tensor seq_lens,
                        torch::Tensor key_starts, torch::Tensor order) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack has no layers");
    const int64_t tokens = residual.size(0);
    const StepInputs in{positions, out_cache_loc, req_to_token, req_rows, seq_lens, key_starts, order};
    if (runs_in_one_region(tokens)) return forward_in_one_region(residual, in);
    auto hidden = rms_norm(residual, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto qkv = layer.qkv(hidden);
      auto attn_out = layer.o(attention(layer, qkv, in));
      hidden = add_rms_norm(attn_out, residual, layer.post_norm, eps_);
      auto mlp_out = layer.down(layer.gate_up.activation(layer.gate_up(hidden)));
      const auto& next_norm = i + 1 == layers_.size() ? final_norm_ : layers_[i + 1].input_norm;
      hidden = add_rms_norm(mlp_out, residual, next_norm, eps_);
    }
    return hidden;
  }

 private:
  // RoPE on q and k of the fused QKV output, k and v into the pool; returns the decode
  // attention of q, to run (its output [tokens, num_heads, head_dim]).
  std::unique_ptr<SplitWork> prepare_attention(const Layer& layer, const torch::Tensor& qkv,
                                               const StepInputs& in) const {
    const int64_t tokens = qkv.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    auto q = parts[0].view({tokens, num_heads_, head_dim_});
    auto k = parts[1].view({tokens, num_kv_heads_, head_dim_});
    auto v = parts[2].view({tokens, num_kv_heads_, head_dim_});
    rope_(q, k, in.positions, cos_, sin_);
    store_rows(layer.k_buf, k, in.out_cache_loc);
    store_rows(layer.v_buf, v, in.out_cache_loc);
    return prepare_decode_attention(q.contiguous(), layer.k_buf, layer.v_buf, in.req_to_token,
                                    in.req_rows, in.seq_lens, in.key_starts, in.order, scale_,
                                    sliding_window_);
  }

  // [tokens, num_heads * head_dim]
  torch::Tensor attention(const Layer& layer, const torch::Tensor& qkv, const StepInputs& in) const {
    auto work = prepare_attention(layer, qkv, in);
#pragma omp parallel
    work->run(omp_get_thread_num(), omp_get_num_threads());
    return work->output().view({qkv.size(0), num_heads_ * head_dim_});
  }

  // `forward` through quantized or AMX layers, as one parallel region (see the top of the
  // file): the same kernels in the same order, so the same results.
  torch::Tensor forward_in_one_region(torch::Tensor residual, const StepInputs& in) {
    torch::Tensor hidden;
    std::unique_ptr<SplitWork> work;  // the linear layer or attention the threads run next
    std::exception_ptr error;
    std::atomic<bool> failed{false};
    const int threads = omp_get_max_threads();
    SpinBarrier barrier(threads);
#pragma omp parallel num_threads(threads)
    {
      // A region inside a caller's may get fewer threads than asked: then one does it all.
      const int thread = omp_get_thread_num();
      const bool whole = omp_get_num_threads() == threads;
      SpinBarrier solo(1);
      RegionSteps steps(whole ? thread : 0, whole ? threads : 1, whole ? barrier : solo, error,
                        failed);
      if (whole || thread == 0) {
        steps.serial([&] {
          hidden = rms_norm(residual, layers_[0].input_norm, eps_);
          work = layers_[0].qkv.prepare(hidden);
        });
        for (size_t i = 0; i < layers_.size(); ++i) {
          const Layer& layer = layers_[i];
          steps.split(work);
          steps.serial([&] { work = prepare_attention(layer, layer.qkv.finish(*work), in); });
          steps.split(work);
          steps.serial([&] {
            const int64_t tokens = residual.size(0);
            work = layer.o.prepare(work->output().view({tokens, num_heads_ * head_dim_}));
          });
          steps.split(work);
          steps.serial([&] {
            hidden = add_rms_norm(layer.o.finish(*work), residual, layer.post_norm, eps_);
            work = layer.gate_up.prepare(hidden);
          });
          steps.split(work);
          steps.serial([&] {
            work = layer.down.prepare(layer.gate_up.activation(layer.gate_up.finish(*work)));
          });
          steps.split(work);
          steps.serial([&] {
            const bool last = i + 1 == layers_.size();
            hidden = add_rms_norm(layer.down.finish(*work), residual,
                                  last ? final_norm_ : layers_[i + 1].input_norm, eps_);
            if (!last) work = layers_[i + 1].qkv.prepare(hidden);
          });
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return hidden;
  }

  static Linear linear(const py::tuple& t, int64_t dense_rows, int64_t amx_rows) {
    TORCH_CHECK(t.size() == 5, "a linear is (kind, weight, scales, mins, bias)");
    auto tensor = [&](size_t i) {
      return t[i].is_none() ? torch::Tensor() : t[i].cast<torch::Tensor>();
    };
    Linear l{t[0].cast<std::string>(), tensor(1), tensor(2), tensor(3), tensor(4), dense_rows,
             amx_rows};
    TORCH_CHECK(l.kind == "dense" || l.kind == "amx" || l.kind == "q8_0" || l.kind == "q4_1" ||
                    l.kind == "w8a8" || l.gated(),
                "unknown linear kind ", l.kind);
    return l;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t sliding_window_;
  torch::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
};

void register_decode_stack(py::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor, torch::Tensor,
                    torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("runs_in_one_region", &DecodeStack::runs_in_one_region)
      .def("forward", &DecodeStack::forward);
}
