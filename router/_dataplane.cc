// The router's compiled data plane (docs/design/compiled_data_plane.md): grpc++ moves a
// request's bytes, Python (router.dataplane) makes every decision.
//
// One process-wide instance, started by `start`. Its server takes the client-facing
// pdserve.v1.Router API on the router's port:
//   - A Generate call's request is read here (its prompt's token ids apart) and handed to
//     Python's `decide` (below). Python answers with `route` (a local route: the request goes as a message on that decode
//     worker's DecodeWorker.Session, opened here, and every chunk the worker sends comes back
//     to the client as a GenerateResponse made here, with no Python per token) or with
//     `relay` (Python serves it: the call is relayed, request, metadata and deadline, to the
//     router's own grpc.aio server on a loopback port, and its responses, status and trailers
//     relayed back) or with `refuse` (its quota or admission refused it).
//   - Every other call (Abort, grpc.health.v1, anything unknown) is relayed the same way,
//     with no event.
// Python hears of a routed request at its first token ("first", with the data plane's own
// time on it), at its end ("end") and when its worker failed it ("failed": an error from the
// worker, the session ending, or no chunk within the request's timeouts): then Python
// decides again and `relay`s the call with a resume token, so its stream goes on where the
// client has it (router.dataplane).
//
// A request's decision runs on the grpc thread that read it, with the GIL, while Python's
// event loop is parked (`Handoff`: the loop's selector reports when it waits and when it
// leaves, so the loop and a decision never run at once). Every other event is queued here
// and an eventfd wakes the loop, which drains them with `take` (so are requests where Python
// installed no handoff). Python's calls into this module only queue work for grpc: they
// never wait on the network (a write grpc starts at once may run its syscall on the
// caller's thread).
//
// The worker messages (SessionRequests / SessionResponses / TokenChunk, protos/decode.proto)
// and GenerateResponse (protos/router.proto) are encoded and read here by their field
// numbers, the protobuf wire format; tests/test_dataplane.py checks what is made here against
// the Python path's messages, parsed by protobuf.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

using grpc::ByteBuffer;
using grpc::Slice;
using grpc::Status;
using grpc::StatusCode;
using Clock = std::chrono::steady_clock;

namespace {

const char kGenerate[] = "/pdserve.v1.Router/Generate";
const char kSession[] = "/pdserve.v1.DecodeWorker/Session";
const char kResumeKey[] = "x-pdserve-resume";
constexpr int kRouteLocal = 1;  // pdserve.v1.PrefillRoute.PREFILL_ROUTE_LOCAL
constexpr int kUnavailable = 14;

// ------------------------------------------------------------------ protobuf wire format

void PutVarint(std::string* s, uint64_t v) {
  while (v >= 0x80) {
    s->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  s->push_back(static_cast<char>(v));
}

void PutTag(std::string* s, int field, int wire_type) {
  PutVarint(s, (static_cast<uint64_t>(field) << 3) | wire_type);
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// A length-delimited field's tag and length, its `len` bytes to follow.
void PutLenHeader(std::string* s, int field, size_t len) {
  PutTag(s, field, 2);
  PutVarint(s, len);
}

void PutLen(std::string* s, int field, std::string_view bytes) {
  PutLenHeader(s, field, bytes.size());
  s->append(bytes.data(), bytes.size());
}

void PutUint(std::string* s, int field, uint64_t v) {  // proto3: zero is not written
  if (v == 0) return;
  PutTag(s, field, 0);
  PutVarint(s, v);
}

void PutDouble(std::string* s, int field, double v) {  // proto3: zero is not written
  if (v == 0) return;
  PutTag(s, field, 1);
  char b[8];
  std::memcpy(b, &v, 8);  // little-endian hosts only (x86-64, aarch64)
  s->append(b, 8);
}

// Reads one message's fields in order; `ok` false once anything is malformed.
struct WireReader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;

  explicit WireReader(std::string_view b)
      : p(reinterpret_cast<const uint8_t*>(b.data())), end(p + b.size()) {}

  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) break;
      uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    ok = false;
    return 0;
  }
  // The next field's number and wire type; false at the end (or on an error).
  bool Next(int* field, int* wire_type) {
    if (!ok || p >= end) return false;
    uint64_t tag = Varint();
    *field = static_cast<int>(tag >> 3);
    *wire_type = static_cast<int>(tag & 7);
    return ok;
  }
  std::string_view Bytes() {
    uint64_t n = Varint();
    if (!ok || n > static_cast<uint64_t>(end - p)) {
      ok = false;
      return {};
    }
    std::string_view out(reinterpret_cast<const char*>(p), n);
    p += n;
    return out;
  }
  void Skip(int wire_type) {
    switch (wire_type) {
      case 0: Varint(); break;
      case 1: p += 8; break;
      case 2: Bytes(); break;
      case 5: p += 4; break;
      default: ok = false;
    }
    if (p > end) ok = false;
  }
};

std::string ToString(const ByteBuffer& buf, bool* ok) {
  Slice whole;
  *ok = buf.DumpToSingleSlice(&whole).ok();
  if (!*ok) return {};
  return std::string(reinterpret_cast<const char*>(whole.begin()), whole.size());
}

ByteBuffer FromString(const std::string& s) {
  Slice slice(s.data(), s.size());
  return ByteBuffer(&slice, 1);
}

// A worker's TokenChunk as the client's GenerateResponse (router.servicer._response).
struct Chunk {
  bool has_token = false;
  int32_t token = 0;
  std::string_view text, logprob, error;
  uint64_t finish = 0, prompt = 0, cached = 0, output = 0;
};

bool ParseChunk(std::string_view bytes, Chunk* c) {
  WireReader r(bytes);
  int f, wt;
  while (r.Next(&f, &wt)) {
    if (f == 2 && wt == 0) {
      c->has_token = true;
      c->token = static_cast<int32_t>(r.Varint());
    } else if (f == 3 && wt == 2) {
      c->text = r.Bytes();
    } else if (f == 4 && wt == 2) {
      c->logprob = r.Bytes();
    } else if (f == 5 && wt == 0) {
      c->finish = r.Varint();
    } else if (f == 6 && wt == 2) {
      c->error = r.Bytes();
    } else if (f == 7 && wt == 0) {
      c->prompt = r.Varint();
    } else if (f == 8 && wt == 0) {
      c->cached = r.Varint();
    } else if (f == 9 && wt == 0) {
      c->output = r.Varint();
    } else {
      r.Skip(wt);
    }
  }
  return r.ok;
}

