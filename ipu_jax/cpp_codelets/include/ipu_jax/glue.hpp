// ipu-jax's runner of C++ vertices inside an XLA FFI call (ipu-jax's own
// code, not a Poplar header).
//
// `build.py` generates, per vertex class V of a codelet file, one line
// `IPU_JAX_VERTEX(i, "Name", "field names", V, &V::field...)`: a describe
// function (the fields' kinds, shapes and dtypes, as the compiler sees their
// declared types) and an FFI handler that calls `run<V>`: it binds every
// field of one vertex object to its elements in the call's flat buffers and
// calls compute(), vertex after vertex, with no Python in between.
//
// Buffers: the read fields (Input, InOut, plain members) are the call's
// arguments and the written fields (Output, InOut) its results, each in the
// class's declaration order; every buffer holds all the call's vertices,
// vertex after vertex. The `layout` attribute gives, per field in
// declaration order, `[elements per vertex, number of spans, span lengths...]`
// (one span for scalar and vector fields), computed once in NumPy.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "poplar/Vertex.hpp"
#include "xla/ffi/api/ffi.h"

namespace ipu_jax {

namespace ffi = xla::ffi;

enum Kind { kIn = 0, kOut = 1, kInOut = 2 };
enum Shape { kScalar = 0, kVector = 1, kList = 2 };

template <class T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same<T, float>::value) return "float32";
  else if constexpr (std::is_same<T, double>::value) return "float64";
  else if constexpr (std::is_same<T, poplar::half>::value) return "float16";
  else if constexpr (std::is_same<T, bool>::value) return "bool";
  else if constexpr (std::is_integral<T>::value && std::is_signed<T>::value)
    return sizeof(T) == 1 ? "int8" : sizeof(T) == 2 ? "int16" : sizeof(T) == 4 ? "int32" : "int64";
  else if constexpr (std::is_integral<T>::value)
    return sizeof(T) == 1 ? "uint8" : sizeof(T) == 2 ? "uint16" : sizeof(T) == 4 ? "uint32" : "uint64";
  else return "unsupported";
}

// One field's buffer during a call.
struct Slot {
  char* base = nullptr;          // the first vertex's elements
  std::int64_t stride = 0;       // bytes per vertex
  std::int64_t per_vertex = 0;   // elements per vertex
  std::vector<std::int64_t> spans;  // list fields: each span's length
  std::vector<std::max_align_t> scratch;  // list fields: the span objects
};

template <class S>
S* span_objects(Slot& s) {
  std::size_t words = (s.spans.size() * sizeof(S) + sizeof(std::max_align_t) - 1) /
                      sizeof(std::max_align_t);
  if (s.scratch.size() < words) s.scratch.resize(words);
  return reinterpret_cast<S*>(s.scratch.data());
}

// Binds one span object after another to consecutive elements.
template <class S, class E>
void bind_spans(S* objs, Slot& s, std::int64_t k) {
  E* p = reinterpret_cast<E*>(s.base + k * s.stride);
  for (std::size_t j = 0; j < s.spans.size(); ++j) {
    objs[j].ptr_ = p;
    objs[j].size_ = static_cast<std::size_t>(s.spans[j]);
    p += s.spans[j];
  }
}

template <Kind K, Shape Sh, class E, bool Attr = false>
struct Meta {
  static constexpr Kind kind = K;
  static constexpr Shape shape = Sh;
  static constexpr bool attribute = Attr;
  using element = E;
};

template <class F, class = void>
struct Traits;  // a field type ipu-jax cannot bind: see Traits below

