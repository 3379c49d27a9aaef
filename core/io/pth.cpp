#include "core/io/pth.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <variant>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include "core/io/read_file.h"
#include "core/util/error.h"

namespace diffract::io {

namespace {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Global {
  std::string module, name;
};
struct StorageRef {
  c10::ScalarType dtype;
  std::string key;
  int64_t numel;
};
struct Tuple {
  std::vector<ValuePtr> items;
};
struct Dict {
  std::vector<std::pair<ValuePtr, ValuePtr>> items;
};
struct Mark {};
struct Opaque {};  // the result of a call this reader does not model

struct Value {
  std::variant<std::monostate, bool, int64_t, double, std::string, Global, StorageRef, Tuple, Dict, at::Tensor, Mark,
               Opaque>
      v;
  int depth = 0;  // containers inside containers: the shared_ptr tree is freed recursively
};

// A state dict nests a few levels (dict, tensor rebuild arguments, shape tuples); this leaves room
// for metadata while keeping the recursive destruction of the tree far from the stack's end.
constexpr int kMaxDepth = 256;
// data.pkl of an SDXL checkpoint is under a megabyte.
constexpr std::size_t kMaxPickleBytes = std::size_t(256) << 20;
// Values on the stack and memo entries: a state dict of 10 000 tensors uses about 50 000 memo
// entries; millions of one-byte opcodes would otherwise hold gigabytes of values.
constexpr std::size_t kMaxEntries = std::size_t(4) << 20;

ValuePtr make(decltype(Value::v) v) { return std::make_shared<Value>(Value{std::move(v)}); }

c10::ScalarType storage_dtype(const std::string& name, const std::string& where) {
  static const std::map<std::string, c10::ScalarType> kTypes = {
      {"FloatStorage", c10::kFloat},        {"DoubleStorage", c10::kDouble},
      {"HalfStorage", c10::kHalf},          {"BFloat16Storage", c10::kBFloat16},
      {"LongStorage", c10::kLong},          {"IntStorage", c10::kInt},
      {"ShortStorage", c10::kShort},        {"CharStorage", c10::kChar},
      {"ByteStorage", c10::kByte},          {"BoolStorage", c10::kBool},
      {"Float8_e4m3fnStorage", c10::kFloat8_e4m3fn}, {"Float8_e5m2Storage", c10::kFloat8_e5m2},
  };
  auto it = kTypes.find(name);
  if (it == kTypes.end()) throw Error(where + ": unsupported storage type torch." + name);
  return it->second;
}

class Unpickler {
 public:
  Unpickler(const std::string& where, caffe2::serialize::PyTorchStreamReader& zip) : where_(where), zip_(zip) {}
  // A pickle can make a list or dict hold itself (through the memo): the shared_ptr cycles would
  // never be freed, so every container is emptied here (found by tests/fuzz/fuzz_pth).
  ~Unpickler() {
    for (auto& c : containers_) {
      if (auto* t = std::get_if<Tuple>(&c->v)) t->items.clear();
      if (auto* d = std::get_if<Dict>(&c->v)) d->items.clear();
    }
  }
  Unpickler(const Unpickler&) = delete;
  Unpickler& operator=(const Unpickler&) = delete;

