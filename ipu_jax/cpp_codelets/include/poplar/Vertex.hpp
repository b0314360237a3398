// poplar/Vertex.hpp for ipu-jax's host build of C++ codelets.
//
// Written here, for ipu-jax, from Poplar's documented semantics of vertex
// code (the Poplar and PopLibs user guide's "Vertices" chapter and the
// tutorials' vertex code); no Graphcore code or header is copied. It gives
// what a codelet file needs to compile for the host, as Poplar's IPUModel
// compiles codelets for the host:
//
// * `Vertex`, `SupervisorVertex`, `MultiVertex`: the base classes. A
//   vertex's `bool compute()` runs once per vertex; a MultiVertex's
//   `bool compute(unsigned workerId)` runs for every worker 0..5 in turn
//   (the IPUModel runs the workers one after another).
// * `Input<T>`, `Output<T>`, `InOut<T>`: fields connected to tensor
//   elements. `T` is a scalar type (one element: read it as `*in` or `in`,
//   write it as `*out = x` or `out = x`), `Vector<E, ...>` (a span of
//   elements: `size()`, `operator[]`, `data()`, iteration) or
//   `VectorList<E, ...>` (a list of spans: `size()` spans, `operator[]`
//   gives one). Input's elements are read-only.
// * `Vector<Input<Vector<E>>>` (and Output/InOut): a vector of fields, i.e.
//   a list of spans, as PopLibs' codelets write their 2-D operands.
// * A plain member (`float scale;`, `Vector<float> coeffs;`) is a vertex
//   state field set once when the graph is built (`setInitialValue`).
// * Layout and alignment template arguments (`VectorLayout::ONE_PTR`,
//   `SPAN`, ..., alignment) are accepted and do not change the host layout:
//   they only select how the IPU encodes the pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "poplar/HalfFloat.hpp"
#include "ipudef.h"

namespace poplar {

enum class VectorLayout {
  ONE_PTR, SPAN, SHORT_SPAN, SCALED_PTR32, SCALED_PTR64, SCALED_PTR128,
  COMPACT_PTR, COMPACT_DELTAN, DELTAN, DELTANELEMENTS
};

enum class VectorListLayout { DELTAN, DELTANELEMENTS, COMPACT_DELTAN, COMPACT_DELTANELEMENTS,
                              ONE_PTR, SCALED_PTR32, SCALED_PTR64 };

// Spans of elements: the binding every vector-like field shares. ipu-jax's
// runner sets `ptr_` and `size_` before each compute().
template <typename E>
class SpanRef {
 public:
  using value_type = std::remove_const_t<E>;
  using iterator = E*;
  using const_iterator = const E*;

  E& operator[](std::size_t i) const { return ptr_[i]; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  E* data() const { return ptr_; }
  E* begin() const { return ptr_; }
  E* end() const { return ptr_ + size_; }

  E* ptr_ = nullptr;
  std::size_t size_ = 0;
};

// A vector: `E` is an element type (a span of them) or a field type (a list
// of fields, each bound to its own span).
template <typename E, VectorLayout L = VectorLayout::SPAN, unsigned Align = alignof(E),
          bool Interleaved = false>
class Vector : public SpanRef<E> {};

// A list of spans of `E`, inside Input/Output/InOut.
template <typename E, VectorListLayout L = VectorListLayout::DELTANELEMENTS,
          unsigned Align = alignof(E), bool Interleaved = false>
class VectorList {};

// One element of `E` (`E` const for inputs).
template <typename E>
class ScalarRef {
 public:
  E& operator*() const { return *ptr_; }
  E* operator->() const { return ptr_; }
  operator E&() const { return *ptr_; }  // NOLINT: reads as the element
  E* data() const { return ptr_; }

  E* ptr_ = nullptr;
};

template <typename E>
class ScalarOut : public ScalarRef<E> {
 public:
  const ScalarOut& operator=(const E& v) const { *this->ptr_ = v; return *this; }
  const ScalarOut& operator+=(const E& v) const { *this->ptr_ += v; return *this; }
  const ScalarOut& operator-=(const E& v) const { *this->ptr_ -= v; return *this; }
  const ScalarOut& operator*=(const E& v) const { *this->ptr_ *= v; return *this; }
  const ScalarOut& operator/=(const E& v) const { *this->ptr_ /= v; return *this; }
};

// A list of spans (VectorList fields): `size()` spans, `[i]` the i-th.
template <typename Span>
class ListRef {
 public:
  const Span& operator[](std::size_t i) const { return subs_[i]; }
  std::size_t size() const { return size_; }
  const Span* begin() const { return subs_; }
  const Span* end() const { return subs_ + size_; }

  const Span* subs_ = nullptr;
  std::size_t size_ = 0;
};

// Fields: read-only (Input), write-only (Output), read-write (InOut).
template <typename T>
class Input : public ScalarRef<const T> {
 public:
  using ipu_jax_element = T;
};
template <typename E, VectorLayout L, unsigned A, bool I>
class Input<Vector<E, L, A, I>> : public SpanRef<const E> {
 public:
  using ipu_jax_element = E;
};
template <typename E, VectorListLayout L, unsigned A, bool I>
class Input<VectorList<E, L, A, I>> : public ListRef<SpanRef<const E>> {
 public:
  using ipu_jax_element = E;
};

template <typename T>
class Output : public ScalarOut<T> {
 public:
  using ScalarOut<T>::operator=;
  using ipu_jax_element = T;
};
template <typename E, VectorLayout L, unsigned A, bool I>
class Output<Vector<E, L, A, I>> : public SpanRef<E> {
 public:
  using ipu_jax_element = E;
};
template <typename E, VectorListLayout L, unsigned A, bool I>
class Output<VectorList<E, L, A, I>> : public ListRef<SpanRef<E>> {
 public:
  using ipu_jax_element = E;
};

template <typename T>
class InOut : public ScalarOut<T> {
 public:
  using ScalarOut<T>::operator=;
  using ipu_jax_element = T;
};
template <typename E, VectorLayout L, unsigned A, bool I>
class InOut<Vector<E, L, A, I>> : public SpanRef<E> {
 public:
  using ipu_jax_element = E;
};
template <typename E, VectorListLayout L, unsigned A, bool I>
class InOut<VectorList<E, L, A, I>> : public ListRef<SpanRef<E>> {
 public:
  using ipu_jax_element = E;
};

// The base classes. Poplar runs six worker contexts per tile.
class Vertex {
 public:
  static constexpr unsigned numWorkers() { return 6; }
};
class SupervisorVertex {
 public:
  static constexpr unsigned numWorkers() { return 6; }
};
class MultiVertex {
 public:
  static constexpr unsigned numWorkers() { return 6; }
};

}  // namespace poplar
