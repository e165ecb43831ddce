// Where the op writes its Nout output columns: one tensor [rows, Nout], or, for a fused sibling
// group (nmcli/prune.py), consecutive column ranges into separate tensors [rows, width_i], so
// no Split has to copy them apart afterwards. Shared by the CPU and CUDA kernels.
#pragma once
#include <cstdint>

#include "nm_format.h"

namespace nmcli {

constexpr int kMaxOutputParts = 8;

// One output column: element `row` is at y[row * stride].
template <typename T>
struct OutputColumn {
  T* y;
  int64_t stride;
  NM_HD T& operator[](int64_t row) const { return y[row * stride]; }
};

template <typename T>
struct OutputParts {
  T* base[kMaxOutputParts] = {};
  int64_t end[kMaxOutputParts] = {};  // one past each part's last column; end[count - 1] == Nout
  int count = 0;

  // Part i holds widths[i] consecutive columns at bases[i] (the caller checked that there are
  // 1..kMaxOutputParts positive widths).
  static OutputParts split(T* const* bases, const int64_t* widths, int count) {
    OutputParts parts;
    int64_t end = 0;
    for (int i = 0; i < count; ++i) {
      end += widths[i];
      parts.base[i] = bases[i];
      parts.end[i] = end;
    }
    parts.count = count;
    return parts;
  }
  static OutputParts single(T* y, int64_t nout) { return split(&y, &nout, 1); }

  // The same parts seen as another element type (the type-erased call -> a typed kernel).
  template <typename U>
  OutputParts<U> as() const {
    OutputParts<U> typed;
    for (int i = 0; i < kMaxOutputParts; ++i) {
      typed.base[i] = static_cast<U*>(base[i]);
      typed.end[i] = end[i];
    }
    typed.count = count;
    return typed;
  }

  NM_HD OutputColumn<T> column(int64_t col) const {
    int part = 0;
    while (part + 1 < count && col >= end[part]) ++part;
    const int64_t begin = part ? end[part - 1] : 0;
    return {base[part] + (col - begin), end[part] - begin};
  }
};

}  // namespace nmcli
