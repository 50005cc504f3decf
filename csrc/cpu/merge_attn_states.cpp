// Attention-state merge on CPU: prime_rl::merge_attn_states and its backward.
//
// Two partial attention results over disjoint key sets, (out_a, lse_a) and (out_b, lse_b), merge
// into the result over their union: lse = logaddexp(lse_a, lse_b) and
// out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b. Rows where both lse are -inf (no
// key seen yet) give lse = -inf and out = 0. Layout: out [T, H, D], lse [H, T].
#include "../checks.h"

#include <cmath>
#include <tuple>

namespace prime_ops {
namespace {

// The merged lse and the two weights, computed exactly as torch.logaddexp and a masked exp do.
template <typename acc>
inline void weights(acc la, acc lb, acc* lse, acc* wa, acc* wb) {
  if (std::isinf(la) && la == lb) {
    *lse = la;
  } else {
    *lse = std::max(la, lb) + std::log1p(std::exp(-std::abs(la - lb)));
  }
  const acc finite = *lse == -INFINITY ? acc(0) : *lse;
  *wa = std::exp(la - finite);
  *wb = std::exp(lb - finite);
}

std::tuple<Tensor, Tensor> merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b,
                                             Tensor lse_b) {
  check_merge(out_a, lse_a, out_b, lse_b);
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  Tensor out = allocate(out_a, {tokens, heads, dim}, out_a.scalar_type(), "out");
  Tensor lse = allocate(lse_a, {heads, tokens}, lse_a.scalar_type(), "lse");
  dispatch_floating(out_a.scalar_type(), "out_a", [&](auto s) {
    using scalar_t = decltype(s);
    using acc = acc_t<scalar_t>;
    const scalar_t* oa = out_a.const_data_ptr<scalar_t>();
    const scalar_t* ob = out_b.const_data_ptr<scalar_t>();
    const acc* la = lse_a.const_data_ptr<acc>();
    const acc* lb = lse_b.const_data_ptr<acc>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    acc* l = lse.mutable_data_ptr<acc>();
    torch::stable::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          acc wa, wb;
          weights(la[h * tokens + t], lb[h * tokens + t], &l[h * tokens + t], &wa, &wb);
          const int64_t row = (t * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            const acc pa = wa * static_cast<acc>(oa[row + d]);
            const acc pb = wb * static_cast<acc>(ob[row + d]);
            o[row + d] = static_cast<scalar_t>(pa + pb);
          }
        }
      }
    });
  });
  return {out, lse};
}

// d out_x = g * w_x; d lse_x = w_x * (<g, out_x - out> + g_lse), with out the unrounded merge.
std::tuple<Tensor, Tensor, Tensor, Tensor> merge_attn_states_backward(
    Tensor grad_out, std::optional<Tensor> grad_lse, Tensor out_a, Tensor lse_a, Tensor out_b,
    Tensor lse_b) {
  check_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b);
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  const ScalarType type = out_a.scalar_type(), acc_type = lse_a.scalar_type();
  Tensor grad_oa = allocate(out_a, {tokens, heads, dim}, type, "grad_out_a");
  Tensor grad_ob = allocate(out_b, {tokens, heads, dim}, type, "grad_out_b");
  Tensor grad_la = allocate(lse_a, {heads, tokens}, acc_type, "grad_lse_a");
  Tensor grad_lb = allocate(lse_b, {heads, tokens}, acc_type, "grad_lse_b");
  dispatch_floating(out_a.scalar_type(), "out_a", [&](auto s) {
    using scalar_t = decltype(s);
    using acc = acc_t<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const acc* gl = grad_lse.has_value() ? grad_lse->const_data_ptr<acc>() : nullptr;
    const scalar_t* oa = out_a.const_data_ptr<scalar_t>();
    const scalar_t* ob = out_b.const_data_ptr<scalar_t>();
    const acc* la = lse_a.const_data_ptr<acc>();
    const acc* lb = lse_b.const_data_ptr<acc>();
    scalar_t* goa = grad_oa.mutable_data_ptr<scalar_t>();
    scalar_t* gob = grad_ob.mutable_data_ptr<scalar_t>();
    acc* gla = grad_la.mutable_data_ptr<acc>();
    acc* glb = grad_lb.mutable_data_ptr<acc>();
    torch::stable::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t i = h * tokens + t;
          acc lse, wa, wb;
          weights(la[i], lb[i], &lse, &wa, &wb);
          const int64_t row = (t * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            const acc gd = static_cast<acc>(g[row + d]);
            goa[row + d] = static_cast<scalar_t>(gd * wa);
            gob[row + d] = static_cast<scalar_t>(gd * wb);
          }
          // <g, out_x - out> with out the unrounded merge
          const auto dot = [&](const scalar_t* x) {
            return lane_sum<acc>(dim, [&](int64_t d) {
              const acc a = static_cast<acc>(oa[row + d]), b = static_cast<acc>(ob[row + d]);
              const acc merged = wa * a + wb * b;
              return static_cast<acc>(g[row + d]) * (static_cast<acc>(x[row + d]) - merged);
            });
          };
          const acc dot_a = dot(oa), dot_b = dot(ob);
          const acc g_lse = gl == nullptr ? acc(0) : gl[i];
          gla[i] = wa * (dot_a + g_lse);
          glb[i] = wb * (dot_b + g_lse);
        }
      }
    });
  });
  return {grad_oa, grad_la, grad_ob, grad_lb};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CPU, m) {
  m.impl("merge_attn_states", TORCH_BOX(&merge_attn_states));
  m.impl("merge_attn_states_backward", TORCH_BOX(&merge_attn_states_backward));
}

}  // namespace prime_ops
