// The storage types of device arrays: float32, bfloat16 and float16 (their 16-bit codes),
// each read as float32 exactly (`Load`); the lookups (segment sums, the in-process and
// host lookups, pooled partials: common.h's SegmentRowSums) and the fused updates
// (update_rules.h, updater.h) are templates over them. Part of embedmesh's CPU kernels
// (XLA FFI); included through common.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace embedmesh {
namespace {

// ---------------------------------------------------------------------------------------
// Storage types: the arithmetic is float32 whatever the table holds (float32, or
// bfloat16 / float16 rounded stochastically: device/rounding.py, bit for bit).

template <typename T>
inline float Load(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T Store(float x) {
  return static_cast<T>(x);
}

template <typename T>
struct DType;
template <>
struct DType<float> {
  static constexpr ffi::DataType kType = ffi::DataType::F32;
};

// bfloat16 and float16 storage: the 16-bit codes (a code +- 1 is the next value of its
// sign away from / towards zero, as device/rounding.py steps them). Load widens exactly;
// Nearest rounds to nearest, ties to even (as XLA's convert), past the largest finite value
// to infinity, NaN to a quiet NaN.
struct Bf16 {
  uint16_t code;
};
struct F16 {
  uint16_t code;
};
template <>
struct DType<Bf16> {
  static constexpr ffi::DataType kType = ffi::DataType::BF16;
};
template <>
struct DType<F16> {
  static constexpr ffi::DataType kType = ffi::DataType::F16;
};

inline float Widen(Bf16 x) {
  const uint32_t b = static_cast<uint32_t>(x.code) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// float16 in integer arithmetic (no _Float16: its conversions do not vectorise without
// F16C, and a flushed float32 subnormal would lose fp16's subnormals): normal values
// rebias their exponent, subnormals are their code times 2^-24, inf / NaN keep the payload.
inline float Widen(F16 x) {
  const uint32_t h = x.code, sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
  const uint32_t normal = (em + ((127 - 15) << 10)) << 13, special = (em << 13) | 0x7F800000u;
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;
  uint32_t sb;
  std::memcpy(&sb, &sub, 4);
  // selects as masks (GCC left the ternaries as branches here)
  const uint32_t is_special = 0u - static_cast<uint32_t>(em >= 0x7C00u);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 0x400u);
  const uint32_t big = (special & is_special) | (normal & ~is_special);
  const uint32_t b = sign | (sb & is_sub) | (big & ~is_sub);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float Load(Bf16 x) { return Widen(x); }
inline float Load(F16 x) { return Widen(x); }

// A storage type as a value (`WithStorage`'s argument).
template <typename E>
struct StorageTag {
  using type = E;
};

// f(StorageTag<E>{}) for the storage type E of `t` (float32, bfloat16, float16): one
// template a kernel, instantiated per type; an error naming `what` for any other dtype.
template <class F>
ffi::Error WithStorage(ffi::DataType t, const char* what, const F& f) {
  switch (t) {
    case ffi::DataType::F32:
      return f(StorageTag<float>{});
    case ffi::DataType::BF16:
      return f(StorageTag<Bf16>{});
    case ffi::DataType::F16:
      return f(StorageTag<F16>{});
    default:
      return ffi::Error::InvalidArgument(std::string("embedmesh ") + what +
                                              ": tables must be float32, bfloat16 or float16");
  }
}

}  // namespace
}  // namespace embedmesh
