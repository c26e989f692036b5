// DDP's gradient buckets reduced and recorded from C++ (ddp.py, a hookless model on CPU): a
// communication hook of the shape of DDP's built-in allreduce hook (the bucket divided by the group's
// size, then all-reduced) that calls Python once per bucket, on the thread that runs backward, to
// begin its record (pre-hooks, START), and writes END from the reduction's callback on the backend's
// thread without the GIL, through the ring's producer (_producer.c). Taking the GIL on that thread, as
// a Python hook's callback does, cost about 50 µs a bucket. A bucket that failed, or whose post-hooks
// must run, completes in Python. The division is the pass that also tells whether every element is
// finite (float32, float64, bfloat16, float16), so that the NaN check need not make a pass of its own, and the largest
// exponent among them (the bucket's scale, which the sidecar follows: a rank whose gradients grew): the
// pre-hooks see the bucket divided, as the all_reduce gets it. Built against the installed torch on first use
// (extension.py).
//
//     init(issuing_set_capsule, write_record_capsule, write_record_at_capsule)
//     register_hook(reducer, process_group, begin)   // in place of the model's hook (none registered yet)
//         begin(process_group, buffer, index, parameters, is_last, finite: True, False or None (not known),
//               exponent: the largest binary exponent among the finite results, or None)
//             -> None (unrecorded) or (finish, flight, producer or None, END's 11 fields,
//                                          FINGERPRINT's 11 fields but the fingerprint, or None: not due)
//         finish(flight, error message or None)   // with the GIL; when producer is None, or it failed
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <time.h>

#include "_fingerprint.h"
#include "_finite.h"

namespace py = pybind11;

namespace {

int (*set_issuing)(int) = nullptr;
uint64_t (*write_record)(PyObject*, const unsigned long long*) = nullptr;
void (*write_record_at)(PyObject*, const unsigned long long*, uint64_t) = nullptr;

void* pointer_in(const py::capsule& capsule, const char* name) {
  void* pointer = PyCapsule_GetPointer(capsule.ptr(), name);
  if (pointer == nullptr) {
    throw py::error_already_set();
  }
  return pointer;
}

void init(py::capsule issuing_set, py::capsule write, py::capsule write_at) {
  set_issuing = reinterpret_cast<int (*)(int)>(pointer_in(issuing_set, "commlens.hooks._issuing.set"));
  write_record = reinterpret_cast<uint64_t (*)(PyObject*, const unsigned long long*)>(
      pointer_in(write, "commlens.ring._producer.write_record"));
  write_record_at = reinterpret_cast<void (*)(PyObject*, const unsigned long long*, uint64_t)>(
      pointer_in(write_at, "commlens.ring._producer.write_record_at"));
}

// What the hook lets go of only with the GIL, on the thread that runs backward: begin()'s results
// whose END was written without it, and the works it issued. A work holds Python state (the bucket's
// tensor, which Python has seen; backward's context): dropped last on gloo's thread, it would take
// the GIL there, a hand-over per bucket, and abort the process if the interpreter is exiting by then.
struct Kept {
  std::mutex lock;
  std::vector<PyObject*> begun;  // added to by the callbacks, on the backend's thread
  std::vector<c10::intrusive_ptr<c10d::Work>> works;  // runHook's (one bucket at a time) and the destructor's