// Plain members: vertex state set once (Poplar's setInitialValue).
template <class F>
struct Traits<F, std::enable_if_t<std::is_arithmetic<F>::value ||
                                  std::is_same<F, poplar::half>::value>>
    : Meta<kIn, kScalar, F, true> {
  static void bind(F& f, Slot& s, std::int64_t k) {
    std::memcpy(&f, s.base + k * s.stride, sizeof(F));
  }
};
template <class E, poplar::VectorLayout L, unsigned A, bool I>
struct Traits<poplar::Vector<E, L, A, I>,
              std::enable_if_t<std::is_arithmetic<E>::value ||
                               std::is_same<E, poplar::half>::value>>
    : Meta<kIn, kVector, E, true> {
  static void bind(poplar::Vector<E, L, A, I>& f, Slot& s, std::int64_t k) {
    f.ptr_ = reinterpret_cast<E*>(s.base + k * s.stride);
    f.size_ = static_cast<std::size_t>(s.per_vertex);
  }
};

// Scalar, vector and list fields of each direction.
#define IPU_JAX_FIELD_TRAITS(FIELD, KIND)                                         \
  template <class E>                                                              \
  struct Traits<poplar::FIELD<E>, std::enable_if_t<std::is_arithmetic<E>::value || \
                                                   std::is_same<E, poplar::half>::value>> \
      : Meta<KIND, kScalar, E> {                                                  \
    static void bind(poplar::FIELD<E>& f, Slot& s, std::int64_t k) {              \
      f.ptr_ = reinterpret_cast<E*>(s.base + k * s.stride);                       \
    }                                                                             \
  };                                                                              \
  template <class E, poplar::VectorLayout L, unsigned A, bool I>                  \
  struct Traits<poplar::FIELD<poplar::Vector<E, L, A, I>>> : Meta<KIND, kVector, E> { \
    static void bind(poplar::FIELD<poplar::Vector<E, L, A, I>>& f, Slot& s,       \
                     std::int64_t k) {                                            \
      f.ptr_ = reinterpret_cast<E*>(s.base + k * s.stride);                       \
      f.size_ = static_cast<std::size_t>(s.per_vertex);                           \
    }                                                                             \
  };                                                                              \
  template <class E, poplar::VectorListLayout L, unsigned A, bool I>              \
  struct Traits<poplar::FIELD<poplar::VectorList<E, L, A, I>>> : Meta<KIND, kList, E> { \
    using F = poplar::FIELD<poplar::VectorList<E, L, A, I>>;                      \
    using S = std::remove_const_t<std::remove_reference_t<decltype(*F().subs_)>>; \
    static void bind(F& f, Slot& s, std::int64_t k) {                             \
      S* objs = span_objects<S>(s);                                               \
      bind_spans<S, E>(objs, s, k);                                               \
      f.subs_ = objs;                                                             \
      f.size_ = s.spans.size();                                                   \
    }                                                                             \
  };                                                                              \
  /* A vector of fields (PopLibs' 2-D operands): a list of spans. */              \
  template <class E, poplar::VectorLayout L, unsigned A, bool I,                  \
            poplar::VectorLayout L2, unsigned A2, bool I2>                        \
  struct Traits<poplar::Vector<poplar::FIELD<poplar::Vector<E, L, A, I>>, L2, A2, I2>> \
      : Meta<KIND, kList, E> {                                                    \
    using S = poplar::FIELD<poplar::Vector<E, L, A, I>>;                          \
    static void bind(poplar::Vector<S, L2, A2, I2>& f, Slot& s, std::int64_t k) { \
      S* objs = span_objects<S>(s);                                               \
      bind_spans<S, E>(objs, s, k);                                               \
      f.ptr_ = objs;                                                              \
      f.size_ = s.spans.size();                                                   \
    }                                                                             \
  };

IPU_JAX_FIELD_TRAITS(Input, kIn)
IPU_JAX_FIELD_TRAITS(Output, kOut)
IPU_JAX_FIELD_TRAITS(InOut, kInOut)
#undef IPU_JAX_FIELD_TRAITS