  ValuePtr run(const char* data, std::size_t size) {
    p_ = data;
    end_ = data + size;
    while (true) {
      const auto op = u8();
      switch (op) {
        case 0x80: u8(); break;                          // PROTO
        case 0x95: bytes(8); break;                      // FRAME
        case '.': return pop();                          // STOP
        case '(': push(make(Mark{})); break;             // MARK
        case '0': pop(); break;                          // POP
        case '1': pop_mark(); break;                     // POP_MARK
        case 'N': push(make(std::monostate{})); break;   // NONE
        case 0x88: push(make(true)); break;              // NEWTRUE
        case 0x89: push(make(false)); break;             // NEWFALSE
        case 'K': push(make(int64_t(u8()))); break;      // BININT1
        case 'M': push(make(int64_t(le<uint16_t>()))); break;  // BININT2
        case 'J': push(make(int64_t(le<int32_t>()))); break;   // BININT
        case 0x8a: push(make(long1())); break;           // LONG1
        case 'G': push(make(be_double())); break;        // BINFLOAT
        case 'X': push(make(str(le<uint32_t>()))); break;      // BINUNICODE
        case 0x8c: push(make(str(u8()))); break;         // SHORT_BINUNICODE
        case 0x8d: push(make(str(le<uint64_t>()))); break;     // BINUNICODE8
        case 'U': push(make(str(u8()))); break;          // SHORT_BINSTRING
        case 'T': push(make(str(le<uint32_t>()))); break;      // BINSTRING
        case 'c': {                                      // GLOBAL
          auto module = line();
          auto name = line();
          push(make(Global{module, name}));
          break;
        }
        case 'q': put(u8()); break;                      // BINPUT
        case 'r': put(le<uint32_t>()); break;            // LONG_BINPUT
        case 0x94: put(static_cast<uint32_t>(memo_.size())); break;  // MEMOIZE
        case 'h': push(memo(u8())); break;               // BINGET
        case 'j': push(memo(le<uint32_t>())); break;     // LONG_BINGET
        case ')': push(container(Tuple{})); break;       // EMPTY_TUPLE
        case 0x85: push(tuple(pop_n(1))); break;         // TUPLE1
        case 0x86: push(tuple(pop_n(2))); break;         // TUPLE2
        case 0x87: push(tuple(pop_n(3))); break;         // TUPLE3
        case 't': push(tuple(pop_mark())); break;        // TUPLE
        case ']': push(container(Tuple{})); break;       // EMPTY_LIST (lists are read as tuples)
        case 'l': push(tuple(pop_mark())); break;        // LIST
        case 'a': {                                      // APPEND
          auto v = pop();
          nest(top(), v);
          as<Tuple>(top(), "APPEND").items.push_back(v);
          break;
        }
        case 'e': {                                      // APPENDS
          auto items = pop_mark();
          for (const auto& v : items) nest(top(), v);
          auto& list = as<Tuple>(top(), "APPENDS").items;
          list.insert(list.end(), items.begin(), items.end());
          break;
        }
        case '}': push(container(Dict{})); break;        // EMPTY_DICT
        case 'd': {                                      // DICT
          auto items = pop_mark();
          auto d = container(dict_of(items));
          for (const auto& v : items) nest(d, v);
          push(d);
          break;
        }
        case 's': {                                      // SETITEM
          auto v = pop();
          auto k = pop();
          nest(top(), k);
          nest(top(), v);
          as<Dict>(top(), "SETITEM").items.emplace_back(k, v);
          break;
        }
        case 'u': {                                      // SETITEMS
          auto items = pop_mark();
          for (const auto& v : items) nest(top(), v);
          auto kv = dict_of(items);
          auto& d = as<Dict>(top(), "SETITEMS").items;
          d.insert(d.end(), kv.items.begin(), kv.items.end());
          break;
        }
        case 'b': pop(); break;  // BUILD: object state (a state dict's _metadata) is not needed
        case 'Q': push(persistent_load(pop())); break;   // BINPERSID
        case 'R': {                                      // REDUCE
          auto args = pop();
          auto fn = pop();
          push(reduce(fn, args));
          break;
        }
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          throw Error(where_ + ": unsupported pickle opcode " + hex + " (not a plain state dict?)");
        }
      }
    }
  }

 private:
  [[noreturn]] void corrupt(const std::string& why) const { throw Error(where_ + ": corrupt pickle: " + why); }

  const char* bytes(std::size_t n) {
    if (static_cast<std::size_t>(end_ - p_) < n) corrupt("unexpected end of data");
    const char* b = p_;
    p_ += n;
    return b;
  }
  uint8_t u8() { return static_cast<uint8_t>(*bytes(1)); }
  template <typename T>
  T le() {
    T v;
    std::memcpy(&v, bytes(sizeof(T)), sizeof(T));
    return v;
  }
  double be_double() {
    const char* b = bytes(8);
    char r[8];
    for (int i = 0; i < 8; ++i) r[i] = b[7 - i];
    double d;
    std::memcpy(&d, r, 8);
    return d;
  }
  int64_t long1() {
    const auto n = u8();
    if (n > 8) corrupt("integer wider than 64 bits");
    const char* b = bytes(n);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t(static_cast<uint8_t>(b[i])) << (8 * i);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t(0) << (8 * n);
    return static_cast<int64_t>(v);
  }
  std::string str(uint64_t n) { return std::string(bytes(n), n); }
  std::string line() {
    const char* nl = static_cast<const char*>(std::memchr(p_, '\n', static_cast<std::size_t>(end_ - p_)));
    if (!nl) corrupt("unterminated GLOBAL");
    std::string s(p_, nl);
    p_ = nl + 1;
    return s;
  }