std::string Response(const Chunk& c, const std::string& label, const std::string& worker) {
  std::string out;
  PutLen(&out, 1, label);
  if (c.has_token) {
    std::string packed;
    PutVarint(&packed, static_cast<uint64_t>(static_cast<int64_t>(c.token)));
    PutLen(&out, 2, packed);
  }
  if (!c.text.empty()) PutLen(&out, 3, c.text);
  if (c.has_token && c.logprob.data() != nullptr) PutLen(&out, 4, c.logprob);
  PutUint(&out, 5, c.finish);
  if (!c.error.empty()) PutLen(&out, 6, c.error);
  std::string usage;
  PutUint(&usage, 1, c.prompt);
  PutUint(&usage, 2, c.output);
  PutUint(&usage, 3, c.cached);
  PutLen(&out, 7, usage);
  PutUint(&out, 8, kRouteLocal);
  if (!worker.empty()) PutLen(&out, 9, worker);
  return out;
}

// A GenerateRequest whose prompt is token ids (field 3, TokenIds: field 1, packed or not),
// split: `rest` is the request with an empty TokenIds in their place (what Python parses: a
// few bytes, not thousands of ids), `ids` the prompt, `packed` its packed encoding (spliced
// into the worker's message, so Python never encodes it). False when the request has no
// token ids or does not parse (Python's protobuf then says what is wrong, or relays it).
bool SplitIds(std::string_view request, std::string* rest, std::vector<int32_t>* ids,
              std::string* packed) {
  WireReader r(request);
  bool found = false;
  std::string_view run;  // the ids as one packed run, as the client sent them
  int runs = 0;
  int f, wt;
  while (r.Next(&f, &wt)) {
    const uint8_t* start = r.p;
    if (f == 3 && wt == 2) {
      WireReader t(r.Bytes());
      int g, gwt;
      while (t.Next(&g, &gwt)) {
        if (g == 1 && gwt == 2) {
          run = t.Bytes();
          ++runs;
          ids->reserve(ids->size() + run.size());  // at least a byte an id
          WireReader v(run);
          while (v.ok && v.p < v.end) ids->push_back(static_cast<int32_t>(v.Varint()));
          if (!v.ok) return false;
        } else if (g == 1 && gwt == 0) {
          runs = 2;  // not one packed run: written anew below
          ids->push_back(static_cast<int32_t>(t.Varint()));
        } else {
          t.Skip(gwt);
        }
      }
      if (!t.ok) return false;
      found = true;
      continue;
    }
    // Any other field, copied as it came: its tag, then its value.
    uint64_t tag = (static_cast<uint64_t>(f) << 3) | wt;
    r.Skip(wt);
    if (!r.ok) return false;
    PutVarint(rest, tag);
    rest->append(reinterpret_cast<const char*>(start), r.p - start);
  }
  if (!r.ok || !found) return false;
  PutLen(rest, 3, "");  // still a token_ids request, its ids elsewhere
  if (runs == 1) {  // the usual case (proto3 packs repeated ints): the very bytes
    packed->assign(run.data(), run.size());
    return true;
  }
  for (int32_t id : *ids) PutVarint(packed, static_cast<uint64_t>(static_cast<int64_t>(id)));
  return true;
}

// ------------------------------------------------------------------ events for Python

enum EventKind { kCallEvent = 0, kFirstEvent = 1, kEndEvent = 2, kFailedEvent = 3,
                 kStalledEvent = 4 };

struct Event {
  EventKind kind;
  uint64_t call;
  std::string body;       // call: the request; failed: the message
  std::string auth;       // call: the authorization metadata; failed: the error code
  std::string param;      // failed: the error's param
  double a = 0, b = 0;    // first: in and out seconds
  int status = 0;         // failed: the grpc status number; end: 1 finished, 0 cancelled
  std::vector<int32_t> streamed;  // failed: the tokens the client has; call: the prompt
  bool has_ids = false;           // call: `streamed` is the prompt, `body` the rest
};

std::mutex g_ev_mu;
auto& g_events = *new std::vector<Event>;
int g_efd = -1;

void Push(Event e) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(g_ev_mu);
    wake = g_events.empty();
    g_events.push_back(std::move(e));
  }
  if (wake) {
    uint64_t one = 1;
    ssize_t n = write(g_efd, &one, sizeof one);
    (void)n;  // a full counter (never: Python reads it) still wakes the loop
  }
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ------------------------------------------------------------------ settings

struct Settings {
  std::string internal;  // the router's grpc.aio server, host:port
  std::vector<std::pair<std::string, std::string>> worker_metadata;
  std::vector<std::pair<std::string, int>> channel_args;
  // TLS (pdserve.rpc.tls.TLSConfig's PEM): none when `tls` is false. Every channel (to the
  // workers and to the router's grpc.aio server) trusts the CA only and presents this
  // certificate; the server asks clients for one when `require_client`.
  bool tls = false, require_client = false;
  std::string cert_pem, key_pem, ca_pem, server_name;
};
Settings& g_settings = *new Settings;
grpc::GenericStub* g_internal = nullptr;  // this and the rest live as long as the process

class Session;
std::mutex g_mu;  // g_calls, g_sessions, g_channels
auto& g_sessions = *new std::unordered_map<std::string, std::shared_ptr<Session>>;
auto& g_channels = *new std::unordered_map<std::string, std::shared_ptr<grpc::Channel>>;

