// PyTorch's process-group hooks (torch >= 2.14) registered from C++, so that a collective one of
// commlens' wrappers records already costs no call into Python: the pre-hook reads the thread's
// issuing flag (_issuing.c) without the GIL and returns; the post-hook finds that its pre-hook passed
// nothing on and returns. Any other collective (compiled, issued from C++) goes on to native.py's
// hooks, with the GIL, as when they are registered from Python. Built against the installed torch on
// first use (native.py).
//
//     init(issuing_now_capsule, pre, post)   // pre(key, PreHookArgs) -> recorded?; post(key, PostHookArgs)
//     attach(process_group, hook_id, key)    // unregistered with the group's unregister_pre/post_hook
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <unordered_set>

namespace py = pybind11;

namespace {

int (*issuing_now)() = nullptr;
// Never freed: a hook may fire until the process ends, after Python has let go of everything.
py::object* forward_pre = nullptr;
py::object* forward_post = nullptr;

struct Passed {
  int64_t key;
  std::mutex lock;
  // Passed on by the pre-hook, waiting for their post-hook. One that raised before it was queued
  // never gets one: its id stays (native.py settles the collective itself).
  std::unordered_set<int64_t> op_ids;
};

void init(py::capsule issuing, py::object pre, py::object post) {
  issuing_now = reinterpret_cast<int (*)()>(
      PyCapsule_GetPointer(issuing.ptr(), "commlens.hooks._issuing.now"));
  if (issuing_now == nullptr) {
    throw py::error_already_set();
  }
  forward_pre = new py::object(std::move(pre));
  forward_post = new py::object(std::move(post));
}

void attach(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t hook_id, int64_t key) {
  TORCH_CHECK(issuing_now != nullptr, "init() first");
  auto passed = std::make_shared<Passed>();
  passed->key = key;
  pg->registerPreHook(hook_id, [passed](const c10d::PreHookArgs& args) {
    if (issuing_now()) {
      return;
    }
    py::gil_scoped_acquire gil;
    if ((*forward_pre)(passed->key, args).cast<bool>()) {
      std::lock_guard<std::mutex> guard(passed->lock);
      passed->op_ids.insert(args.op_id);
    }
  });
  pg->registerPostHook(hook_id, [passed](const c10d::PostHookArgs& args) {
    {
      std::lock_guard<std::mutex> guard(passed->lock);
      if (passed->op_ids.erase(args.op_id) == 0) {
        return;
      }
    }
    py::gil_scoped_acquire gil;
    (*forward_post)(passed->key, args);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("attach", &attach);
}