  // With the GIL: what nobody else holds any more. ``last``: the rest is never let go of.
  void release(bool last) {
    std::vector<PyObject*> written;
    {
      std::lock_guard<std::mutex> guard(lock);
      written.swap(begun);
    }
    for (PyObject* object : written) {
      Py_DECREF(object);
    }
    static auto* never = new std::vector<c10::intrusive_ptr<c10d::Work>>();
    auto held = std::partition(works.begin(), works.end(), [](const auto& work) { return work.use_count() > 1; });
    if (last) {
      never->insert(never->end(), works.begin(), held);
      held = works.begin();
    }
    works.erase(held, works.end());
  }
};

// ``count`` values divided by ``by`` in place; the largest exponent field among the results (_finite.h:
// all ones exactly where one is NaN or Inf). IEEE division is correctly rounded, so every copy gives
// DDP's own results.
template <typename Float, typename Bits>
[[gnu::always_inline]] inline Bits divide_in_place(Float* values, int64_t count, Float by) {
  Bits top = 0;
  for (int64_t i = 0; i < count; i++) {
    Float value = values[i] / by;
    values[i] = value;
    Bits bits;
    std::memcpy(&bits, &value, sizeof bits);
    Bits field;
    if constexpr (sizeof(Float) == 4) {
      field = EXPONENT32(bits);
    } else {
      field = EXPONENT64(bits);
    }
    top = field > top ? field : top;
  }
  return top;
}

// Copies for CPUs with AVX-512 and AVX2 (_finite.h), chosen when the library loads: the extension is
// built for any x86-64 (SSE2), where the pass took 2.4x as long as torch's own div_ of the bucket, and
// 0.6x with these copies (a 12 MiB bucket: 613, 260 and 167 µs here).
WITH_SIMD_CLONES uint32_t divide_run(float* values, int64_t count, float by) {
  return divide_in_place<float, uint32_t>(values, count, by);
}

WITH_SIMD_CLONES uint64_t divide_run(double* values, int64_t count, double by) {
  return divide_in_place<double, uint64_t>(values, count, by);
}

// The same for 16-bit floats, each divided in float and rounded back to nearest even, as torch's div_
// does: c10's conversions.
template <typename Half>
[[gnu::always_inline]] inline uint16_t divide_half(Half* values, int64_t count, float by) {
  uint16_t top = 0;
  for (int64_t i = 0; i < count; i++) {
    Half value = static_cast<Half>(static_cast<float>(values[i]) / by);
    values[i] = value;
    uint16_t field;
    if constexpr (std::is_same_v<Half, c10::BFloat16>) {
      field = EXPONENT_BF16(value.x);
    } else {
      field = EXPONENT16(value.x);
    }
    top = field > top ? field : top;
  }
  return top;
}

WITH_SIMD_CLONES uint16_t divide_run(c10::BFloat16* values, int64_t count, float by) {
  return divide_half(values, count, by);
}

WITH_SIMD_CLONES uint16_t divide_run(c10::Half* values, int64_t count, float by) {
  return divide_half(values, count, by);
}

// What the division's pass tells of the bucket: whether every result is finite, and the largest binary
// exponent among them (its scale: a value flipped high, or a rank's gradients grown, shows there), or
// kNoScale where every value is zero or subnormal (a bucket of unused parameters).
constexpr int kNoScale = -100000;
struct Divided {
  bool finite;
  int exponent;
};

// ``values`` divided by ``by`` in place, in one pass on ATen's threads.
template <typename Float, typename Bits, typename By>
Divided divided(Float* values, int64_t count, By by, int shift, Bits all_ones, int bias) {
  std::atomic<Bits> top{0};
  at::parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
    Bits found = divide_run(values + begin, end - begin, by), seen = top.load(std::memory_order_relaxed);
    while (found > seen && !top.compare_exchange_weak(seen, found, std::memory_order_relaxed)) {
    }
  });
  Bits field = top.load();  // 0: every value zero or subnormal, no scale to follow
  return {field != all_ones, field == 0 ? kNoScale : static_cast<int>(field >> shift) - bias};
}

// The bucket divided by the group's size; what that pass tells (a contiguous bucket of floats), else
// nullopt.
std::optional<Divided> divide(at::Tensor& buffer, int64_t size) {
  if (buffer.is_contiguous() && buffer.scalar_type() == at::kFloat) {
    return divided<float, uint32_t>(buffer.data_ptr<float>(), buffer.numel(), static_cast<float>(size), 23,
                                    EXPONENT32(~0u), 127);
  }
  if (buffer.is_contiguous() && buffer.scalar_type() == at::kDouble) {
    return divided<double, uint64_t>(buffer.data_ptr<double>(), buffer.numel(), static_cast<double>(size), 52,
                                     EXPONENT64(~0ull), 1023);
  }
  if (buffer.is_contiguous() && buffer.scalar_type() == at::kBFloat16) {
    return divided<c10::BFloat16, uint16_t>(buffer.data_ptr<c10::BFloat16>(), buffer.numel(), static_cast<float>(size),
                                            7, EXPONENT_BF16(0xffffu), 127);
  }
  if (buffer.is_contiguous() && buffer.scalar_type() == at::kHalf) {
    return divided<c10::Half, uint16_t>(buffer.data_ptr<c10::Half>(), buffer.numel(), static_cast<float>(size), 10,
                                        EXPONENT16(0xffffu), 15);
  }
  buffer.div_(size);
  return std::nullopt;
}

// One bucket between begin() and END: begin()'s result, owned (it keeps the producer alive).
struct Bucket {
  PyObject* begun;
  PyObject* producer;  // borrowed from begun; nullptr: END is written by finish()
  std::array<unsigned long long, 11> end;
  std::optional<std::array<unsigned long long, 11>> fingerprint;  // FINGERPRINT's fields where due
  const unsigned char* data;  // where due, the bucket's memory, reduced in place (DDP holds it until then)
  size_t nbytes;
};