std::shared_ptr<grpc::Channel> ChannelTo(const std::string& target) {
  grpc::ChannelArguments args;
  for (auto& [name, value] : g_settings.channel_args) args.SetInt(name, value);
  if (!g_settings.tls) {
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  }
  if (!g_settings.server_name.empty()) {
    args.SetSslTargetNameOverride(g_settings.server_name);
  }
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = g_settings.ca_pem;
  opts.pem_private_key = g_settings.key_pem;
  opts.pem_cert_chain = g_settings.cert_pem;
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(opts), args);
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials() {
  if (!g_settings.tls) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts(
      g_settings.require_client ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (g_settings.require_client) opts.pem_root_certs = g_settings.ca_pem;
  opts.pem_key_cert_pairs.push_back({g_settings.key_pem, g_settings.cert_pem});
  return grpc::SslServerCredentials(opts);
}

// ------------------------------------------------------------------ a client call

class Upstream;

class Call : public grpc::ServerGenericBidiReactor {
 public:
  enum class Mode { kReading, kDeciding, kLocal, kHandedBack, kRelay, kOver };

  Call(grpc::GenericCallbackServerContext* ctx, uint64_t id);
  void Start(std::shared_ptr<Call> self);

  // From Python (under the GIL, never waiting on the network).
  bool Route(std::shared_ptr<Session> session, const std::string& body, std::string label,
             std::string worker, double first_s, double token_s, double stall_s,
             bool timings);
  bool Relay(const std::string& resume);
  bool Refuse(int status, const std::string& message,
              const std::vector<std::pair<std::string, std::string>>& trailers);

  // From the worker's session, on grpc's threads.
  // The worker's TokenChunk for this call, parsed (nullptr: it did not parse).
  void OnChunk(const Chunk* chunk, Clock::time_point read_at);
  void OnWorkerError(int status, std::string message, std::string code, std::string param);
  // The session is being written: the request is on its way (its `in` time ends). Called
  // with the session's lock held, so it takes no lock of its own.
  void Forwarded(Clock::time_point at) {
    Clock::rep none = 0;
    forwarded_.compare_exchange_strong(none, at.time_since_epoch().count());
  }
  // The watchdog: its next message is overdue.
  void CheckDeadline(Clock::time_point now);

  // From the relayed call to the Python server.
  void UpMessage(const ByteBuffer& msg);
  void UpDone(const Status& status,
              std::vector<std::pair<std::string, std::string>> trailers);

  uint64_t id() const { return id_; }

 private:
  void OnReadDone(bool ok) override;
  void ReadDone(bool ok);
  void DecideNow();
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  void SendLocked(ByteBuffer msg);
  void EndLocked(const Status& status);
  void WriteNextLocked();
  void StartRelayLocked(const std::string& resume);
  void DetachLocked();

  grpc::GenericCallbackServerContext* ctx_;
  const uint64_t id_;
  const bool generate_;
  std::shared_ptr<Call> self_;  // held until OnDone
  std::mutex mu_;
  Mode mode_ = Mode::kReading;
  ByteBuffer request_, incoming_, current_;
  std::string request_bytes_, packed_ids_;
  std::deque<ByteBuffer> out_;
  std::unique_ptr<Status> end_;
  bool writing_ = false, finished_ = false, reading_ = false, cancelled_ = false;
  // a local route
  std::shared_ptr<Session> session_;
  uint64_t stream_ = 0;
  std::string label_, worker_;
  Clock::duration first_timeout_{}, token_timeout_{}, stall_{};
  Clock::time_point arrived_, deadline_, stall_at_, routed_, first_;
  bool timings_ = false;  // the last response gets StageTimings
  std::atomic<Clock::rep> forwarded_{0};
  bool replied_ = false;
  std::vector<int32_t> streamed_;
  std::unique_ptr<Event> decide_;  // the request, read, for Python to decide on
  // a relay
  Upstream* up_ = nullptr;  // owned by grpc until its OnDone
  friend class Upstream;
};

std::atomic<uint64_t> g_next_call{0};
auto& g_calls = *new std::unordered_map<uint64_t, std::weak_ptr<Call>>;

std::shared_ptr<Call> FindCall(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_calls.find(id);
  return it == g_calls.end() ? nullptr : it->second.lock();
}

// ------------------------------------------------------------------ one decode worker

// The data plane's side of one DecodeWorker.Session call (router.clients._Session's
// counterpart): requests go out as SessionRequests, what queued while a write was out joined
// into one message; each SessionResponse goes to its request's call. Its end, for any
// reason, fails every request still on it.
class Session : public grpc::ClientBidiReactor<ByteBuffer, ByteBuffer> {
 public:
  Session(std::string address, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), stub_(std::move(channel)) {}

  void Start(std::shared_ptr<Session> self) {
    self_ = std::move(self);
    for (auto& [k, v] : g_settings.worker_metadata) ctx_.AddMetadata(k, v);
    stub_.PrepareBidiStreamingCall(&ctx_, kSession, grpc::StubOptions(), this);
    StartRead(&msg_);
    AddHold();  // writes come and go; the call lasts until either side ends it
    StartCall();
  }

  // Queue `call`'s request, a DecodeGenerateRequest whose `input` (field 6) is `input` (a
  // GenerateInput without its prompt) then the prompt (field 2) as `packed` ids; written
  // straight into the session's next message, each byte once. 0 when the session is over.
  uint64_t Send(std::shared_ptr<Call> call, std::string_view input, std::string_view packed) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return 0;
    uint64_t sid = ++next_;
    size_t input_len = input.size() + 1 + VarintSize(packed.size()) + packed.size();
    size_t message_len = 1 + VarintSize(input_len) + input_len;
    size_t one_len = 1 + VarintSize(sid) + 1 + VarintSize(message_len) + message_len;
    pending_.reserve(pending_.size() + 1 + VarintSize(one_len) + one_len);
    PutLenHeader(&pending_, 1, one_len);      // SessionRequest.requests: one
    PutUint(&pending_, 1, sid);               //   .stream
    PutLenHeader(&pending_, 2, message_len);  //   .generate: a DecodeGenerateRequest
    PutLenHeader(&pending_, 6, input_len);    //     .input
    pending_.append(input.data(), input.size());
    PutLenHeader(&pending_, 2, packed.size());  //     .prompt_token_ids, packed
    pending_.append(packed.data(), packed.size());
    waiting_.push_back(call);
    streams_[sid] = std::move(call);
    if (!writing_) WriteNextLocked();
    return sid;
  }

  // The caller left request `sid`: cancel it on the worker (its blocks are freed there).
  void Cancel(uint64_t sid) {
    std::lock_guard<std::mutex> lock(mu_);
    if (streams_.erase(sid) == 0 || ended_) return;
    std::string one;
    PutUint(&one, 1, sid);
    PutUint(&one, 3, 1);
    PutLen(&pending_, 1, one);
    if (!writing_) WriteNextLocked();
  }

  void Close() { ctx_.TryCancel(); }
  const std::string& address() const { return address_; }

 private:
  void WriteNextLocked() {
    if (pending_.empty()) return;
    writing_ = true;
    current_ = FromString(pending_);
    pending_.clear();
    auto now = Clock::now();
    for (auto& w : waiting_) {
      if (auto call = w.lock()) call->Forwarded(now);
    }
    waiting_.clear();
    StartWrite(&current_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (ok) WriteNextLocked();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();  // the call is ending: OnDone follows
      return;
    }
    auto read_at = Clock::now();
    bool whole;
    std::string bytes = ToString(msg_, &whole);
    WireReader r(bytes);
    int f, wt;
    while (whole && r.Next(&f, &wt)) {
      if (f != 1 || wt != 2) {
        r.Skip(wt);
        continue;
      }
      WireReader one(r.Bytes());
      uint64_t sid = 0;
      std::string_view token, error;
      bool has_token = false, has_error = false, parsed = false;
      Chunk chunk;
      int g, gwt;
      while (one.Next(&g, &gwt)) {
        if (g == 1 && gwt == 0) sid = one.Varint();
        else if (g == 2 && gwt == 2) token = one.Bytes(), has_token = true;
        else if (g == 3 && gwt == 2) error = one.Bytes(), has_error = true;
        else one.Skip(gwt);
      }
      std::shared_ptr<Call> call;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = streams_.find(sid);
        if (it == streams_.end()) continue;
        call = it->second;
        // Parsed once, here: OnChunk gets the fields (views into `bytes`, alive meanwhile).
        bool last = has_error;
        if (has_token) {
          parsed = ParseChunk(token, &chunk);
          last = !parsed || chunk.finish != 0;
        }
        if (last) streams_.erase(it);
      }
      if (has_error) {
        WireReader e(error);
        uint64_t status = 2;
        std::string message, code, param;
        int h, hwt;
        while (e.Next(&h, &hwt)) {
          if (h == 1 && hwt == 0) status = e.Varint();
          else if (h == 2 && hwt == 2) message = std::string(e.Bytes());
          else if (h == 3 && hwt == 2) code = std::string(e.Bytes());
          else if (h == 4 && hwt == 2) param = std::string(e.Bytes());
          else e.Skip(hwt);
        }
        call->OnWorkerError(static_cast<int>(status), message, code, param);
      } else if (has_token) {
        call->OnChunk(parsed ? &chunk : nullptr, read_at);
      }
    }
    StartRead(&msg_);
  }

  void OnDone(const Status& status) override {
    std::unordered_map<uint64_t, std::shared_ptr<Call>> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ended_ = true;
      left.swap(streams_);
    }
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto it = g_sessions.find(address_);
      if (it != g_sessions.end() && it->second.get() == this) g_sessions.erase(it);
    }
    std::string why = status.ok()
        ? "the decode worker ended the session (it is draining)"
        : "the session with the decode worker failed: " + status.error_message();
    for (auto& [sid, call] : left) {
      call->OnWorkerError(kUnavailable, why + " before the final token", "worker_unavailable",
                          "");
    }
    auto keep = std::move(self_);  // may delete this: nothing below
  }

  const std::string address_;
  grpc::GenericStub stub_;
  grpc::ClientContext ctx_;
  std::shared_ptr<Session> self_;
  ByteBuffer msg_, current_;
  std::mutex mu_;
  std::string pending_;
  std::vector<std::weak_ptr<Call>> waiting_;  // their request is in `pending_`
  std::unordered_map<uint64_t, std::shared_ptr<Call>> streams_;
  uint64_t next_ = 0;
  bool writing_ = false, ended_ = false;
};

