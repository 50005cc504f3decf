// prime_ac's dispatch-key interceptor (prime_ac/intercept.py): the C++ half of an eager
// checkpointed region.
//
// A region includes the key CustomRNGKeyId in its thread's dispatch key set while it runs. The
// key falls through for every operator except those given a gate here: operators a policy can
// keep and operators that write an argument. A gate looks the operator up in the region's table
// of action codes (filled by prime_ac/contexts.py) and hands the call to the region's Python
// handler only when the code needs a decision; otherwise it runs the operator below the key with
// the key excluded, in C++. So an operator nobody decides about costs nothing, one a policy could
// keep but this region runs costs a table lookup, and Python sees only the calls it acts on.
//
// Python, LibTorch and pybind11 API: the library is built per torch release and Python version.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

constexpr auto kKey = c10::DispatchKey::CustomRNGKeyId;

// Action codes of prime_ac/contexts.py that C++ tells apart; any other code above a region's
// limit goes to the Python handler.
constexpr int kUnknown = -1;
constexpr int kRun = 1;
constexpr int kWrite = 2;
constexpr int kKeep = 3;

// What a gate does with a call.
enum class Route { kBelow, kHandler, kKept };

void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

c10::OperatorHandle find_op(const std::string& name, const std::string& overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

// The action code of each operator under one policy (a prime_ac Rules). Written from Python,
// read by gates on any thread.
class Table {
 public:
  void set(const std::string& name, const std::string& overload, int code) {
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    if (!op) {  // the operator's definition went away (its Library was deleted)
      return;
    }
    std::unique_lock lock(mutex_);
    codes_[*op] = static_cast<int8_t>(code);
  }

  int code(const c10::OperatorHandle& op) const {
    std::shared_lock lock(mutex_);
    auto it = codes_.find(op);
    return it == codes_.end() ? kUnknown : it->second;
  }

 private:
  mutable std::shared_mutex mutex_;
  std::unordered_map<c10::OperatorHandle, int8_t> codes_;
};

const void* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// One side of a region (the forward, or its recompute) on one thread. Codes up to RUN, and up to
// WRITE in the recompute, run below the key in C++; so do writes in the forward, unless they hit
// a storage that holds a kept result, which Python copies first.
class Region {
 public:
  Region(std::shared_ptr<Table> table, bool recompute, py::object handle, py::object kept)
      : table_(std::move(table)),
        recompute_(recompute),
        limit_(recompute ? kWrite : kRun),
        handle_(std::move(handle)),
        kept_(std::move(kept)) {}

  void enter() {
    prior_ = current_;
    current_ = this;
    prior_included_ = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
  }

  void exit() {
    c10::impl::tls_set_dispatch_key_included(kKey, prior_included_);
    current_ = prior_;
    held_.clear();
  }

  void hold(uintptr_t storage) {
    held_.insert(reinterpret_cast<const void*>(storage));
  }

  static Region* current() {
    return current_;
  }

  // handle(op, args, kwargs) -> out: the whole call, for codes C++ does not act on.
  const py::object& handle() const {
    return handle_;
  }

  // The forward: kept(op, out) after the call ran, with out detached. The recompute:
  // kept(op) -> the kept result, or NotImplemented to run the call.
  const py::object& kept() const {
    return kept_;
  }

  bool recomputes() const {
    return recompute_;
  }

  Route route(const c10::OperatorHandle& op, const torch::jit::Stack& stack) const {
    const int code = table_->code(op);
    if (code == kKeep) {
      return Route::kKept;
    }
    if (code == kUnknown) {
      return Route::kHandler;
    }
    if (code <= limit_ || (code == kWrite && !writes_held_storage(op, stack))) {
      return Route::kBelow;
    }
    return Route::kHandler;
  }

 private:
  bool writes_held_storage(const c10::OperatorHandle& op, const torch::jit::Stack& stack) const {
    if (held_.empty()) {
      return false;
    }
    const auto& arguments = op.schema().arguments();
    const auto values = torch::jit::last(stack, arguments.size());
    bool known = false;
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto* alias = arguments[i].alias_info();
      if (alias == nullptr || !alias->isWrite()) {
        continue;
      }
      known = true;
      const auto& value = values[i];
      if (value.isTensor() && held_.count(storage_of(value.toTensor()))) {
        return true;
      }
      if (value.isTensorList()) {
        for (const auto& t : value.toTensorVector()) {
          if (held_.count(storage_of(t))) {
            return true;
          }
        }
      }
    }
    return !known;  // a write the schema does not place: Python checks every argument
  }

  std::shared_ptr<Table> table_;
  bool recompute_;
  int limit_;
  py::object handle_;
  py::object kept_;
  std::unordered_set<const void*> held_;
  Region* prior_ = nullptr;
  bool prior_included_ = false;
  static thread_local Region* current_;
};

thread_local Region* Region::current_ = nullptr;

// prime_ac's registrations on the key, which last for the process (read and written with the
// GIL held): a gate per decided operator, and a fall-through per composite operator without one.
struct Registrations {
  std::unordered_map<c10::OperatorHandle, py::object> python_ops;  // the gated ones' OpOverloads
  std::unordered_map<c10::OperatorHandle, c10::RegistrationHandleRAII> gates;
  std::unordered_map<std::string, c10::RegistrationHandleRAII> fall_throughs;  // by name
};

Registrations& registrations() {
  static auto* registered = new Registrations();
  return *registered;
}

