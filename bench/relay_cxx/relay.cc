// A bare compiled gRPC relay: bench.grpc_relay_floor's relay in C++ (grpc++ callback API),
// to measure what one relay hop costs when no Python runs on the path. Bytes in, bytes out,
// as the Python relays there: no parsing, no routing.
//
//   relay --port P --upstream U [--mux]
//
// Call mode: each client call (any method, one request message) opens the same call on the
// upstream server and relays its messages back. Mux mode: every request goes as a message on
// one long-lived stream-stream call (/floor.Relay/Session) to the upstream server, prefixed
// with a 4-byte little-endian stream id; each reply comes back as the id, a last-message
// byte, then the payload, and is handed to its request's call (the router's way to a decode
// worker: DecodeWorker.Session). Listens on 127.0.0.1 only.
//
// Built with -DRELAY_PYTHON it is also a Python extension module, `_relay`, whose
// `start(port, upstream, mux, decide)` runs the same relay inside a Python process: each
// request's bytes go to `decide` (a Python callable, called with the GIL on grpc's thread),
// and what it returns (bytes) is forwarded instead; None refuses the request
// (FAILED_PRECONDITION). That is the router's hybrid: Python decides, compiled code moves
// the bytes (bench.grpc_relay_floor --decide).
#ifdef RELAY_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

using grpc::ByteBuffer;
using grpc::Slice;
using grpc::Status;
using grpc::StatusCode;

namespace {

const char kSession[] = "/floor.Relay/Session";
std::unique_ptr<grpc::GenericStub> g_stub;

// One client call on the relay's server. Messages from upstream come in through Deliver, on
// grpc's threads; one write is outstanding at a time. It finishes only after its upstream has
// delivered its end, so nothing refers to it once it is done (OnDone deletes it).
class Downstream : public grpc::ServerGenericBidiReactor {
 public:
  Downstream(grpc::GenericCallbackServerContext* ctx, bool mux);
  void Deliver(const ByteBuffer* msg, const Status* end) {
    std::lock_guard<std::mutex> lock(mu_);
    if (msg != nullptr) pending_.push_back(*msg);
    if (end != nullptr) end_ = std::make_unique<Status>(*end);
    if (!writing_) WriteNextLocked();
  }
  grpc::ClientContext* upstream_context() { return &up_ctx_; }

 private:
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) pending_.clear();  // the client went away: drop what is left, end with upstream
    WriteNextLocked();
  }
  void OnCancel() override { up_ctx_.TryCancel(); }
  void OnDone() override { delete this; }
  void WriteNextLocked() {
    if (!pending_.empty()) {
      writing_ = true;
      current_ = std::move(pending_.front());
      pending_.pop_front();
      StartWrite(&current_);
    } else if (end_ && !finished_) {
      finished_ = true;
      Finish(*end_);
    }
  }

  grpc::GenericCallbackServerContext* ctx_;
  bool mux_;
  ByteBuffer request_, current_;
  grpc::ClientContext up_ctx_;
  std::mutex mu_;
  std::deque<ByteBuffer> pending_;
  std::unique_ptr<Status> end_;
  bool writing_ = false, finished_ = false;
};

// Call mode: the request's own upstream call.
class Upstream : public grpc::ClientBidiReactor<ByteBuffer, ByteBuffer> {
 public:
  Upstream(Downstream* down, const std::string& method, const ByteBuffer& request)
      : down_(down), request_(request) {
    grpc::ClientContext* ctx = down->upstream_context();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    g_stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&msg_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    down_->Deliver(&msg_, nullptr);
    StartRead(&msg_);
  }
  void OnDone(const Status& status) override {
    down_->Deliver(nullptr, &status);
    delete this;
  }

 private:
  Downstream* down_;
  ByteBuffer request_, msg_;
};

// Mux mode: one stream-stream call for every request.
class Mux : public grpc::ClientBidiReactor<ByteBuffer, ByteBuffer> {
 public:
  Mux() {
    g_stub->PrepareBidiStreamingCall(&ctx_, kSession, grpc::StubOptions(), this);
    StartRead(&msg_);
    AddHold();  // writes come and go; the call lives as long as the process
    StartCall();
  }
  void Send(Downstream* down, const ByteBuffer& request) {
    std::vector<Slice> slices;
    if (!request.Dump(&slices).ok()) {
      Status bad(StatusCode::INTERNAL, "unreadable request");
      down->Deliver(nullptr, &bad);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t sid = ++next_id_;
    char head[4];
    std::memcpy(head, &sid, 4);  // little-endian hosts only (x86-64, aarch64)
    slices.insert(slices.begin(), Slice(head, 4));
    streams_[sid] = down;
    queue_.emplace_back(slices.data(), slices.size());
    if (!writing_) WriteNextLocked();
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (ok) WriteNextLocked();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    Slice whole;
    if (msg_.DumpToSingleSlice(&whole).ok() && whole.size() >= 5) {
      uint32_t sid;
      std::memcpy(&sid, whole.begin(), 4);
      bool last = whole.begin()[4] != 0;
      Downstream* down = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = streams_.find(sid);
        if (it != streams_.end()) {
          down = it->second;
          if (last) streams_.erase(it);
        }
      }
      if (down != nullptr) {
        Slice payload = whole.sub(5, whole.size());
        ByteBuffer out(&payload, 1);
        down->Deliver(&out, nullptr);
        if (last) {
          Status ok_status = Status::OK;
          down->Deliver(nullptr, &ok_status);
        }
      }
    }
    StartRead(&msg_);
  }
  void OnDone(const Status& status) override {
    std::cerr << "relay: session ended: " << status.error_message() << std::endl;
    std::exit(1);
  }