std::shared_ptr<Session> SessionTo(const std::string& address) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sessions.find(address);
  if (it != g_sessions.end()) return it->second;
  auto& channel = g_channels[address];
  if (channel == nullptr) channel = ChannelTo(address);
  auto session = std::make_shared<Session>(address, channel);
  g_sessions[address] = session;
  session->Start(session);
  return session;
}

// ------------------------------------------------------------------ a relayed call

// The client's call relayed to the router's grpc.aio server: the client's messages (as they
// come), metadata and deadline up; the server's messages, status and trailers down.
class Upstream : public grpc::ClientBidiReactor<ByteBuffer, ByteBuffer> {
 public:
  Upstream(std::shared_ptr<Call> down, const std::string& method,
           grpc::GenericCallbackServerContext* server_ctx, const std::string& resume)
      : down_(std::move(down)) {
    for (auto& [k, v] : server_ctx->client_metadata()) {
      std::string key(k.data(), k.size());
      if (key.empty() || key[0] == ':' || key.rfind("grpc-", 0) == 0 || key == "te" ||
          key == "content-type" || key == "user-agent" || key == kResumeKey) {
        continue;
      }
      ctx_.AddMetadata(key, std::string(v.data(), v.size()));
    }
    if (!resume.empty()) ctx_.AddMetadata(kResumeKey, resume);
    auto deadline = server_ctx->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) ctx_.set_deadline(deadline);
    g_internal->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartRead(&msg_);
    AddHold();  // until the client half-closes (`WritesDone`)
    StartCall();
  }

  void Write(const ByteBuffer& msg) {
    std::lock_guard<std::mutex> lock(mu_);
    if (half_closed_ || closed_) return;
    queue_.push_back(msg);
    if (!writing_) WriteNextLocked();
  }
  void WritesDone() {
    std::lock_guard<std::mutex> lock(mu_);
    half_closed_ = true;
    if (!writing_) WriteNextLocked();
  }
  void Cancel() {
    ctx_.TryCancel();
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    if (!writing_ && !closed_) {  // else the write fails and OnWriteDone lets go
      closed_ = true;
      RemoveHold();
    }
  }

 private:
  void WriteNextLocked() {
    if (!queue_.empty()) {
      writing_ = true;
      current_ = std::move(queue_.front());
      queue_.pop_front();
      StartWrite(&current_);
    } else if (half_closed_ && !closed_) {
      closed_ = true;
      StartWritesDone();
      RemoveHold();
    }
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      queue_.clear();
      if (!closed_) {
        closed_ = true;
        RemoveHold();
      }
      return;
    }
    WriteNextLocked();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    down_->UpMessage(msg_);
    StartRead(&msg_);
  }
  void OnDone(const Status& status) override {
    std::vector<std::pair<std::string, std::string>> trailers;
    for (auto& [k, v] : ctx_.GetServerTrailingMetadata()) {
      trailers.emplace_back(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
    }
    down_->UpDone(status, std::move(trailers));
    delete this;
  }

  std::shared_ptr<Call> down_;
  grpc::ClientContext ctx_;
  ByteBuffer msg_, current_;
  std::mutex mu_;
  std::deque<ByteBuffer> queue_;
  bool writing_ = false, half_closed_ = false, closed_ = false;
};

// ------------------------------------------------------------------ decisions on grpc's thread

// Python's decision on a request runs on the grpc thread that read it, as if it were one of
// the event loop's callbacks: while it runs the loop is parked (between two iterations, or
// in its selector's wait), and the loop runs nothing while a decision runs or waits. The
// loop's selector reports both edges (`loop_idle` before it waits, `loop_busy` after), so no
// thread switch and no wake-up of the loop stand between a request and its decision, and the
// router's state is only ever touched by one thread at a time. Where Python installed no
// such selector, requests go to the loop as events instead (`Push`).
std::mutex g_turn_mu;
std::condition_variable g_turn_cv;
bool g_loop_running = true;  // the loop thread is running Python code
int g_waiting = 0;           // decisions waiting for the loop to park
bool g_deciding = false;     // a decision is running
PyObject* g_decide = nullptr;  // decide(call, body, auth, request_id_metadata, ids, packed)

