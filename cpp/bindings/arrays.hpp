// The bindings' array guards: the checks that make a NumPy array safe to hand to a kernel as a pointer and
// strides (dtype, dimensions, shape against the other arguments, alignment, contiguity, writeability, index
// ranges). They are memory-safety guards, not the user-facing validation: python/attnpp/_checks.py checks what
// users pass, with PyTorch's wording, before anything reaches the core. A failed guard here means a caller of
// _core passed inconsistent buffers; it raises rather than reading or writing outside an array.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common.hpp"

namespace attnpp::bindings {

namespace py = pybind11;

inline std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The bytes of a C-contiguous array of `shape`: ValueError for a negative dimension, std::bad_alloc (MemoryError)
// when the product of the nonzero dimensions exceeds what a pointer difference holds (pybind's and NumPy's
// strides, products of the later dimensions, would overflow, even when another dimension is 0).
inline std::size_t array_bytes(const std::vector<py::ssize_t>& shape, std::size_t itemsize, const char* name) {
  const auto most = std::size_t(std::numeric_limits<py::ssize_t>::max());
  std::size_t strided = itemsize;
  bool empty = false;
  for (const auto s : shape) {
    if (s < 0) throw py::value_error(std::string(name) + ": negative dimension in shape");
    empty = empty || s == 0;
    if (s != 0 && strided > most / std::size_t(s)) throw std::bad_alloc();
    strided *= s != 0 ? std::size_t(s) : 1;
  }
  return empty ? 0 : strided;
}

// NumPy's dtype of T: float32, float64, float16, or ml_dtypes.bfloat16 (a NumPy dtype of ml_dtypes' own,
// looked up once; the package is a dependency of attnpp).
template <typename T>
py::dtype dtype_of() {
  if constexpr (std::is_same_v<T, float16>) {
    return py::dtype("float16");
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    static const auto* dtype =  // (never freed: a Python object must not be released after the interpreter)
        new py::dtype(py::dtype::from_args(py::module_::import("ml_dtypes").attr("bfloat16")));
    return *dtype;
  } else {
    return py::dtype::of<T>();
  }
}

// Whether dt is ml_dtypes' bfloat16, without importing ml_dtypes: no dtype is before it is imported, and attnpp
// imports it only where a bfloat16 is asked for (python/attnpp/_checks.py: with attnpp, its import was 0.9 s of
// `import attnpp`'s 1.0 s at ml_dtypes 0.7.0).
inline bool is_bfloat16(const py::dtype& dt) {
  return PyDict_GetItemString(PyImport_GetModuleDict(), "ml_dtypes") != nullptr && dt.equal(dtype_of<bfloat16>());
}

template <typename T>
void check_dtype(const py::array& a, const char* name) {
  if (!a.dtype().equal(dtype_of<T>()))
    throw py::type_error(std::string(name) + ": expected dtype " + std::string(py::str(dtype_of<T>())) + ", got " +
                         std::string(py::str(a.dtype())));
}

inline void check_aligned(const py::array& a, const char* name) {
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    throw py::value_error(std::string(name) + ": array not aligned to its item size");
}

inline void expect_ndim(const py::array& a, const char* name, py::ssize_t ndim) {
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " +
                          shape_str(a));
}

inline void expect_shape(const py::array& a, const char* name, std::initializer_list<int64_t> shape) {
  bool ok = a.ndim() == py::ssize_t(shape.size());
  int d = 0;
  for (int64_t s : shape) ok = ok && a.shape(d++) == s;
  if (!ok) {
    std::string want = "(";
    d = 0;
    for (int64_t s : shape) want += (d++ ? ", " : "") + std::to_string(s);
    throw py::value_error(std::string(name) + ": expected shape " + want + (shape.size() == 1 ? ",)" : ")") +
                          ", got " + shape_str(a));
  }
}

// Same number of elements, else ValueError.
inline void expect_size(const py::array& a, const char* name, py::ssize_t n) {
  if (a.size() != n)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(n) + " elements, got shape " +
                          shape_str(a));
}

inline void check_writeable(const py::array& a, const char* name, bool writeable) {
  if (writeable && !a.writeable()) throw py::value_error(std::string(name) + ": output array is read-only");
}