// The Python value of the returns on top of the stack (as the operator returns them: one value,
// or a tuple), with every tensor detached: a new TensorImpl sharing storage and version counter.
py::object detached_returns(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const auto& returns = schema.returns();
  const auto values = torch::jit::last(stack, returns.size());
  auto detached = [](const c10::IValue& value) -> py::object {
    if (value.isTensor()) {
      const auto& t = value.toTensor();
      return torch::jit::toPyObject(t.defined() ? c10::IValue(t.tensor_data()) : value);
    }
    if (value.isTensorList()) {
      py::list list;
      for (const auto& t : value.toTensorVector()) {
        list.append(torch::jit::toPyObject(t.defined() ? t.tensor_data() : t));
      }
      return list;
    }
    return torch::jit::toPyObject(value);
  };
  if (returns.size() == 1) {
    return detached(values[0]);
  }
  py::tuple out(returns.size());
  for (size_t i = 0; i < returns.size(); ++i) {
    out[i] = detached(values[i]);
  }
  return out;
}

void push_returns(const c10::FunctionSchema& schema, const py::object& out, torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].type()));
    return;
  }
  auto outs = py::reinterpret_borrow<py::tuple>(out);
  for (size_t i = 0; i < returns.size(); ++i) {
    stack->push_back(torch::jit::toIValue(outs[i], returns[i].type()));
  }
}

void call_handler(const Region& region, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  py::gil_scoped_acquire gil;
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  py::list args;
  py::dict kwargs;
  auto values = torch::jit::last(*stack, arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    auto value = torch::jit::toPyObject(values[i]);
    if (arguments[i].kwarg_only()) {
      kwargs[py::str(arguments[i].name())] = std::move(value);
    } else {
      args.append(std::move(value));
    }
  }
  torch::jit::drop(*stack, arguments.size());
  py::object out = region.handle()(registrations().python_ops.at(op), py::tuple(args), kwargs);
  push_returns(schema, out, stack);
}

// A kept operator (code KEEP) without the Python round trip of its arguments: the forward runs
// it here and hands Python only the detached results to store; the recompute asks Python for the
// kept result and runs the call only when told to.
void call_kept(
    const Region& region,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (region.recomputes()) {
    py::gil_scoped_acquire gil;
    py::object out = region.kept()(registrations().python_ops.at(op));
    if (out.ptr() != Py_NotImplemented) {
      torch::jit::drop(*stack, schema.arguments().size());
      push_returns(schema, out, stack);
      return;
    }
    py::gil_scoped_release no_gil;
    run_below(op, keys, stack);
    return;
  }
  run_below(op, keys, stack);
  py::gil_scoped_acquire gil;
  region.kept()(registrations().python_ops.at(op), detached_returns(schema, *stack));
}

void gate(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const Region* region = Region::current();
  const auto route = region == nullptr ? Route::kBelow : region->route(op, *stack);
  if (route == Route::kHandler) {
    call_handler(*region, op, stack);
  } else if (route == Route::kKept) {
    call_kept(*region, op, keys, stack);
  } else {
    run_below(op, keys, stack);
  }
}

c10::RegistrationHandleRAII register_on_key(const c10::OperatorName& name, c10::KernelFunction kernel) {
  return c10::Dispatcher::singleton().registerImpl(
      name, kKey, std::move(kernel), std::nullopt, nullptr, "prime_ac intercept");
}

// Give each operator a gate on the key. It replaces the fall-through (or the composite kernel)
// the operator had there.
void add_gates(const std::vector<std::tuple<std::string, std::string, py::object>>& ops) {
  auto& registered = registrations();
  for (const auto& [name, overload, python_op] : ops) {
    auto op = find_op(name, overload);
    if (registered.gates.count(op)) {
      continue;
    }
    registered.fall_throughs.erase(c10::toString(op.operator_name()));
    registered.gates.emplace(
        op, register_on_key(op.operator_name(), c10::KernelFunction::makeFromBoxedFunction<&gate>()));
    registered.python_ops.emplace(op, python_op);
  }
}

// A CompositeExplicitAutograd(NonFunctional) kernel fills the key's slot of its operator (the key
// counts as a backend for alias keys), so without a kernel of its own there the operator would
// run its composite (for a structured operator: the out= variant plus an allocation) instead of
// its backend kernel. Those operators get an explicit fall-through, unless they have a gate.
void fall_through(const std::vector<std::string>& names) {
  auto& registered = registrations();
  for (const auto& name : names) {
    const auto dot = name.find('.');
    c10::OperatorName op_name(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
    auto op = c10::Dispatcher::singleton().findOp(op_name);
    if ((op && registered.gates.count(*op)) || registered.fall_throughs.count(name)) {
      continue;
    }
    registered.fall_throughs.emplace(
        name, register_on_key(op_name, c10::KernelFunction::makeFallthrough()));
  }
}

py::object current_handle() {
  const Region* region = Region::current();
  return region == nullptr ? py::none() : region->handle();
}

}  // namespace

TORCH_LIBRARY_IMPL(_, CustomRNGKeyId, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Table, std::shared_ptr<Table>>(m, "Table")
      .def(py::init<>())
      .def("set", &Table::set, py::arg("name"), py::arg("overload"), py::arg("code"));
  py::class_<Region>(m, "Region")
      .def(py::init<std::shared_ptr<Table>, bool, py::object, py::object>())
      .def("enter", &Region::enter)
      .def("exit", &Region::exit)
      .def("hold", &Region::hold);
  m.def("add_gates", &add_gates);
  m.def("fall_through", &fall_through);
  m.def("current_handle", &current_handle);
}