// Python ints 0..kInts-1, made once: a prompt's ids become a tuple of references to them,
// not thousands of new objects per request (a vocabulary's ids are all below this).
constexpr int32_t kInts = 1 << 18;
PyObject** g_ints = nullptr;  // made by IdsTuple, Int's only caller

PyObject* Int(int32_t v) {
  if (v >= 0 && v < kInts) {
    PyObject*& slot = g_ints[v];
    if (slot == nullptr) slot = PyLong_FromLong(v);  // kept for good
    Py_XINCREF(slot);
    return slot;
  }
  return PyLong_FromLong(v);
}

PyObject* IdsTuple(const std::vector<int32_t>& ids) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(ids.size()));
  if (t == nullptr) return nullptr;
  if (g_ints == nullptr) g_ints = new PyObject*[kInts]();
  // Each id reads its slot, then writes its object's count: both far apart in memory, so
  // they are fetched ahead (slots 2 * kAhead ids on, objects kAhead on) and their misses
  // overlap instead of following one another.
  constexpr size_t kAhead = 16;
  auto in_range = [](int32_t v) { return v >= 0 && v < kInts; };
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i + 2 * kAhead < ids.size() && in_range(ids[i + 2 * kAhead])) {
      __builtin_prefetch(&g_ints[ids[i + 2 * kAhead]]);
    }
    if (i + kAhead < ids.size() && in_range(ids[i + kAhead])) {
      if (PyObject* ahead = g_ints[ids[i + kAhead]]) __builtin_prefetch(ahead, 1);
    }
    PyObject* v = Int(ids[i]);
    if (v == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), v);
  }
  return t;
}

// decide's arguments. The prompt comes twice: as a tuple of ints (the request's), and as its
// native int32s, which placement hashes without reaching an int object per token.
PyObject* CallArgs(const Event& e) {
  PyObject* ids = e.has_ids ? IdsTuple(e.streamed) : (Py_INCREF(Py_None), Py_None);
  if (ids == nullptr) return nullptr;
  PyObject* packed = e.has_ids ? PyBytes_FromStringAndSize(
                                     reinterpret_cast<const char*>(e.streamed.data()),
                                     static_cast<Py_ssize_t>(e.streamed.size() * sizeof(int32_t)))
                               : (Py_INCREF(Py_None), Py_None);
  if (packed == nullptr) {
    Py_DECREF(ids);
    return nullptr;
  }
  return Py_BuildValue("(Ky#y#iNN)", e.call, e.body.data(),
                       static_cast<Py_ssize_t>(e.body.size()), e.auth.data(),
                       static_cast<Py_ssize_t>(e.auth.size()), e.status, ids, packed);
}

// This grpc thread's Python thread state: made on its first decision and kept, the GIL
// taken and let go around each decision with it. (PyGILState_Ensure/Release per decision
// would make and delete a thread state each time, and with it the frame stack Python maps
// for it, on every request's way to its worker.) grpc's threads last as long as their
// server; a state left by one that ended is cleared with the interpreter.
thread_local PyThreadState* t_python = nullptr;

void EnterPython() {
  if (t_python != nullptr) {
    PyEval_RestoreThread(t_python);
    return;
  }
  PyGILState_Ensure();  // never released: the state stays this thread's
}

void LeavePython() { t_python = PyEval_SaveThread(); }

// Python's decision on `e` now, on this thread; false when no handoff is installed.
bool Handoff(Event* e) {
  {
    std::unique_lock<std::mutex> lock(g_turn_mu);
    if (g_decide == nullptr) return false;
    ++g_waiting;
    g_turn_cv.wait(lock, [] { return !g_loop_running && !g_deciding; });
    --g_waiting;
    g_deciding = true;
  }
  EnterPython();
  if (g_decide != nullptr) {  // read again: cleared, under the GIL, when the loop ends
    PyObject* args = CallArgs(*e);
    PyObject* out = args != nullptr ? PyObject_Call(g_decide, args, nullptr) : nullptr;
    if (out == nullptr) PyErr_Print();  // never: the decision catches what it raises
    Py_XDECREF(out);
    Py_XDECREF(args);
  }
  LeavePython();
  {
    std::lock_guard<std::mutex> lock(g_turn_mu);
    g_deciding = false;
  }
  g_turn_cv.notify_all();
  return true;
}

// ------------------------------------------------------------------ Call

Call::Call(grpc::GenericCallbackServerContext* ctx, uint64_t id)
    : ctx_(ctx), id_(id), generate_(ctx->method() == kGenerate), arrived_(Clock::now()) {}

void Call::Start(std::shared_ptr<Call> self) {
  self_ = std::move(self);
  std::lock_guard<std::mutex> lock(mu_);
  if (!generate_) StartRelayLocked("");
  reading_ = true;
  StartRead(&incoming_);
}

void Call::OnReadDone(bool ok) {
  ReadDone(ok);
  DecideNow();
}

void Call::ReadDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  reading_ = false;
  if (mode_ == Mode::kRelay) {  // the client's stream to the Python server
    if (up_ == nullptr) return;
    if (ok) {
      up_->Write(incoming_);
      reading_ = true;
      StartRead(&incoming_);
    } else {
      up_->WritesDone();
    }
    return;
  }
  if (mode_ != Mode::kReading) return;
  if (!ok) {  // a Generate call with no request (the client half-closed or left)
    mode_ = Mode::kOver;
    EndLocked(Status(StatusCode::INVALID_ARGUMENT, "no request message"));
    return;
  }
  arrived_ = Clock::now();
  request_ = incoming_;
  bool whole;
  request_bytes_ = ToString(request_, &whole);
  if (!whole) {
    mode_ = Mode::kOver;
    EndLocked(Status(StatusCode::INTERNAL, "unreadable request"));
    return;
  }
  std::string auth;
  auto md = ctx_->client_metadata();
  auto it = md.find("authorization");
  if (it != md.end()) auth.assign(it->second.data(), it->second.size());
  mode_ = Mode::kDeciding;
  Event e{kCallEvent, id_};
  e.has_ids = SplitIds(request_bytes_, &e.body, &e.streamed, &packed_ids_);
  if (!e.has_ids) {
    e.body = request_bytes_;
    e.streamed.clear();
    packed_ids_.clear();
  }
  e.auth = std::move(auth);
  e.status = md.count("x-request-id") != 0 ? 1 : 0;
  decide_ = std::make_unique<Event>(std::move(e));
}

