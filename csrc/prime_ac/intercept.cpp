// prime_ac's dispatch-key interceptor (prime_ac/intercept.py): the C++ half of an eager
// checkpointed region.
//
// A region includes the key CustomRNGKeyId in its thread's dispatch key set while it runs. The
// key falls through for every operator except those given a gate here: operators a policy can
// keep and operators that write an argument. A gate looks the operator up in the region's table
// of action codes (filled by prime_ac/contexts.py) and
//   - runs it below the key with the key excluded when the region just runs it;
//   - keeps its results in the region's Store (forward), or hands them back (recompute), for an
//     operator kept every call, all in C++;
//   - hands the call to the region's Python handler for everything else: decisions per call
//     (budget plans, scopes, host syncs), kept operators that write, and writes to a storage that
//     holds a kept result (Python copies the kept result first).
// So an operator nobody decides about costs nothing, one a policy could keep but this region runs
// costs a table lookup, and Python sees only the calls it acts on.
//
// Python, LibTorch and pybind11 API: the library is built per torch release and Python version.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <memory>
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

void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

c10::OperatorHandle find_op(const std::string& name, const std::string& overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

const void* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

template <typename F>
void for_each_tensor(const c10::IValue& value, F&& f) {
  if (value.isTensor()) {
    f(value.toTensor());
  } else if (value.isTensorList()) {
    for (const auto& t : value.toTensorVector()) {
      f(t);
    }
  }
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

// Why the recompute cannot have a kept result (contexts.RegionCache.error builds the message).
enum class Refusal { kNone, kMismatch, kConsumed, kMutated };

// The results one region keeps for operators kept every call, and the storages its forward must
// watch for writes (these, and those of the results Python keeps). A kept tensor is detached: a
// new TensorImpl sharing storage and version counter, so a later in-place write shows.
class Store {
 public:
  void keep(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
    const auto& returns = op.schema().returns();
    Kept kept;
    for (const auto& value : torch::jit::last(stack, returns.size())) {
      if (value.isTensor()) {
        kept.values.emplace_back(detached(value.toTensor()));
      } else if (value.isTensorList()) {
        std::vector<at::Tensor> list;
        for (const auto& t : value.toTensorVector()) {
          list.push_back(detached(t));
        }
        kept.values.emplace_back(std::move(list));
      } else {
        kept.values.push_back(value);
      }
      for_each_tensor(kept.values.back(), [&](const at::Tensor& t) {
        kept.versions.push_back(t.defined() ? t._version() : 0);
        if (const auto* storage = storage_of(t)) {
          held_.insert(storage);
        }
      });
    }
    kept_[op].push_back(std::move(kept));
    ++stored;
  }

  // The recompute's next call of `op`: pushes the kept results and returns kNone, or returns why
  // it cannot (ran: the calls the forward made); `run` says the call simply runs.
  Refusal take(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      size_t* index,
      size_t* ran,
      bool* run) {
    *index = calls_[op]++;
    auto it = kept_.find(op);
    *run = it == kept_.end();  // this operator kept nothing here: an extra call changes nothing
    if (*run) {
      return Refusal::kNone;
    }
    *ran = it->second.size();
    if (*index >= *ran) {
      return Refusal::kMismatch;
    }
    auto& kept = it->second[*index];
    if (kept.consumed) {
      return Refusal::kConsumed;
    }
    size_t i = 0;
    bool mutated = false;
    for (const auto& value : kept.values) {
      for_each_tensor(value, [&](const at::Tensor& t) {
        mutated |= t.defined() && t._version() != kept.versions[i];
        ++i;
      });
    }
    if (mutated) {
      return Refusal::kMutated;
    }
    for (auto& value : kept.values) {
      stack->push_back(std::move(value));
    }
    kept.values.clear();
    kept.consumed = true;
    ++hits;
    return Refusal::kNone;
  }

  void start_recompute() {
    calls_.clear();
  }

  void hold(uintptr_t storage) {
    held_.insert(reinterpret_cast<const void*>(storage));
  }

  void release_all() {
    held_.clear();
  }

  bool holds(const at::Tensor& t) const {
    return held_.count(storage_of(t)) > 0;
  }

  bool holds_any() const {
    return !held_.empty();
  }

  // Replace every kept tensor on `storage` by `copy(tensor)` (prime_ac/contexts.py's copy, before
  // a write to it). The storage is no longer watched: Python drops it too.
  void copy_before_write(uintptr_t storage, const py::function& copy) {
    const auto* target = reinterpret_cast<const void*>(storage);
    auto replace = [&](at::Tensor& t, int64_t& version) {
      if (storage_of(t) == target) {
        t = copy(t).cast<at::Tensor>();
        version = t._version();
      }
    };
    for (auto& [op, calls] : kept_) {
      for (auto& kept : calls) {
        size_t i = 0;
        for (auto& value : kept.values) {
          if (value.isTensor()) {
            auto t = value.toTensor();
            replace(t, kept.versions[i++]);
            value = t;
          } else if (value.isTensorList()) {
            auto list = value.toTensorVector();
            for (auto& t : list) {
              replace(t, kept.versions[i++]);
            }
            value = std::move(list);
          }
        }
      }
    }
    held_.erase(target);
  }

  py::object kept_ops_py() const {
    py::list names;
    for (const auto& [op, calls] : kept_) {
      const auto& name = op.operator_name();
      names.append(py::make_tuple(name.name, name.overload_name));
    }
    return names;
  }

  int64_t stored = 0;
  int64_t hits = 0;

 private:
  struct Kept {
    std::vector<c10::IValue> values;
    std::vector<int64_t> versions;  // one per tensor in values, in order
    bool consumed = false;
  };

  static at::Tensor detached(const at::Tensor& t) {
    return t.defined() ? t.tensor_data() : t;
  }

  std::unordered_map<c10::OperatorHandle, std::vector<Kept>> kept_;
  std::unordered_map<c10::OperatorHandle, size_t> calls_;  // the recompute's calls so far
  std::unordered_set<const void*> held_;
};

// Raise the error Python builds for a kept result the recompute cannot have.
[[noreturn]] void raise_refusal(
    const py::object& refuse,
    Refusal refusal,
    const py::object& op,
    size_t index,
    size_t ran) {
  const char* kinds[] = {"", "mismatch", "consumed", "mutated"};
  py::object error = refuse(kinds[static_cast<int>(refusal)], op, index, ran);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

// What a gate does with a call.
enum class Route { kBelow, kHandler, kKept };

// One side of a region (the forward, or its recompute) on one thread. Codes up to RUN, and up to
// WRITE in the recompute, run below the key; so do writes in the forward, unless they hit a
// storage that holds a kept result.
class Region {
 public:
  Region(
      std::shared_ptr<Table> table,
      std::shared_ptr<Store> store,
      bool recompute,
      py::object handle,
      py::object decide,
      py::object refuse)
      : table_(std::move(table)),
        store_(std::move(store)),
        recompute_(recompute),
        limit_(recompute ? kWrite : kRun),
        handle_(std::move(handle)),
        decide_(std::move(decide)),
        refuse_(std::move(refuse)) {}

  void enter() {
    prior_ = current_;
    current_ = this;
    prior_included_ = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
    if (recompute_) {
      store_->start_recompute();
    }
  }

  void exit() {
    c10::impl::tls_set_dispatch_key_included(kKey, prior_included_);
    current_ = prior_;
  }

  static Region* current() {
    return current_;
  }

  // handle(op, args, kwargs) -> out: the whole call, for codes C++ does not act on.
  const py::object& handle() const {
    return handle_;
  }

  Route route(const c10::OperatorHandle& op, const torch::jit::Stack& stack) const {
    int code = table_->code(op);
    if (code == kUnknown) {  // a gate added after this policy coded its table: ask Python once
      py::gil_scoped_acquire gil;
      code = decide_(python_op(op)).cast<int>();
    }
    if (code == kKeep) {
      return Route::kKept;
    }
    if (code <= limit_ || (code == kWrite && !writes_held_storage(op, stack))) {
      return Route::kBelow;
    }
    return Route::kHandler;
  }

  // An operator kept every call: the forward runs it and keeps its results, the recompute hands
  // them back (or runs the call, or raises the error Python builds).
  void call_kept(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack)
      const {
    if (!recompute_) {
      run_below(op, keys, stack);
      store_->keep(op, *stack);
      return;
    }
    torch::jit::Stack kept;
    size_t index = 0;
    size_t ran = 0;
    bool run = false;
    const auto refusal = store_->take(op, &kept, &index, &ran, &run);
    if (refusal != Refusal::kNone) {
      py::gil_scoped_acquire gil;
      raise_refusal(refuse_, refusal, python_op(op), index, ran);
    }
    if (run) {
      run_below(op, keys, stack);
      return;
    }
    torch::jit::drop(*stack, op.schema().arguments().size());
    for (auto& value : kept) {
      stack->push_back(std::move(value));
    }
  }

  static const py::object& python_op(const c10::OperatorHandle& op);

 private:
  bool writes_held_storage(const c10::OperatorHandle& op, const torch::jit::Stack& stack) const {
    if (!store_->holds_any()) {
      return false;
    }
    const auto& arguments = op.schema().arguments();
    const auto values = torch::jit::last(stack, arguments.size());
    bool known = false;
    bool hit = false;
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto* alias = arguments[i].alias_info();
      if (alias == nullptr || !alias->isWrite()) {
        continue;
      }
      known = true;
      for_each_tensor(values[i], [&](const at::Tensor& t) { hit |= store_->holds(t); });
    }
    return hit || !known;  // a write the schema does not place: Python checks every argument
  }

  std::shared_ptr<Table> table_;
  std::shared_ptr<Store> store_;
  bool recompute_;
  int limit_;
  py::object handle_;
  py::object decide_;
  py::object refuse_;
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

const py::object& Region::python_op(const c10::OperatorHandle& op) {
  return registrations().python_ops.at(op);
}

void push_returns(
    const c10::FunctionSchema& schema,
    const py::object& out,
    torch::jit::Stack* stack) {
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
  py::object out = region.handle()(Region::python_op(op), py::tuple(args), kwargs);
  push_returns(schema, out, stack);
}

void gate(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const Region* region = Region::current();
  const auto route = region == nullptr ? Route::kBelow : region->route(op, *stack);
  if (route == Route::kHandler) {
    call_handler(*region, op, stack);
  } else if (route == Route::kKept) {
    region->call_kept(op, keys, stack);
  } else {
    run_below(op, keys, stack);
  }
}

c10::RegistrationHandleRAII register_on_key(
    const c10::OperatorName& name,
    c10::KernelFunction kernel) {
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
    auto kernel = c10::KernelFunction::makeFromBoxedFunction<&gate>();
    registered.gates.emplace(op, register_on_key(op.operator_name(), std::move(kernel)));
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
    const auto overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    c10::OperatorName op_name(name.substr(0, dot), overload);
    auto op = c10::Dispatcher::singleton().findOp(op_name);
    if ((op && registered.gates.count(*op)) || registered.fall_throughs.count(name)) {
      continue;
    }
    registered.fall_throughs.emplace(
        name, register_on_key(op_name, c10::KernelFunction::makeFallthrough()));
  }
}

// The recompute's next kept result for `op` as Python (for a dispatch mode that sees the call
// first), or NotImplemented when the call runs; raises like a gate.
py::object take(
    Store& store,
    const std::string& name,
    const std::string& overload,
    const py::object& python_op,
    const py::object& refuse) {
  auto op = find_op(name, overload);
  torch::jit::Stack kept;
  size_t index = 0;
  size_t ran = 0;
  bool run = false;
  const auto refusal = store.take(op, &kept, &index, &ran, &run);
  if (refusal != Refusal::kNone) {
    raise_refusal(refuse, refusal, python_op, index, ran);
  }
  if (run) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  if (kept.size() == 1) {
    return torch::jit::toPyObject(std::move(kept[0]));
  }
  py::tuple out(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    out[i] = torch::jit::toPyObject(std::move(kept[i]));
  }
  return out;
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
  py::class_<Store, std::shared_ptr<Store>>(m, "Store")
      .def(py::init<>())
      .def("hold", &Store::hold)
      .def("release_all", &Store::release_all)
      .def("copy_before_write", &Store::copy_before_write)
      .def("kept_ops", &Store::kept_ops_py)
      .def("take", &take)
      .def_readonly("stored", &Store::stored)
      .def_readonly("hits", &Store::hits);
  py::class_<Region>(m, "Region")
      .def(py::init<
           std::shared_ptr<Table>,
           std::shared_ptr<Store>,
           bool,
           py::object,
           py::object,
           py::object>())
      .def("enter", &Region::enter)
      .def("exit", &Region::exit);
  m.def("add_gates", &add_gates);
  m.def("fall_through", &fall_through);
  m.def("current_handle", &current_handle);
}
