// The GPU side of a collective on CUDA tensors, issued from C++ (hooks/cuda.py is its Python face, and
// _gpu.h its C API for the C all_reduce): CUDA events from a bounded pool recorded around each
// collective, and the NaN/Inf check's float32 sum written by the device straight into a slot of pinned
// host memory (mapped: no copy), followed by an event. poll() reads, without synchronising anything,
// what the GPU has finished; where it was given the records to write (END's fields, NAN's), it writes
// them itself through the ring's producer, without the GIL, and leaves Python nothing to run.
// Device-generic c10 calls only: it builds without CUDA's headers, against any build of torch.
//
//     init(pool, write_record_at_capsule, (GPU_START, NAN_HAS_NAN, NAN_HAS_INF))
//     start(device) -> pair       // `start` recorded on the device's current stream; -1: pool empty
//     end(pair, complete)         // `end` on the current stream; complete(start_ns, end_ns) from poll()
//     end_record(pair, producer, END's 11 fields)   // the same; poll() writes GPU_START and END
//     release(pair)               // back to the pool unpolled (the op failed, or completed on the CPU)
//     device_of(pair) -> device
//     check(tensor, producer, NAN's 11 fields, found) -> bool   // the sum and its mark on the current
//                                 // stream; poll() writes NAN where it is not finite. false: no free slot
//     poll() -> ([(complete, start_ns, end_ns)], [(found, NAN_HAS_* bit)])   // findings only
//
// A NAN record comes before its op's END: a check's mark is recorded before the op's `end`, on the same
// stream or one that waits for it; poll() queries the ends before the marks, and holds back the ends
// issued after a check still pending (another stream's, say) until it has been read.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <tuple>
#include <vector>

#include "_gpu.h"

namespace py = pybind11;