// After OnReadDone, without the call's lock (Python's decision calls back into the call).
void Call::DecideNow() {
  std::unique_ptr<Event> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = std::move(decide_);
  }
  if (e == nullptr) return;
  if (!Handoff(e.get())) Push(std::move(*e));
}

bool Call::Route(std::shared_ptr<Session> session, const std::string& body, std::string label,
                 std::string worker, double first_s, double token_s, double stall_s,
                 bool timings) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode_ != Mode::kDeciding || cancelled_) return false;
  timings_ = timings;
  routed_ = Clock::now();
  label_ = std::move(label);
  worker_ = std::move(worker);
  first_timeout_ = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(first_s));
  token_timeout_ = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(token_s));
  stall_ = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(stall_s));
  deadline_ = Clock::now() + first_timeout_;
  stall_at_ = Clock::now() + stall_;
  mode_ = Mode::kLocal;
  session_ = session;
  // Session::Send locks the session, which locks calls only after releasing its own lock.
  stream_ = session->Send(self_, body, packed_ids_);
  if (stream_ == 0) {  // it ended before this request got on it
    mode_ = Mode::kHandedBack;
    session_.reset();
    Event e{kFailedEvent, id_};
    e.status = kUnavailable;
    e.body = "the session with the decode worker ended before the request was sent";
    e.auth = "worker_unavailable";
    Push(std::move(e));
  }
  return true;
}

bool Call::Relay(const std::string& resume) {
  std::lock_guard<std::mutex> lock(mu_);
  if ((mode_ != Mode::kDeciding && mode_ != Mode::kHandedBack) || cancelled_) return false;
  StartRelayLocked(resume);
  up_->Write(request_);
  up_->WritesDone();
  return true;
}

bool Call::Refuse(int status, const std::string& message,
                  const std::vector<std::pair<std::string, std::string>>& trailers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode_ != Mode::kDeciding || cancelled_) return false;
  mode_ = Mode::kOver;
  for (auto& [k, v] : trailers) ctx_->AddTrailingMetadata(k, v);
  EndLocked(Status(static_cast<StatusCode>(status), message));
  return true;
}

void Call::StartRelayLocked(const std::string& resume) {
  mode_ = Mode::kRelay;
  up_ = new Upstream(self_, std::string(ctx_->method()), ctx_, resume);
}

void Call::OnChunk(const Chunk* chunk, Clock::time_point read_at) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode_ != Mode::kLocal) return;
  if (chunk == nullptr) {  // it did not parse
    session_->Cancel(stream_);
    DetachLocked();
    Event e{kFailedEvent, id_};
    e.status = kUnavailable;
    e.body = "the decode worker sent an unreadable message";
    e.auth = "worker_unavailable";
    e.streamed = streamed_;
    Push(std::move(e));
    return;
  }
  const Chunk& c = *chunk;
  auto now = Clock::now();
  bool first = !replied_;
  replied_ = true;
  if (c.has_token) streamed_.push_back(c.token);
  if (c.has_token && first_ == Clock::time_point()) first_ = read_at;
  deadline_ = now + token_timeout_;
  stall_at_ = now + stall_;
  std::string response = Response(c, label_, worker_);
  if (timings_ && c.finish != 0) {  // router.timings.StageClock's, for a local route
    auto ms = [](Clock::time_point a, Clock::time_point b) { return Seconds(b - a) * 1e3; };
    std::string t;
    if (first_ != Clock::time_point()) {
      PutDouble(&t, 5, ms(arrived_, first_));    // first_token_ms
      PutDouble(&t, 10, ms(routed_, first_));    // local_prefill_ms
    }
    PutDouble(&t, 6, ms(arrived_, now));         // total_ms
    PutDouble(&t, 8, ms(arrived_, routed_));     // route_ms
    PutLen(&response, 11, t);
  }
  auto handed = Clock::now();  // the response handed to grpc (which may write it at once)
  SendLocked(FromString(response));
  if (first) {
    Event e{kFirstEvent, id_};
    Clock::time_point forwarded{Clock::duration(forwarded_.load())};
    e.a = Seconds(forwarded - arrived_);
    e.b = Seconds(handed - read_at);
    e.status = c.has_token ? 1 : 0;
    Push(std::move(e));
  }
  if (c.finish != 0) {
    mode_ = Mode::kOver;
    session_.reset();
    EndLocked(Status::OK);
    Event e{kEndEvent, id_};
    e.status = 1;
    Push(std::move(e));
  }
}

void Call::OnWorkerError(int status, std::string message, std::string code,
                         std::string param) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode_ != Mode::kLocal) return;
  DetachLocked();  // the worker ended the request itself: nothing to cancel there
  Event e{kFailedEvent, id_};
  e.status = status;
  e.body = std::move(message);
  e.auth = std::move(code);
  e.param = std::move(param);
  e.streamed = streamed_;
  Push(std::move(e));
}

void Call::CheckDeadline(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode_ != Mode::kLocal) return;
  if (now >= stall_at_ && now < deadline_) {  // silent this long: Python probes the worker
    stall_at_ = now + stall_;
    Push(Event{kStalledEvent, id_});
    return;
  }
  if (now < deadline_) return;
  auto waited = replied_ ? token_timeout_ : first_timeout_;
  session_->Cancel(stream_);
  DetachLocked();
  Event e{kFailedEvent, id_};
  e.status = static_cast<int>(StatusCode::DEADLINE_EXCEEDED);
  e.body = "decode worker sent nothing for " +
           std::to_string(static_cast<long long>(Seconds(waited) + 0.5)) + "s";
  e.auth = "worker_timeout";
  e.streamed = streamed_;
  Push(std::move(e));
}

void Call::DetachLocked() {
  mode_ = Mode::kHandedBack;
  session_.reset();
  stream_ = 0;
}

void Call::UpMessage(const ByteBuffer& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  SendLocked(msg);
}

void Call::UpDone(const Status& status,
                  std::vector<std::pair<std::string, std::string>> trailers) {
  std::lock_guard<std::mutex> lock(mu_);
  up_ = nullptr;
  mode_ = Mode::kOver;
  if (finished_ || end_) return;
  for (auto& [k, v] : trailers) ctx_->AddTrailingMetadata(k, v);
  EndLocked(status);
}