  void push(ValuePtr v) {
    if (stack_.size() >= kMaxEntries) corrupt("more than " + std::to_string(kMaxEntries) + " values on the stack");
    stack_.push_back(std::move(v));
  }
  void put(uint32_t index) {
    if (memo_.size() >= kMaxEntries && !memo_.count(index))
      corrupt("more than " + std::to_string(kMaxEntries) + " memo entries");
    memo_[index] = top();
  }
  ValuePtr container(decltype(Value::v) v) {
    auto c = make(std::move(v));
    containers_.push_back(c);
    return c;
  }
  // `outer` now holds `inner`: its depth, bounded.
  void nest(const ValuePtr& outer, const ValuePtr& inner) {
    outer->depth = std::max(outer->depth, inner->depth + 1);
    if (outer->depth > kMaxDepth) corrupt("containers nested deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  ValuePtr tuple(std::vector<ValuePtr> items) {
    auto t = container(Tuple{});
    for (const auto& v : items) nest(t, v);
    std::get<Tuple>(t->v).items = std::move(items);
    return t;
  }
  ValuePtr pop() {
    if (stack_.empty()) corrupt("stack underflow");
    auto v = stack_.back();
    stack_.pop_back();
    return v;
  }
  ValuePtr& top() {
    if (stack_.empty()) corrupt("stack underflow");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_n(std::size_t n) {
    if (stack_.size() < n) corrupt("stack underflow");
    std::vector<ValuePtr> out(stack_.end() - static_cast<long>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return out;
  }
  std::vector<ValuePtr> pop_mark() {
    for (std::size_t i = stack_.size(); i-- > 0;)
      if (std::holds_alternative<Mark>(stack_[i]->v)) {
        std::vector<ValuePtr> out(stack_.begin() + static_cast<long>(i) + 1, stack_.end());
        stack_.resize(i);
        return out;
      }
    corrupt("MARK not found");
  }
  ValuePtr memo(uint32_t i) {
    auto it = memo_.find(i);
    if (it == memo_.end()) corrupt("memo entry " + std::to_string(i) + " used before it is set");
    return it->second;
  }
  template <typename T>
  T& as(const ValuePtr& v, const char* op) {
    if (auto* t = std::get_if<T>(&v->v)) return *t;
    corrupt(std::string(op) + " on the wrong kind of object");
  }
  Dict dict_of(const std::vector<ValuePtr>& flat) {
    if (flat.size() % 2) corrupt("odd number of dict items");
    Dict d;
    for (std::size_t i = 0; i < flat.size(); i += 2) d.items.emplace_back(flat[i], flat[i + 1]);
    return d;
  }
  int64_t int_of(const ValuePtr& v) {
    if (auto* i = std::get_if<int64_t>(&v->v)) return *i;
    corrupt("expected an integer");
  }
  std::vector<int64_t> ints_of(const ValuePtr& v) {
    std::vector<int64_t> out;
    for (const auto& x : as<Tuple>(v, "tensor shape").items) out.push_back(int_of(x));
    return out;
  }

  ValuePtr persistent_load(const ValuePtr& pid) {
    // ('storage', torch.<Type>Storage, key, location, numel)
    const auto& t = as<Tuple>(pid, "BINPERSID").items;
    if (t.size() < 5) corrupt("storage reference with " + std::to_string(t.size()) + " fields");
    const auto* type = std::get_if<Global>(&t[1]->v);
    const auto* key = std::get_if<std::string>(&t[2]->v);
    if (!type || !key) corrupt("malformed storage reference");
    return make(StorageRef{storage_dtype(type->name, where_), *key, int_of(t[4])});
  }

  at::Tensor storage_tensor(const StorageRef& s) {
    auto it = storages_.find(s.key);
    if (it != storages_.end()) return it->second;
    const std::string record = "data/" + s.key;
    if (!zip_.hasRecord(record)) throw Error(where_ + ": storage record '" + record + "' is missing");
    // The entry's size as the archive claims it, against what the pickle says the storage holds,
    // before anything is inflated; then inflated straight into the tensor.
    const std::size_t elem = c10::elementSize(s.dtype);
    if (s.numel < 0 || static_cast<uint64_t>(s.numel) > (uint64_t(1) << 62) / elem)
      corrupt("storage '" + s.key + "' of " + std::to_string(s.numel) + " elements");
    const auto bytes_needed = static_cast<std::size_t>(s.numel) * elem;
    const std::size_t claimed = zip_.getRecordSize(record);
    if (claimed != bytes_needed)
      throw Error(where_ + ": storage '" + s.key + "' holds " + std::to_string(claimed) + " bytes, expected " +
                  std::to_string(bytes_needed));
    auto t = at::empty({s.numel}, at::TensorOptions().dtype(s.dtype));
    if (bytes_needed > 0 && zip_.getRecord(record, t.data_ptr(), bytes_needed) != bytes_needed)
      throw Error(where_ + ": storage '" + s.key + "' is shorter than its " + std::to_string(bytes_needed) + " bytes");
    storages_.emplace(s.key, t);
    return t;
  }

  ValuePtr reduce(const ValuePtr& fn, const ValuePtr& args) {
    const auto* g = std::get_if<Global>(&fn->v);
    if (!g) return make(Opaque{});
    if (g->module == "collections" && (g->name == "OrderedDict" || g->name == "defaultdict")) return container(Dict{});
    const auto& a = as<Tuple>(args, "REDUCE").items;
    if (g->module == "torch._utils" && g->name == "_rebuild_tensor_v2") {
      // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
      if (a.size() < 4) corrupt("_rebuild_tensor_v2 with too few arguments");
      const auto& s = std::get_if<StorageRef>(&a[0]->v);
      if (!s) corrupt("_rebuild_tensor_v2 without a storage");
      auto storage = storage_tensor(*s);
      const auto offset = int_of(a[1]);
      const auto size = ints_of(a[2]), stride = ints_of(a[3]);
      if (size.size() != stride.size() || size.size() > 16) corrupt("a tensor's size and stride do not match");
      int64_t extent = 1;  // the last element the view reaches, plus one
      for (std::size_t i = 0; i < size.size(); ++i) {
        if (size[i] < 0 || stride[i] < 0) corrupt("a negative tensor size or stride");
        if (size[i] == 0) extent = 0;
      }
      if (extent) {
        for (std::size_t i = 0; i < size.size(); ++i) {
          int64_t reach = 0;
          if (__builtin_mul_overflow(size[i] - 1, stride[i], &reach) || __builtin_add_overflow(extent, reach, &extent))
            corrupt("a tensor's size overflows");
        }
        if (offset < 0 || offset > s->numel || extent > s->numel - offset)
          throw Error(where_ + ": a tensor reaches past its storage '" + s->key + "'");
      }
      return make(storage.as_strided(size, stride, offset));
    }
    if (g->module == "torch._utils" && (g->name == "_rebuild_parameter" || g->name == "_rebuild_parameter_with_state")) {
      if (a.empty() || !std::holds_alternative<at::Tensor>(a[0]->v)) corrupt("_rebuild_parameter without a tensor");
      return a[0];
    }
    return make(Opaque{});
  }

  std::string where_;
  caffe2::serialize::PyTorchStreamReader& zip_;
  const char* p_ = nullptr;
  const char* end_ = nullptr;
  std::vector<ValuePtr> stack_;
  std::vector<ValuePtr> containers_;  // every tuple, list and dict made, emptied at the end
  std::map<uint32_t, ValuePtr> memo_;
  std::map<std::string, at::Tensor> storages_;
};

StateDict to_state_dict(const ValuePtr& root, const std::string& where, bool nested = false) {
  const auto* d = std::get_if<Dict>(&root->v);
  if (!d) throw Error(where + ": does not hold a state dict (a dict of tensors)");
  StateDict out;
  for (const auto& [k, v] : d->items) {
    const auto* key = std::get_if<std::string>(&k->v);
    if (!key) continue;
    if (const auto* t = std::get_if<at::Tensor>(&v->v)) out[*key] = *t;
    else if (!nested && *key == "state_dict" && std::holds_alternative<Dict>(v->v)) return to_state_dict(v, where, true);
  }
  if (out.empty()) throw Error(where + ": no tensors found in the pickled dict");
  return out;
}

// LibTorch's zip reader words its errors for its own developers ("This is an internal error...");
// the user gets the first sentence, which says what is wrong with the file.
std::string zip_reason(const c10::Error& e) {
  std::string why = e.what_without_backtrace();
  for (const char* cut : {"\n", " This is an internal error", " Please report a bug"})
    if (const auto p = why.find(cut); p != std::string::npos) why.resize(p);
  return why;
}

}  // namespace

StateDict load_pth(const std::filesystem::path& path) {
  const std::string where = path.string();
  {
    const auto head = read_file_head(path, 2);  // a FIFO, a folder, a missing file: an Error here
    if (head != "PK")
      throw Error(where + ": not a torch.save zip archive (legacy pickled checkpoints are not supported; "
                  "re-save it with torch.save or convert it to safetensors)");
  }
  try {
    caffe2::serialize::PyTorchStreamReader zip(path.string());
    if (!zip.hasRecord("data.pkl")) throw Error(where + ": no data.pkl in the archive");
    if (const auto claimed = zip.getRecordSize("data.pkl"); claimed > kMaxPickleBytes)
      throw Error(where + ": its data.pkl claims " + std::to_string(claimed) +
                  " bytes, more than a state dict's pickle can need");
    auto [ptr, size] = zip.getRecord("data.pkl");
    Unpickler unpickler(where, zip);
    return to_state_dict(unpickler.run(static_cast<const char*>(ptr.get()), size), where);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(where + ": not a readable torch.save archive: " + zip_reason(e));
  } catch (const std::exception& e) {
    // LibTorch's reader parses the archive's version record with std::stoull, which throws
    // std::out_of_range / std::invalid_argument for a number too long or no number at all.
    throw Error(where + ": not a readable torch.save archive: a record LibTorch's zip reader could not parse (" +
                std::string(e.what()).substr(0, 80) + ")");
  }
}

}  // namespace diffract::io