// "name kind shape dtype attribute" of one field, for describe().
template <class F>
std::string describe_field(const char* name) {
  using T = Traits<F>;
  static const char* kinds[] = {"in", "out", "inout"};
  static const char* shapes[] = {"scalar", "vector", "vector_list"};
  return std::string(name) + " " + kinds[T::kind] + " " + shapes[T::shape] + " " +
         dtype_name<typename T::element>() + " " + (T::attribute ? "1" : "0") + ";";
}

struct FieldMeta {
  Kind kind;
  int element_size;
};

template <class F>
constexpr FieldMeta field_meta() {
  return FieldMeta{Traits<F>::kind, static_cast<int>(sizeof(typename Traits<F>::element))};
}

template <class V>
using BindFn = void (*)(V*, Slot&, std::int64_t);

template <class V, class = void>
struct HasWorkers : std::false_type {};
template <class V>
struct HasWorkers<V, std::void_t<decltype(std::declval<V&>().compute(0u))>> : std::true_type {};

template <class R>
bool succeeded(R r) { return static_cast<bool>(r); }

// compute() of one vertex; a MultiVertex's compute(workerId) for every
// worker, the last first, so a worker that waits for the others' results
// (worker 0 gathering them, the usual pattern) finds them written.
template <class V>
bool compute_vertex(V* v) {
  if constexpr (HasWorkers<V>::value) {
    for (unsigned w = V::numWorkers(); w-- > 0;) {
      if constexpr (std::is_void<decltype(v->compute(w))>::value) v->compute(w);
      else if (!succeeded(v->compute(w))) return false;
    }
    return true;
  } else {
    if constexpr (std::is_void<decltype(v->compute())>::value) {
      v->compute();
      return true;
    } else {
      return succeeded(v->compute());
    }
  }
}

// Connects every field's buffer to its slot; returns the number of vertices.
inline ffi::Error connect(const char* name, ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                          ffi::Span<const std::int64_t> layout, const FieldMeta* meta,
                          std::size_t nfields, std::vector<Slot>& slots, std::int64_t& vertices) {
  std::size_t pos = 0, ai = 0, ri = 0;
  vertices = -1;
  for (std::size_t i = 0; i < nfields; ++i) {
    if (pos + 2 > layout.size()) return ffi::Error::InvalidArgument(std::string(name) + ": short layout");
    Slot& s = slots[i];
    s.per_vertex = layout[pos];
    std::int64_t nspans = layout[pos + 1];
    s.spans.assign(layout.begin() + pos + 2, layout.begin() + pos + 2 + nspans);
    pos += 2 + nspans;
    void* in_data = nullptr;
    std::size_t count = 0, bytes = 0;
    if (meta[i].kind != kOut) {
      auto a = args.get<ffi::AnyBuffer>(ai++);
      if (a.has_error()) return a.error();
      in_data = a->untyped_data();
      count = a->element_count();
      bytes = a->size_bytes();
      s.base = static_cast<char*>(in_data);
    }
    if (meta[i].kind != kIn) {
      auto r = rets.get<ffi::AnyBuffer>(ri++);
      if (r.has_error()) return r.error();
      s.base = static_cast<char*>((*r)->untyped_data());
      count = (*r)->element_count();
      bytes = (*r)->size_bytes();
      if (in_data != nullptr && in_data != s.base) std::memcpy(s.base, in_data, bytes);
      else if (in_data == nullptr) std::memset(s.base, 0, bytes);  // outputs start zeroed
    }
    if (count && static_cast<std::int64_t>(bytes / count) != meta[i].element_size)
      return ffi::Error::InvalidArgument(std::string(name) + ": field " + std::to_string(i) +
                                         " has the wrong element size");
    s.stride = s.per_vertex * meta[i].element_size;
    if (s.per_vertex > 0) {
      std::int64_t n = static_cast<std::int64_t>(count) / s.per_vertex;
      if (n * s.per_vertex != static_cast<std::int64_t>(count) || (vertices >= 0 && n != vertices))
        return ffi::Error::InvalidArgument(std::string(name) + ": fields hold different numbers of vertices");
      vertices = n;
    }
  }
  if (vertices < 0) vertices = 0;
  return ffi::Error::Success();
}

