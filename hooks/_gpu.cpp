// The GPU side of a collective on CUDA tensors, issued from C++ (hooks/cuda.py is its Python face):
// CUDA events from a bounded pool recorded around each collective, and the NaN/Inf check's float32 sum
// written by the device straight into a slot of pinned host memory (mapped: no copy), followed by an
// event. poll() reads, without synchronising anything, what the GPU has finished. Device-generic c10
// calls only: it builds without CUDA's headers, against any build of torch.
//
//     init(pool)                  // pairs of timing events, pinned slots and marks: at most `pool` each
//     start(device) -> pair       // `start` recorded on the device's current stream; -1: pool empty
//     end(pair, complete)         // `end` on the current stream; polled from now on
//     release(pair)               // back to the pool unpolled (the op failed, or completed on the CPU)
//     device_of(pair) -> device
//     check(tensor, report) -> bool   // the sum and its mark on the current stream; false: no free slot
//     poll() -> ([(complete, start_ns, end_ns)], [(report, verdict)])   // verdict: 1 NaN, 2 Inf, 0 finite
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

const c10::impl::DeviceGuardImplInterface* cuda() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

int64_t now_ns() {  // CLOCK_MONOTONIC, as Python's time.monotonic_ns()
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Pair {
  c10::Event start{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};  // timing enabled
  c10::Event end{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};
  c10::DeviceIndex device;
  py::object complete;  // set and taken with the GIL held
};

struct Reference {  // an event the GPU passed at a known CPU time: converts events' times to the CPU's clock
  std::unique_ptr<c10::Event> event;
  int64_t ns;
};

struct Check {
  int64_t mark;
  int64_t slot;
};

std::vector<py::object> reports;  // by slot; set and taken with the GIL held

std::mutex lock;  // the training threads take and issue, the sidecar's polls
int64_t pool = 0;
std::vector<std::unique_ptr<Pair>> pairs;
std::vector<int64_t> free_pairs;
std::deque<int64_t> timed;  // pairs whose `end` is recorded, in issue order
std::map<c10::DeviceIndex, Reference> references;
at::Tensor pinned;  // one float32 per slot, where the sums land
std::vector<at::Tensor> slots;
std::vector<int64_t> free_slots;
std::vector<std::unique_ptr<c10::Event>> marks;  // no timing: they only say the sum has landed
std::vector<int64_t> free_marks;
std::deque<Check> checks;

void init(int64_t size) {
  std::lock_guard<std::mutex> guard(lock);
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
  pairs[pair]->start.record(current(device));
  return pair;
}

void end(int64_t pair, py::object complete) {
  std::lock_guard<std::mutex> guard(lock);
  pairs.at(pair)->end.record(current(pairs[pair]->device));
  pairs[pair]->complete = std::move(complete);
  timed.push_back(pair);
}

c10::DeviceIndex device_of(int64_t pair) {
  std::lock_guard<std::mutex> guard(lock);
  return pairs.at(pair)->device;
}

void release(int64_t pair) {
  std::lock_guard<std::mutex> guard(lock);
  free_pairs.push_back(pair);
}

bool check(const at::Tensor& tensor, py::object report) {
  at::Tensor values = tensor.is_complex() ? at::view_as_real(tensor) : tensor;  // no temporary of its size
  c10::DeviceIndex device = tensor.device().index();
  std::lock_guard<std::mutex> guard(lock);
  if (!pinned.defined()) {
    pinned = at::empty({pool}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    for (int64_t slot = pool; slot-- > 0;) {
      free_slots.push_back(slot);
    }
    slots.resize(pool);
    reports.resize(pool);
  }
  if (free_slots.empty()) {
    return false;
  }
  int64_t slot = free_slots.back();
  free_slots.pop_back();
  if (!slots[slot].defined() || slots[slot].device().index() != device) {
    // the slot's pinned float, as the device sees it (unified addressing): the sum's kernel writes it
    slots[slot] = at::from_blob(pinned.data_ptr<float>() + slot, {},
                                at::TensorOptions().dtype(at::kFloat).device(tensor.device()));
  }
  at::sum_out(slots[slot], values, at::kFloat);
  int64_t mark;
  if (free_marks.empty()) {
    mark = marks.size();
    marks.push_back(std::make_unique<c10::Event>(c10::DeviceType::CUDA));
  } else {
    mark = free_marks.back();
    free_marks.pop_back();
  }
  marks[mark]->record(current(device));
  reports[slot] = std::move(report);
  checks.push_back(Check{mark, slot});
  return true;
}

py::tuple poll() {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> done;  // (pair, start_ns, end_ns)
  std::vector<std::tuple<int64_t, int64_t, int>> found;     // (slot, mark, verdict)
  {
    py::gil_scoped_release released;  // the training thread issues meanwhile
    std::lock_guard<std::mutex> guard(lock);
    while (!checks.empty() && marks[checks.front().mark]->query()) {
      Check c = checks.front();
      checks.pop_front();
      float value = pinned.data_ptr<float>()[c.slot];  // host memory: no device synchronisation
      found.emplace_back(c.slot, c.mark, std::isnan(value) ? 1 : std::isinf(value) ? 2 : 0);
    }
    while (!timed.empty() && pairs[timed.front()]->end.query()) {
      int64_t pair = timed.front();
      timed.pop_front();
      Pair& p = *pairs[pair];
      const Reference& r = references.at(p.device);
      done.emplace_back(pair, r.ns + static_cast<int64_t>(r.event->elapsedTime(p.start) * 1e6),
                        r.ns + static_cast<int64_t>(r.event->elapsedTime(p.end) * 1e6));
    }
  }
  // with the GIL again: the callbacks taken, then the slots and pairs freed (not before: reused at once)
  py::list completed, checked;
  std::lock_guard<std::mutex> guard(lock);
  for (auto& [slot, mark, verdict] : found) {
    checked.append(py::make_tuple(std::move(reports[slot]), verdict));
    reports[slot] = py::object();
    free_slots.push_back(slot);
    free_marks.push_back(mark);
  }
  for (auto& [pair, start_ns, end_ns] : done) {
    completed.append(py::make_tuple(std::move(pairs[pair]->complete), start_ns, end_ns));
    pairs[pair]->complete = py::object();
    free_pairs.push_back(pair);
  }
  return py::make_tuple(completed, checked);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("start", &start);
  m.def("end", &end);
  m.def("release", &release);
  m.def("device_of", &device_of);
  m.def("check", &check);
  m.def("poll", &poll);
}
