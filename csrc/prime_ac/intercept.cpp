// prime_ac's dispatch-key interceptor (prime_ac/intercept.py): what every operator that prime_ac
// does not decide about does on the key CustomRNGKeyId.
//
// A checkpointed region includes the key in its thread's dispatch key set. Operators prime_ac
// decides about have Python kernels on the key; every other operator lands here and runs below
// the key with the key excluded, so the operators it calls internally skip the key too: a
// region sees exactly the calls a TorchDispatchMode would see, at a fraction of a microsecond
// per operator instead of a Python round trip. Full LibTorch API (the stable ABI has no
// fallbacks or dispatch key guards), so the library is built per torch release.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr auto kKey = c10::DispatchKey::CustomRNGKeyId;

void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

// A CompositeExplicitAutograd kernel fills the key's slot of its operator (the key counts as a
// backend for alias keys) and would run with the key still included: those operators get
// run_below as their kernel on the key. Registrations last for the process.
void run_below_for(std::vector<std::string> names) {
  static std::unordered_map<std::string, std::unique_ptr<torch::Library>> libraries;
  for (const auto& name : names) {
    const auto ns = name.substr(0, name.find("::"));
    auto& library = libraries[ns];
    if (!library) {
      library = std::make_unique<torch::Library>(
          torch::Library::IMPL, ns, kKey, __FILE__, __LINE__);
    }
    library->impl(
        name.substr(ns.size() + 2).c_str(),
        torch::CppFunction::makeFromBoxedFunction<&run_below>());
  }
}

}  // namespace

TORCH_LIBRARY(prime_ac_intercept, m) {
  m.def("run_below_for(str[] names) -> ()", &run_below_for);
}

TORCH_LIBRARY_IMPL(_, CustomRNGKeyId, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_below>());
}