namespace {

using Fields = std::array<unsigned long long, 11>;  // a record as Ring.write takes it, time aside

void (*write_record_at)(PyObject*, const unsigned long long*, uint64_t) = nullptr;
unsigned long long GPU_START = 0, HAS_NAN = 0, HAS_INF = 0;

const c10::impl::DeviceGuardImplInterface* cuda() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

int64_t now_ns() {  // CLOCK_MONOTONIC, as Python's time.monotonic_ns() and the producer's
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What a completed op or check leaves to do: a Python callable to run, or records to write through
// `producer`. The objects are set with the GIL and let go of with it, never under `lock` (a finalizer
// may call back in).
struct Then {
  py::object call;      // complete(start_ns, end_ns), or found(bits)
  py::object producer;  // read as a pointer without the GIL; null: nothing to write
  Fields fields{};      // END's, or NAN's
};

struct Pair {
  c10::Event start{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};  // timing enabled
  c10::Event end{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};
  c10::DeviceIndex device;
  Then then;
  int64_t order = 0;  // of issue of `end`, with the checks
};

struct Reference {  // an event the GPU passed at a known CPU time: converts events' times to the CPU's clock
  std::unique_ptr<c10::Event> event;
  int64_t ns;
};

struct Slot {
  at::Tensor sum;  // the slot's pinned float, as its device sees it
  Then then;
};

struct Check {
  int64_t mark;
  int64_t slot;
  int64_t order;  // of issue, with the pairs' ends
};

// The state lives as long as the process and is never destroyed: at exit, CUDA and Python may be gone
// before static destructors would run (an event destroyed then aborts the process).
std::mutex& lock = *new std::mutex;  // the training threads take and issue, the sidecar's polls
int64_t pool = 0;
std::vector<std::unique_ptr<Pair>>& pairs = *new std::vector<std::unique_ptr<Pair>>;
std::vector<int64_t>& free_pairs = *new std::vector<int64_t>;
std::deque<int64_t>& timed = *new std::deque<int64_t>;  // pairs whose `end` is recorded, in issue order
std::map<c10::DeviceIndex, Reference>& references = *new std::map<c10::DeviceIndex, Reference>;
at::Tensor& pinned = *new at::Tensor;  // one float32 per slot, where the sums land
std::vector<Slot>& slots = *new std::vector<Slot>;
std::vector<int64_t>& free_slots = *new std::vector<int64_t>;
// untimed events: they only say a sum has landed
std::vector<std::unique_ptr<c10::Event>>& marks = *new std::vector<std::unique_ptr<c10::Event>>;
std::vector<int64_t>& free_marks = *new std::vector<int64_t>;
std::deque<Check>& checks = *new std::deque<Check>;
int64_t issued = 0;  // ends and checks so far: their order

void init(int64_t size, py::capsule write_at,
          std::tuple<unsigned long long, unsigned long long, unsigned long long> kinds) {
  void* pointer = PyCapsule_GetPointer(write_at.ptr(), "commlens.ring._producer.write_record_at");
  if (pointer == nullptr) {
    throw py::error_already_set();
  }
  std::lock_guard<std::mutex> guard(lock);
  write_record_at = reinterpret_cast<void (*)(PyObject*, const unsigned long long*, uint64_t)>(pointer);
  std::tie(GPU_START, HAS_NAN, HAS_INF) = kinds;
  pool = size;
}

// The middle of [just before it was recorded, the first moment query() says the GPU passed it], on an
// idle stream: microseconds apart. It polls; it never synchronises.
Reference reference(c10::DeviceIndex device) {
  auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  int64_t before = now_ns();
  event->record(cuda()->getStreamFromGlobalPool(c10::Device(c10::DeviceType::CUDA, device)));
  while (!event->query() && now_ns() < before + 10'000'000) {
  }
  return Reference{std::move(event), (before + now_ns()) / 2};
}

c10::Stream current(c10::DeviceIndex device) {
  return cuda()->getStream(c10::Device(c10::DeviceType::CUDA, device));
}

int64_t start(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> guard(lock);
  if (references.find(device) == references.end()) {
    references.emplace(device, reference(device));
  }
  int64_t pair = -1;
  for (size_t i = free_pairs.size(); i-- > 0;) {  // one of this device's, the last freed first
    if (pairs[free_pairs[i]]->device == device) {
      pair = free_pairs[i];
      free_pairs.erase(free_pairs.begin() + i);
      break;
    }
  }
  if (pair < 0) {
    if (static_cast<int64_t>(pairs.size()) >= pool) {
      return -1;
    }
    pair = pairs.size();
    pairs.push_back(std::make_unique<Pair>());
    pairs.back()->device = device;
  }
  try {
    pairs[pair]->start.record(current(device));
  } catch (...) {
    free_pairs.push_back(pair);
    throw;
  }
  return pair;
}

void finish(int64_t pair, Then then) {
  std::lock_guard<std::mutex> guard(lock);
  Pair& p = *pairs.at(pair);
  p.end.record(current(p.device));
  p.then = std::move(then);  // empty until now: taken by poll() or never set
  p.order = issued++;
  timed.push_back(pair);
}

void end(int64_t pair, py::object complete) {
  finish(pair, Then{std::move(complete), py::object(), {}});
}

void end_record(int64_t pair, py::object producer, Fields fields) {
  finish(pair, Then{py::object(), std::move(producer), fields});
}

c10::DeviceIndex device_of(int64_t pair) {
  std::lock_guard<std::mutex> guard(lock);
  return pairs.at(pair)->device;
}

void release(int64_t pair) {
  std::lock_guard<std::mutex> guard(lock);
  free_pairs.push_back(pair);
}

bool issue_check(const at::Tensor& tensor, Then then) {
  at::Tensor values = tensor.is_complex() ? at::view_as_real(tensor) : tensor;  // no temporary of its size
  c10::DeviceIndex device = tensor.device().index();
  int64_t slot;
  at::Tensor sum;
  {
    std::lock_guard<std::mutex> guard(lock);
    if (!pinned.defined()) {
      pinned = at::empty({pool}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
      for (int64_t free = pool; free-- > 0;) {
        free_slots.push_back(free);
      }
      slots.resize(pool);
    }
    if (free_slots.empty()) {
      return false;
    }
    slot = free_slots.back();
    free_slots.pop_back();
    Slot& s = slots[slot];
    if (!s.sum.defined() || s.sum.device().index() != device) {
      // the slot's pinned float, as the device sees it (unified addressing): the sum's kernel writes it
      s.sum = at::from_blob(pinned.data_ptr<float>() + slot, {},
                            at::TensorOptions().dtype(at::kFloat).device(tensor.device()));
    }
    sum = s.sum;
  }
  try {  // not under the lock: under a dispatch mode or a tensor subclass the sum runs Python, which may
         // hand the GIL to a thread that then waits for the lock
    c10::NoGradGuard no_grad;  // an input that requires grad takes no out= otherwise
    // over every dimension, so that it is the structured sum (sum.IntList_out), which reduces straight
    // into `sum`: the dimensionless sum's out= form sums into a temporary and copies that (a second
    // launch, and an allocation, per check)
    at::Tensor flat = values.dim() == 0 ? values.reshape({1}) : values;
    std::vector<int64_t> dims(flat.dim());
    std::iota(dims.begin(), dims.end(), 0);
    at::sum_out(sum, flat, dims, /*keepdim=*/false, at::kFloat);
  } catch (...) {
    std::lock_guard<std::mutex> guard(lock);
    free_slots.push_back(slot);
    throw;
  }
  std::lock_guard<std::mutex> guard(lock);
  Slot& s = slots[slot];
  int64_t mark;
  if (free_marks.empty()) {
    mark = marks.size();
    marks.push_back(std::make_unique<c10::Event>(c10::DeviceType::CUDA));
  } else {
    mark = free_marks.back();
    free_marks.pop_back();
  }
  marks[mark]->record(current(device));
  s.then = std::move(then);
  checks.push_back(Check{mark, slot, issued++});
  return true;
}

bool check(const at::Tensor& tensor, py::object producer, Fields fields, py::object found) {
  return issue_check(tensor, Then{found.is_none() ? py::object() : std::move(found), std::move(producer), fields});
}

// The polling thread's CUDA graph capture mode, relaxed while it polls: under the default (global) mode
// of a capture begun on another thread, an event query here would be an unsafe call that invalidates
// that capture (PyTorch's NCCL watchdog relaxes its own thread for the same reason). The runtime's call
// is found where torch loaded it (no CUDA headers here); without it, nothing changes.
class RelaxedCapture {
 public:
  RelaxedCapture() : relaxed_(exchange() != nullptr && exchange()(&mode_) == 0) {}
  ~RelaxedCapture() {
    if (relaxed_) {
      exchange()(&mode_);  // the thread's mode back
    }
  }

 private:
  using Exchange = int (*)(int*);  // cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*)
  static Exchange exchange() {
    static const Exchange found = [] {
      void* symbol = dlsym(RTLD_DEFAULT, "cudaThreadExchangeStreamCaptureMode");
      for (const char* library : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) {
        void* loaded = symbol == nullptr ? dlopen(library, RTLD_LAZY | RTLD_NOLOAD) : nullptr;
        symbol = loaded == nullptr ? symbol : dlsym(loaded, "cudaThreadExchangeStreamCaptureMode");
      }
      return reinterpret_cast<Exchange>(symbol);
    }();
    return found;
  }
  int mode_ = 2;  // cudaStreamCaptureModeRelaxed
  bool relaxed_;
};

py::tuple poll() {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> done;  // (pair, start_ns, end_ns)
  std::vector<std::tuple<int64_t, int64_t, unsigned long long>> sums;  // (slot, mark, NAN_HAS_* bit or 0)
  {
    py::gil_scoped_release released;  // the training thread issues meanwhile
    RelaxedCapture relaxed;
    std::lock_guard<std::mutex> guard(lock);
    size_t ended = 0;  // the ends first: every mark before them has then been passed too
    while (ended < timed.size() && pairs[timed[ended]]->end.query()) {
      ended++;
    }
    while (!checks.empty() && marks[checks.front().mark]->query()) {
      Check c = checks.front();
      checks.pop_front();
      float value = pinned.data_ptr<float>()[c.slot];  // host memory: no device synchronisation
      unsigned long long bit = std::isnan(value) ? HAS_NAN : std::isinf(value) ? HAS_INF : 0;
      Then& then = slots[c.slot].then;
      if (bit && then.producer) {
        Fields nan = then.fields;
        nan[2] |= bit;
        write_record_at(then.producer.ptr(), nan.data(), now_ns());
      }
      sums.emplace_back(c.slot, c.mark, bit);
    }
    // an op's check is issued before its end: no end issued after a check still pending is written yet
    int64_t pending = checks.empty() ? INT64_MAX : checks.front().order;
    for (; ended > 0 && pairs[timed.front()]->order < pending; ended--) {
      int64_t pair = timed.front();
      timed.pop_front();
      Pair& p = *pairs[pair];
      const Reference& r = references.at(p.device);
      int64_t start_ns = r.ns + static_cast<int64_t>(r.event->elapsedTime(p.start) * 1e6);
      int64_t end_ns = r.ns + static_cast<int64_t>(r.event->elapsedTime(p.end) * 1e6);
      if (p.then.producer) {
        Fields gpu_start = p.then.fields;  // END's op fields, with GPU_START's kind and no status or aux
        gpu_start[0] = GPU_START;
        gpu_start[2] = gpu_start[9] = gpu_start[10] = 0;
        write_record_at(p.then.producer.ptr(), gpu_start.data(), start_ns);
        write_record_at(p.then.producer.ptr(), p.then.fields.data(), end_ns);
      }
      done.emplace_back(pair, start_ns, end_ns);
    }
  }
  // with the GIL again: what Python must run or let go of taken out, the slots and pairs freed (not
  // before: reused at once), and only then, the lock released, the objects let go of
  std::vector<Then> finished;
  finished.reserve(sums.size() + done.size());
  py::list completed, found;
  {
    std::lock_guard<std::mutex> guard(lock);
    for (auto& [slot, mark, bit] : sums) {
      finished.push_back(std::move(slots[slot].then));
      free_slots.push_back(slot);
      free_marks.push_back(mark);
    }
    for (auto& [pair, start_ns, end_ns] : done) {
      finished.push_back(std::move(pairs[pair]->then));
      free_pairs.push_back(pair);
    }
  }
  for (size_t i = 0; i < sums.size(); i++) {
    if (finished[i].call && std::get<2>(sums[i])) {
      found.append(py::make_tuple(finished[i].call, std::get<2>(sums[i])));
    }
  }
  for (size_t i = 0; i < done.size(); i++) {
    Then& then = finished[sums.size() + i];
    if (then.call) {
      completed.append(py::make_tuple(then.call, std::get<1>(done[i]), std::get<2>(done[i])));
    }
  }
  return py::make_tuple(completed, found);
}

// The C API (_gpu.h): the calls above for C callers, Python's errors as exceptions set.
template <typename F>
int guarded(F f) {
  try {
    return f();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return -1;
}

using Signed = std::array<int64_t, 11>;  // Python's fields: the peer may be -1

Fields unsigned_of(const Signed& v) {
  Fields fields;
  std::transform(v.begin(), v.end(), fields.begin(), [](int64_t x) { return static_cast<unsigned long long>(x); });
  return fields;
}

Fields fields_of(const unsigned long long* v) {
  Fields fields;
  std::copy(v, v + fields.size(), fields.begin());
  return fields;
}

const commlens_gpu_api api = {
    [](int device) -> int64_t {
      int64_t pair = -2;
      guarded([&] {
        pair = start(static_cast<c10::DeviceIndex>(device));
        return 0;
      });
      return pair;
    },
    [](int64_t pair, PyObject* producer, const unsigned long long* v) {
      return guarded([&] {
        end_record(pair, py::reinterpret_borrow<py::object>(producer), fields_of(v));
        return 0;
      });
    },
    [](PyObject* tensor, PyObject* producer, const unsigned long long* v, PyObject* found) {
      return guarded([&] {
        return check(py::handle(tensor).cast<at::Tensor>(), py::reinterpret_borrow<py::object>(producer),
                            fields_of(v), py::reinterpret_borrow<py::object>(found)) ? 1 : 0;
      });
    },
    [](int64_t pair) {
      try {
        release(pair);
      } catch (...) {  // out of memory growing the free list: the pair is lost, nothing else
      }
    },
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("start", &start);
  m.def("end", &end);
  m.def("end_record", [](int64_t pair, py::object producer, Signed fields) {
    end_record(pair, std::move(producer), unsigned_of(fields));
  });
  m.def("release", &release);
  m.def("device_of", &device_of);
  m.def("check", [](const at::Tensor& tensor, py::object producer, Signed fields, py::object found) {
    return check(tensor, std::move(producer), unsigned_of(fields), std::move(found));
  });
  m.def("poll", &poll);
  m.attr("api") = py::capsule(const_cast<commlens_gpu_api*>(&api), COMMLENS_GPU_API);
}