// A 4-D array (N, H, rows, cols) of T as a View4 of A (T or const T), its last dimension contiguous.
template <typename T, typename A>
View4<A> view4(const py::array& a, const char* name, bool writeable) {
  check_dtype<T>(a, name);
  expect_ndim(a, name, 4);
  if (a.size() > 0) {  // (NumPy gives empty arrays any strides; nothing of them is read)
    check_aligned(a, name);
    if (a.shape(3) > 1 && a.strides(3) != py::ssize_t(sizeof(T)))
      throw py::value_error(std::string(name) + ": the last dimension must be contiguous");
    for (int d = 0; d < 3; ++d)
      if (a.strides(d) % py::ssize_t(sizeof(T)))
        throw py::value_error(std::string(name) + ": strides must be multiples of the item size");
  }
  check_writeable(a, name, writeable);
  A* data = static_cast<A*>(const_cast<void*>(a.data()));  // written only when `writeable` was checked
  const auto st = [&](int d) { return int64_t(a.strides(d) / py::ssize_t(sizeof(T))); };
  return View4<A>{data, st(0), st(1), st(2)};
}

// The data of a C-contiguous array of T.
template <typename T>
T* contiguous_ptr(const py::array& a, const char* name, bool writeable) {
  check_dtype<T>(a, name);
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": must be C-contiguous");
  check_aligned(a, name);
  check_writeable(a, name, writeable);
  return static_cast<T*>(const_cast<void*>(a.data()));
}

// An optional array argument: empty for None, else the ndarray passed (never a temporary converted from a list,
// whose memory would be gone by the time the kernel writes it), TypeError for anything else.
inline std::optional<py::array> optional_array(const py::object& o, const char* name) {
  if (o.is_none()) return std::nullopt;
  if (!py::isinstance<py::array>(o))
    throw py::type_error(std::string(name) + ": expected a numpy.ndarray or None, got " +
                         std::string(py::str(py::type::handle_of(o).attr("__name__"))));
  return py::reinterpret_borrow<py::array>(o);
}

// The data of an optional C-contiguous array of T of `shape`, or nullptr for None.
template <typename T>
T* optional_ptr(const py::object& o, const char* name, std::initializer_list<int64_t> shape, bool writeable) {
  const auto a = optional_array(o, name);
  if (!a) return nullptr;
  expect_shape(*a, name, shape);
  return contiguous_ptr<T>(*a, name, writeable);
}

// Copies of an int64 array's values: indices and offsets are checked, then used with the GIL released, when
// another Python thread could change the array in between.
inline std::vector<int64_t> int64_copy(const py::array& a, const char* name) {
  if (!a.dtype().equal(py::dtype::of<int64_t>()) || !(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + ": expected a C-contiguous int64 array");
  std::vector<int64_t> values(a.size());
  if (!values.empty()) std::memcpy(values.data(), a.data(), values.size() * sizeof(int64_t));
  return values;
}

// A copy of the indices of `a` (C-contiguous int64), each in [0, size) or equal to *allowed when given, else
// IndexError.
inline std::vector<int64_t> indices(const py::array& a, const char* name, int64_t size,
                                    const int64_t* allowed = nullptr) {
  auto idx = int64_copy(a, name);
  for (const int64_t i : idx)
    if ((i < 0 || i >= size) && !(allowed && i == *allowed))
      throw py::index_error(std::string(name) + ": value " + std::to_string(i) + " out of range [0, " +
                            std::to_string(size) + ")");
  return idx;
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) for the dtype of `a`, T one of float, double, bfloat16 and float16 (half.hpp): an entry
// point's body is written once, as a generic lambda, for every dtype.
template <typename F>
void dispatch(const py::array& a, const char* name, F&& f) {
  const py::dtype dt = a.dtype();
  if (dt.equal(dtype_of<float>()))
    f(Tag<float>{});
  else if (dt.equal(dtype_of<double>()))
    f(Tag<double>{});
  else if (dt.equal(dtype_of<float16>()))
    f(Tag<float16>{});
  else if (is_bfloat16(dt))
    f(Tag<bfloat16>{});
  else
    throw py::type_error(std::string(name) + ": expected dtype float32, float64, float16 or bfloat16, got " +
                         std::string(py::str(dt)));
}

}  // namespace attnpp::bindings