void Call::SendLocked(ByteBuffer msg) {
  if (finished_ || end_ || cancelled_) return;
  out_.push_back(std::move(msg));
  if (!writing_) WriteNextLocked();
}

void Call::EndLocked(const Status& status) {
  if (end_) return;
  end_ = std::make_unique<Status>(status);
  if (!writing_) WriteNextLocked();
}

void Call::WriteNextLocked() {
  if (!out_.empty()) {
    writing_ = true;
    current_ = std::move(out_.front());
    out_.pop_front();
    StartWrite(&current_);
  } else if (end_ && !finished_) {
    finished_ = true;
    Finish(*end_);
  }
}

void Call::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  writing_ = false;
  if (!ok) out_.clear();  // the client is gone: OnCancel ends the call
  WriteNextLocked();
}

void Call::OnCancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  out_.clear();
  if (mode_ == Mode::kLocal) {
    session_->Cancel(stream_);
    DetachLocked();
    Event e{kEndEvent, id_};
    e.status = 0;
    Push(std::move(e));
  } else if (mode_ == Mode::kRelay && up_ != nullptr) {
    up_->Cancel();  // its OnDone ends this call
    return;
  }
  mode_ = Mode::kOver;
  EndLocked(Status::CANCELLED);
}

void Call::OnDone() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_calls.erase(id_);
  }
  auto keep = std::move(self_);  // may delete this: nothing below
}

class Service : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override {
    uint64_t id = ++g_next_call;
    auto call = std::make_shared<Call>(ctx, id);
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_calls[id] = call;
    }
    Call* raw = call.get();
    raw->Start(std::move(call));
    return raw;
  }
};

// ------------------------------------------------------------------ the process's instance

Service* g_service = nullptr;
grpc::Server* g_server = nullptr;
std::thread* g_watchdog = nullptr;
std::mutex g_stop_mu;
std::condition_variable g_stop_cv;
bool g_stopping = false;

void Watch() {
  std::unique_lock<std::mutex> lock(g_stop_mu);
  while (!g_stop_cv.wait_for(lock, std::chrono::milliseconds(50), [] { return g_stopping; })) {
    std::vector<std::shared_ptr<Call>> calls;
    {
      std::lock_guard<std::mutex> g(g_mu);
      calls.reserve(g_calls.size());
      for (auto& [id, weak] : g_calls) {
        if (auto call = weak.lock()) calls.push_back(std::move(call));
      }
    }
    auto now = Clock::now();
    for (auto& call : calls) call->CheckDeadline(now);
  }
}

// A Python sequence of (str, value) pairs; `format` is PyArg_ParseTuple's for one ("ss",
// "si"), `Raw` the C type its value parses into.
template <typename Raw, typename V>
bool Pairs(PyObject* seq, const char* format, std::vector<std::pair<std::string, V>>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of (name, value) pairs");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* k;
    Raw v;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), format, &k, &v)) {
      Py_DECREF(fast);
      return false;
    }
    out->emplace_back(k, v);
  }
  Py_DECREF(fast);
  return true;
}

PyObject* Start(PyObject*, PyObject* args) {
  const char *listen, *internal;
  PyObject *worker_md, *channel_args, *server_args, *tls;
  int max_message_bytes;
  if (!PyArg_ParseTuple(args, "ssOOOiO", &listen, &internal, &worker_md, &channel_args,
                        &server_args, &max_message_bytes, &tls)) {
    return nullptr;
  }
  if (g_server != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the data plane is already started");
    return nullptr;
  }
  Settings settings;
  std::vector<std::pair<std::string, int>> server_opts;
  settings.internal = internal;
  if (!Pairs<const char*>(worker_md, "ss", &settings.worker_metadata) ||
      !Pairs<int>(channel_args, "si", &settings.channel_args) ||
      !Pairs<int>(server_args, "si", &server_opts)) {
    return nullptr;
  }
  if (tls != Py_None) {  // (cert_pem, key_pem, ca_pem, require_client, server_name or "")
    const char *cert, *key, *ca, *name;
    Py_ssize_t cert_n, key_n, ca_n;
    int require;
    if (!PyArg_ParseTuple(tls, "y#y#y#ps", &cert, &cert_n, &key, &key_n, &ca, &ca_n, &require,
                          &name)) {
      return nullptr;
    }
    settings.tls = true;
    settings.require_client = require != 0;
    settings.cert_pem.assign(cert, cert_n);
    settings.key_pem.assign(key, key_n);
    settings.ca_pem.assign(ca, ca_n);
    settings.server_name = name;
  }
  g_settings = std::move(settings);
  g_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (g_efd < 0) return PyErr_SetFromErrno(PyExc_OSError);
  int port = 0;
  Py_BEGIN_ALLOW_THREADS
  g_internal = new grpc::GenericStub(ChannelTo(g_settings.internal));
  g_service = new Service();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, ServerCredentials(), &port);
  for (auto& [name, value] : server_opts) builder.AddChannelArgument(name, value);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.RegisterCallbackGenericService(g_service);
  g_server = builder.BuildAndStart().release();
  Py_END_ALLOW_THREADS
  if (g_server == nullptr || port == 0) {
    g_server = nullptr;
    PyErr_Format(PyExc_OSError, "the data plane could not listen on %s", listen);
    return nullptr;
  }
  g_stopping = false;
  g_watchdog = new std::thread(Watch);
  return Py_BuildValue("(ii)", port, g_efd);
}

PyObject* Take(PyObject*, PyObject*) {
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(g_ev_mu);
    events.swap(g_events);
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(events.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < events.size(); ++i) {
    Event& e = events[i];
    PyObject* item = nullptr;
    switch (e.kind) {
      case kCallEvent: {
        PyObject* args = CallArgs(e);
        if (args != nullptr) {
          item = Py_BuildValue("(iN)", e.kind, args);  // (kind, (call, ...))
        }
        break;
      }
      case kFirstEvent:
        item = Py_BuildValue("(iKddi)", e.kind, e.call, e.a, e.b, e.status);
        break;
      case kEndEvent:
        item = Py_BuildValue("(iKi)", e.kind, e.call, e.status);
        break;
      case kStalledEvent:
        item = Py_BuildValue("(iK)", e.kind, e.call);
        break;
      case kFailedEvent: {
        PyObject* ids = PyList_New(static_cast<Py_ssize_t>(e.streamed.size()));
        if (ids == nullptr) break;
        for (size_t j = 0; j < e.streamed.size(); ++j) {
          PyList_SET_ITEM(ids, j, PyLong_FromLong(e.streamed[j]));
        }
        item = Py_BuildValue("(iKiy#y#y#N)", e.kind, e.call, e.status, e.body.data(),
                             static_cast<Py_ssize_t>(e.body.size()), e.auth.data(),
                             static_cast<Py_ssize_t>(e.auth.size()), e.param.data(),
                             static_cast<Py_ssize_t>(e.param.size()), ids);
        break;
      }
    }
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, item);
  }
  return out;
}