 private:
  void WriteNextLocked() {
    if (queue_.empty()) return;
    writing_ = true;
    current_ = std::move(queue_.front());
    queue_.pop_front();
    StartWrite(&current_);
  }

  grpc::ClientContext ctx_;
  ByteBuffer msg_, current_;
  std::mutex mu_;
  std::deque<ByteBuffer> queue_;
  std::unordered_map<uint32_t, Downstream*> streams_;
  uint32_t next_id_ = 0;
  bool writing_ = false;
};

Mux* g_mux = nullptr;

#ifdef RELAY_PYTHON
PyObject* g_decide = nullptr;  // set once by start(), never released

// `request` through g_decide: false when it refused (or failed: the error is printed).
bool Decide(const ByteBuffer& request, ByteBuffer* forward) {
  Slice whole;
  if (!request.DumpToSingleSlice(&whole).ok()) return false;
  PyGILState_STATE gil = PyGILState_Ensure();
  bool ok = false;
  PyObject* arg = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(whole.begin()),
                                            static_cast<Py_ssize_t>(whole.size()));
  PyObject* out = arg != nullptr ? PyObject_CallOneArg(g_decide, arg) : nullptr;
  if (out == nullptr) {
    PyErr_Print();
  } else if (PyBytes_Check(out)) {
    Slice body(PyBytes_AS_STRING(out), static_cast<size_t>(PyBytes_GET_SIZE(out)));
    *forward = ByteBuffer(&body, 1);
    ok = true;
  }
  Py_XDECREF(out);
  Py_XDECREF(arg);
  PyGILState_Release(gil);
  return ok;
}
#endif

Downstream::Downstream(grpc::GenericCallbackServerContext* ctx, bool mux)
    : ctx_(ctx), mux_(mux) {
  StartRead(&request_);
}

void Downstream::OnReadDone(bool ok) {
  if (!ok) {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    Finish(Status(StatusCode::INVALID_ARGUMENT, "no request message"));
    return;
  }
#ifdef RELAY_PYTHON
  if (g_decide != nullptr) {
    ByteBuffer forward;
    if (!Decide(request_, &forward)) {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = true;
      Finish(Status(StatusCode::FAILED_PRECONDITION, "refused"));
      return;
    }
    request_ = std::move(forward);
  }
#endif
  if (mux_) {
    g_mux->Send(this, request_);
  } else {
    new Upstream(this, ctx_->method(), request_);
  }
}

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(bool mux) : mux_(mux) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override {
    return new Downstream(ctx, mux_);
  }

 private:
  bool mux_;
};

}  // namespace

int relay_main(int argc, char** argv) {
  std::string port, upstream;
  bool mux = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--port" && i + 1 < argc) port = argv[++i];
    else if (a == "--upstream" && i + 1 < argc) upstream = argv[++i];
    else if (a == "--mux") mux = true;
    else {
      std::cerr << "usage: relay --port P --upstream U [--mux]" << std::endl;
      return 2;
    }
  }
  if (port.empty() || upstream.empty()) {
    std::cerr << "usage: relay --port P --upstream U [--mux]" << std::endl;
    return 2;
  }
  auto channel = grpc::CreateChannel("127.0.0.1:" + upstream,
                                     grpc::InsecureChannelCredentials());
  g_stub = std::make_unique<grpc::GenericStub>(channel);
  if (mux) g_mux = new Mux();
  Service service(mux);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + port, grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return 1;
  server->Wait();
  return 0;
}

#ifdef RELAY_PYTHON
#include <thread>

namespace {
PyObject* Start(PyObject* /*module*/, PyObject* args) {
  int port, upstream, mux;
  PyObject* decide;
  if (!PyArg_ParseTuple(args, "iipO", &port, &upstream, &mux, &decide)) return nullptr;
  if (g_stub != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the relay is already started");
    return nullptr;
  }
  if (decide != Py_None) {
    Py_INCREF(decide);
    g_decide = decide;
  }
  std::thread([port, upstream, mux]() {
    std::string p = std::to_string(port), u = std::to_string(upstream);
    std::vector<std::string> argv = {"relay", "--port", p, "--upstream", u};
    if (mux) argv.emplace_back("--mux");
    std::vector<char*> ptrs;
    for (auto& a : argv) ptrs.push_back(a.data());
    std::exit(relay_main(static_cast<int>(ptrs.size()), ptrs.data()));
  }).detach();
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"start", Start, METH_VARARGS,
     "start(port, upstream, mux, decide): run the relay on a thread of its own"},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_relay", nullptr, -1, kMethods};
}  // namespace

PyMODINIT_FUNC PyInit__relay() { return PyModule_Create(&kModule); }
#else
int main(int argc, char** argv) { return relay_main(argc, argv); }
#endif