// Runs every vertex of the call: bind its fields, compute().
template <class V>
ffi::Error run(const char* name, ffi::RemainingArgs args, ffi::RemainingRets rets,
               ffi::Span<const std::int64_t> layout, const FieldMeta* meta,
               const BindFn<V>* binds, std::size_t nfields) {
  std::vector<Slot> slots(nfields);
  std::int64_t vertices = 0;
  ffi::Error connected = connect(name, args, rets, layout, meta, nfields, slots, vertices);
  if (connected.failure()) return connected;
  // Vertex objects are never constructed (Poplar does not construct them
  // either: codelets may declare constructors they never define); each
  // vertex starts from zeroed state with its fields bound.
  std::vector<std::aligned_storage_t<sizeof(V), alignof(V)>> storage(1);
  V* v = reinterpret_cast<V*>(storage.data());
  for (std::int64_t k = 0; k < vertices; ++k) {
    std::memset(static_cast<void*>(storage.data()), 0, sizeof(V));
    for (std::size_t i = 0; i < nfields; ++i) binds[i](v, slots[i], k);
    if (!compute_vertex(v))
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string(name) + ": compute() returned false for vertex " +
                            std::to_string(k) + " of the call");
  }
  return ffi::Error::Success();
}

template <class>
struct MemberOf;
template <class C, class T>
struct MemberOf<T C::*> {
  using type = std::remove_cv_t<T>;  // `const unsigned n;`: state set once, bound all the same
};

template <class V, auto M>
void bind_member(V* v, Slot& s, std::int64_t k) {
  using T = typename MemberOf<decltype(M)>::type;
  Traits<T>::bind(const_cast<T&>(v->*M), s, k);
}

// The entry points of vertex class V whose fields are the members M...
template <class V, auto... M>
struct Entry {
  static constexpr std::size_t count = sizeof...(M);

  static ffi::Error call(const char* name, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const std::int64_t> layout) {
    static const FieldMeta meta[count + 1] = {
        field_meta<typename MemberOf<decltype(M)>::type>()..., FieldMeta{kIn, 0}};
    static const BindFn<V> binds[count + 1] = {&bind_member<V, M>..., nullptr};
    return run<V>(name, std::move(args), std::move(rets), layout, meta, binds, count);
  }

  // `names`: the fields' names, separated by spaces, in the order of M...
  static std::string describe(const char* names) {
    std::vector<std::string> split;
    std::string word;
    for (const char* c = names; ; ++c) {
      if (*c == ' ' || *c == 0) {
        if (!word.empty()) split.push_back(word);
        word.clear();
        if (*c == 0) break;
      } else {
        word += *c;
      }
    }
    std::string out;
    std::size_t i = 0;
    ((out += describe_field<typename MemberOf<decltype(M)>::type>(split.at(i++).c_str())), ...);
    return out;
  }
};

}  // namespace ipu_jax

#define IPU_JAX_VERTEX(I, NAME, FIELD_NAMES, V, ...)                                     \
  namespace {                                                                            \
  using IpuJaxEntry##I = ipu_jax::Entry<V, ##__VA_ARGS__>;                               \
  xla::ffi::Error ipu_jax_impl_##I(xla::ffi::RemainingArgs a, xla::ffi::RemainingRets r, \
                                   xla::ffi::Span<const std::int64_t> layout) {          \
    return IpuJaxEntry##I::call(NAME, std::move(a), std::move(r), layout);               \
  }                                                                                      \
  }                                                                                      \
  extern "C" const char* ipu_jax_describe_##I() {                                        \
    static const std::string s = IpuJaxEntry##I::describe(FIELD_NAMES);                  \
    return s.c_str();                                                                    \
  }                                                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                         \
      ipu_jax_run_##I, ipu_jax_impl_##I,                                                 \
      xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<                        \
          xla::ffi::Span<const std::int64_t>>("layout"));
