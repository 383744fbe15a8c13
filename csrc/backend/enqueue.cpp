// enqueue.h: the enqueueing Python stack is captured as code objects (CapturedTraceback, as the
// memory history does) and symbolized only if the kernel fails.
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/runtime.h"
#include "enqueue.h"

namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void installCapturedTracebackPython();
}  // namespace torch

namespace torchneuron {
namespace {

std::string describe(const std::shared_ptr<torch::CapturedTraceback>& tb) {
  if (!tb) return "";
  py::gil_scoped_acquire gil;
  std::vector<torch::CapturedTraceback*> tbs{tb.get()};
  std::vector<py::object> symbolized = torch::py_symbolize(tbs);
  std::vector<std::string> lines;
  for (const auto& frame : symbolized.at(0)) {  // innermost first
    lines.push_back("  File \"" + frame["filename"].cast<std::string>() + "\", line " +
                    std::to_string(frame["line"].cast<int64_t>()) + ", in " + frame["name"].cast<std::string>());
  }
  std::reverse(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

// The host waits for the queue without the interpreter's lock (engine.h, set_blocking_wait).
void wait_without_gil(const std::function<void()>& wait) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    wait();
  } else {
    wait();
  }
}

}  // namespace

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

void enqueue_kernel(int device, const char* name, std::function<void()> work, neuron::rt::engine::Record record) {
  static const bool installed = (torch::installCapturedTracebackPython(),
                                 neuron::rt::engine::set_blocking_wait(&wait_without_gil),
                                 neuron::rt::engine::set_error_text(&error_text), true);
  (void)installed;
  static const bool stacks = [] {
    const char* v = std::getenv("TORCHNEURON_ASYNC_STACKS");
    return v == nullptr || std::string(v) != "0";
  }();
  std::shared_ptr<torch::CapturedTraceback> tb =
      stacks ? torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false) : nullptr;
  neuron::rt::engine::enqueue(device, neuron::rt::current_stream(device), name, std::move(work),
                              [tb = std::move(tb)] { return describe(tb); }, std::move(record));
}

}  // namespace torchneuron