PyObject* RouteCall(PyObject*, PyObject* args) {
  unsigned long long id;
  const char *address, *body, *label, *worker;
  Py_ssize_t body_len;
  double first_s, token_s, stall_s;
  int timings;
  if (!PyArg_ParseTuple(args, "Ksy#ssdddp", &id, &address, &body, &body_len, &label, &worker,
                        &first_s, &token_s, &stall_s, &timings)) {
    return nullptr;
  }
  auto call = FindCall(id);
  if (call == nullptr) Py_RETURN_FALSE;
  auto session = SessionTo(address);
  bool ok = call->Route(std::move(session), std::string(body, body_len), label, worker,
                        first_s, token_s, stall_s, timings != 0);
  return PyBool_FromLong(ok);
}

PyObject* RelayCall(PyObject*, PyObject* args) {
  unsigned long long id;
  const char* resume;
  if (!PyArg_ParseTuple(args, "Ks", &id, &resume)) return nullptr;
  auto call = FindCall(id);
  if (call == nullptr) Py_RETURN_FALSE;
  return PyBool_FromLong(call->Relay(resume));
}

PyObject* RefuseCall(PyObject*, PyObject* args) {
  unsigned long long id;
  int status;
  const char* message;
  PyObject* trailers;
  if (!PyArg_ParseTuple(args, "KisO", &id, &status, &message, &trailers)) return nullptr;
  std::vector<std::pair<std::string, std::string>> pairs;
  if (!Pairs<const char*>(trailers, "ss", &pairs)) return nullptr;
  auto call = FindCall(id);
  if (call == nullptr) Py_RETURN_FALSE;
  return PyBool_FromLong(call->Refuse(status, message, pairs));
}

PyObject* Drop(PyObject*, PyObject* args) {
  const char* address;
  if (!PyArg_ParseTuple(args, "s", &address)) return nullptr;
  std::shared_ptr<Session> session;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sessions.find(address);
    if (it != g_sessions.end()) {
      session = it->second;
      g_sessions.erase(it);
    }
    g_channels.erase(address);
  }
  if (session != nullptr) session->Close();  // its requests fail: Python places them again
  return PyBool_FromLong(session != nullptr);
}

PyObject* Stop(PyObject*, PyObject* args) {
  double grace_s;
  if (!PyArg_ParseTuple(args, "d", &grace_s)) return nullptr;
  if (g_server == nullptr) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  g_server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(grace_s)));
  {
    std::lock_guard<std::mutex> lock(g_stop_mu);
    g_stopping = true;
  }
  g_stop_cv.notify_all();
  if (g_watchdog != nullptr && g_watchdog->joinable()) g_watchdog->join();
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [address, s] : g_sessions) sessions.push_back(s);
  }
  for (auto& s : sessions) s->Close();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* SetHandoff(PyObject*, PyObject* args) {
  PyObject* decide;
  if (!PyArg_ParseTuple(args, "O", &decide)) return nullptr;
  PyObject* old;
  {
    std::lock_guard<std::mutex> lock(g_turn_mu);
    old = g_decide;
    if (decide == Py_None) {
      g_decide = nullptr;
    } else {
      Py_INCREF(decide);
      g_decide = decide;
    }
  }
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

PyObject* LoopIdle(PyObject*, PyObject*) {
  {
    std::lock_guard<std::mutex> lock(g_turn_mu);
    g_loop_running = false;
  }
  g_turn_cv.notify_all();
  Py_RETURN_NONE;
}

PyObject* LoopBusy(PyObject*, PyObject*) {
  bool free;
  {
    std::lock_guard<std::mutex> lock(g_turn_mu);
    free = g_waiting == 0 && !g_deciding;
    if (free) g_loop_running = true;
  }
  if (!free) {  // decisions first: wait for them without the GIL, which they need
    Py_BEGIN_ALLOW_THREADS
    std::unique_lock<std::mutex> lock(g_turn_mu);
    g_turn_cv.wait(lock, [] { return g_waiting == 0 && !g_deciding; });
    g_loop_running = true;
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

PyObject* Encode(PyObject*, PyObject* args) {
  // For tests: the GenerateResponse made here from a TokenChunk.
  const char *chunk, *label, *worker;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "y#ss", &chunk, &n, &label, &worker)) return nullptr;
  Chunk c;
  if (!ParseChunk(std::string_view(chunk, n), &c)) {
    PyErr_SetString(PyExc_ValueError, "unreadable TokenChunk");
    return nullptr;
  }
  std::string out = Response(c, label, worker);
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

PyMethodDef kMethods[] = {
    {"start", Start, METH_VARARGS,
     "start(listen, internal, worker_metadata, channel_args, server_args, max_message_bytes,"
     " tls) -> (port, eventfd)"},
    {"take", Take, METH_NOARGS, "take() -> the events queued since the last take"},
    {"route", RouteCall, METH_VARARGS,
     "route(call, address, body, label, worker_id, first_timeout_s, token_timeout_s, stall_s,"
     " timings) -> bool"},
    {"relay", RelayCall, METH_VARARGS, "relay(call, resume) -> bool"},
    {"refuse", RefuseCall, METH_VARARGS, "refuse(call, status, message, trailers) -> bool"},
    {"drop", Drop, METH_VARARGS, "drop(address) -> bool: end that worker's session"},
    {"stop", Stop, METH_VARARGS, "stop(grace_s): stop taking calls, end them after grace_s"},
    {"handoff", SetHandoff, METH_VARARGS,
     "handoff(decide | None): decide(call, body, auth, request_id_metadata, ids) runs on "
     "grpc's thread while the loop is parked (loop_idle / loop_busy); None: events instead"},
    {"loop_idle", LoopIdle, METH_NOARGS, "the event loop is about to wait in its selector"},
    {"loop_busy", LoopBusy, METH_NOARGS,
     "the event loop's selector returned: wait for decisions running or waiting"},
    {"encode_response", Encode, METH_VARARGS,
     "encode_response(token_chunk, label, worker_id) -> GenerateResponse bytes"},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_dataplane", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__dataplane() { return PyModule_Create(&kModule); }