// Where the bucket's result is due a fingerprint: FINGERPRINT of it, then END at the time it ended.
void end_fingerprinted(const Bucket& bucket) {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  std::array<unsigned long long, 11> fields = *bucket.fingerprint;
  fields[6] = fingerprint_of(bucket.data, static_cast<int64_t>(bucket.nbytes));
  write_record(bucket.producer, fields.data());
  write_record_at(bucket.producer, bucket.end.data(),
                  static_cast<uint64_t>(now.tv_sec) * 1000000000ull + static_cast<uint64_t>(now.tv_nsec));
}

// finish(flight, error) with the GIL; an error it raises fails the bucket's future.
void finish(const Bucket& bucket, const std::optional<std::string>& error) {
  std::optional<std::string> raised;
  {
    py::gil_scoped_acquire gil;
    py::object begun = py::reinterpret_steal<py::object>(bucket.begun);
    try {
      begun[py::int_(0)](begun[py::int_(1)], error ? py::cast(*error) : py::none());
    } catch (py::error_already_set& e) {
      raised = e.what();
    }
  }
  if (raised) {
    throw std::runtime_error(*raised);
  }
}

class RecordedAllreduce : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  RecordedAllreduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, py::object group, py::object begin)
      : c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>>(pg),
        python_(new Python{std::move(group), std::move(begin)}),
        kept_(std::make_shared<Kept>()) {}

  ~RecordedAllreduce() override {
    py::gil_scoped_acquire gil;
    kept_->release(true);
    python_.reset();
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& grad) override {
    at::Tensor& buffer = grad.getBufferRef();
    std::optional<Divided> pass = divide(buffer, state_->getSize());
    std::optional<Bucket> bucket;
    {
      py::gil_scoped_acquire gil;
      kept_->release(false);
      // A pre-hook registered to propagate raises here, through backward, as from a Python hook.
      py::object begun = python_->begin(python_->group, buffer, grad.getIndex(), grad.getParameters().size(),
                                        grad.isLast(), pass ? py::cast(pass->finite) : py::none(),
                                        pass && pass->finite && pass->exponent != kNoScale ? py::cast(pass->exponent)
                                                                                           : py::none());
      if (!begun.is_none()) {
        py::object producer = begun[py::int_(2)];
        Bucket made{nullptr, producer.is_none() ? nullptr : producer.ptr(), {}, std::nullopt, nullptr, 0};
        py::tuple fields = begun[py::int_(3)];
        for (size_t i = 0; i < made.end.size(); i++) {
          made.end[i] = i == 8 ? static_cast<unsigned long long>(fields[i].cast<long long>())  // peer: signed
                               : fields[i].cast<unsigned long long>();
        }
        py::object due = begun[py::int_(4)];
        if (!due.is_none() && buffer.is_contiguous() && buffer.device().is_cpu()) {
          py::tuple print = due;
          std::array<unsigned long long, 11> found{};
          for (size_t i = 0; i < found.size(); i++) {
            found[i] = static_cast<unsigned long long>(print[i].cast<long long>());
          }
          made.fingerprint = found;
          made.data = static_cast<const unsigned char*>(buffer.const_data_ptr());
          made.nbytes = buffer.nbytes();
        }
        made.begun = begun.release().ptr();
        bucket = made;
      }
    }
    std::vector<at::Tensor> tensors = {buffer};
    c10::intrusive_ptr<c10d::Work> work;
    int was = set_issuing(1);  // PyTorch's own process-group hooks step aside (native.py)
    try {
      work = state_->allreduce(tensors);
    } catch (const std::exception& error) {
      set_issuing(was);
      if (bucket) {
        finish(*bucket, std::string(error.what()));
      }
      throw;
    }
    set_issuing(was);
    kept_->works.push_back(work);
    auto reduced = work->getFuture();
    if (!bucket) {
      return reduced;
    }
    return reduced->then(
        [bucket = *bucket, kept = kept_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) {
            finish(bucket, done.tryRetrieveErrorMessage());
          } else if (bucket.producer == nullptr) {
            finish(bucket, std::nullopt);
          } else {
            if (bucket.fingerprint) {
              end_fingerprinted(bucket);
            } else {
              write_record(bucket.producer, bucket.end.data());
            }
            std::lock_guard<std::mutex> guard(kept->lock);
            kept->begun.push_back(bucket.begun);
          }
          return done.value();
        },
        reduced->elementType());
  }

 private:
  struct Python {
    py::object group;
    py::object begin;
  };
  std::unique_ptr<Python> python_;  // released with the GIL
  std::shared_ptr<Kept> kept_;  // shared with the callbacks, which may outlive the hook
};

void register_hook(py::object reducer, py::object group, py::object begin) {
  TORCH_CHECK(set_issuing != nullptr, "init() first");
  auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  reducer.cast<c10d::Reducer&>().register_comm_hook(
      std::make_unique<RecordedAllreduce>(pg, std::move(group), std::move(begin)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("register_hook", &register_hook);
}
