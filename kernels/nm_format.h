// The packed N:M format (docs/FORMAT.md, version 2), mirrored for C++ and CUDA.
// nmcli/format.py owns the layout; this header only reads it.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define NM_HD __host__ __device__ __forceinline__
#else
#define NM_HD inline
#endif

namespace nmcli {

constexpr int kFormatVersion = 2;
constexpr int kMaxM = 32;
constexpr int kRowAlign = 32;  // stored entries per row are padded to a multiple of this
constexpr int kPaddedIndexRowWords = 4;  // version 2 readers also take rows of `indices` padded to 16 bytes

// B = ceil(log2 M): bits of one stored offset.
NM_HD constexpr int index_bits(int m) {
  int b = 1;
  while ((1 << b) < m) ++b;
  return b;
}

// Geometry of one packed weight; every kernel takes this.
struct NMShape {
  int64_t k = 0;       // logical reduction length
  int64_t nout = 0;    // output columns (rows of `values`)
  int n = 0, m = 0;    // N kept of every M
  int bits = 0;        // B
  int64_t groups = 0;  // ceil(K / M)
  int64_t row_len = 0; // S: stored entries per row, multiple of kRowAlign
  int64_t index_words = 0;  // uint32 words per row of `indices` (the row pitch): S * B / 32, or padded (below)

  static NMShape make(int64_t k, int64_t nout, int n, int m) {
    NMShape s;
    s.k = k; s.nout = nout; s.n = n; s.m = m; s.bits = index_bits(m);
    s.groups = (k + m - 1) / m;
    const int64_t stored = s.groups * n;
    s.row_len = (stored + kRowAlign - 1) / kRowAlign * kRowAlign;
    s.index_words = s.bits_per_row() / 32;
    return s;
  }
  NM_HD int64_t stored() const { return groups * n; }
  NM_HD int64_t bits_per_row() const { return row_len * bits; }  // S * B, a multiple of 32
  // Rows of `indices` padded to whole 16-byte units (docs/FORMAT.md, "Padded rows of indices").
  int64_t padded_index_words() const {
    return (bits_per_row() / 32 + kPaddedIndexRowWords - 1) / kPaddedIndexRowWords * kPaddedIndexRowWords;
  }
  // Whether rows of `words` words are this weight's indices: S * B / 32, or padded.
  bool accepts_index_words(int64_t words) const { return words == bits_per_row() / 32 || words == padded_index_words(); }
  // The same weight with its indices rows `words` apart (accepts_index_words(words)).
  NMShape with_index_words(int64_t words) const {
    NMShape s = *this;
    s.index_words = words;
    return s;
  }
};

inline bool valid_pattern(int n, int m) { return 1 <= n && n < m && m <= kMaxM; }

// Whether every weight of pattern n:m holds at most 2 entries in each aligned block of 4
// positions, so it may carry a 2:4 copy (docs/FORMAT.md "A 2:4 copy"; nmcli.format.fits_two_of_four).
inline bool fits_two_of_four(int n, int m) { return n == 1 || (n == 2 && m % 4 == 0 && m > 4); }

// Bits [bit, bit + width) of a row of index words (width <= 32) in the low bits of the result;
// the bits above them are whatever follows in the word read last, which is never one past the
// field's own last word.
NM_HD uint32_t read_bits(const uint32_t* row_words, int64_t bit, int width) {
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  uint64_t window = row_words[word];
  if (shift + width > 32) window |= static_cast<uint64_t>(row_words[word + 1]) << 32;
  return static_cast<uint32_t>(window >> shift);
}

// Offset of entry j in a row of index words: the B-bit field at bits [j*B, j*B+B).
NM_HD uint32_t read_offset(const uint32_t* row_words, int64_t j, int bits) {
  return read_bits(row_words, j * bits, bits) & ((1u << bits) - 1u);
}

// The offsets of a row in entry order (0, 1, 2, ...) for readers that walk the whole row: the
// same B-bit fields as read_offset, through a 64-bit buffer refilled one word at a time.
class OffsetStream {
 public:
  NM_HD OffsetStream(const uint32_t* row_words, int bits) : words_(row_words), bits_(bits), mask_((1u << bits) - 1u) {}
  NM_HD uint32_t next() {
    if (buffered_ < bits_) {
      buffer_ |= static_cast<uint64_t>(*words_++) << buffered_;
      buffered_ += 32;
    }
    const uint32_t offset = static_cast<uint32_t>(buffer_) & mask_;
    buffer_ >>= bits_;
    buffered_ -= bits_;
    return offset;
  }

 private:
  const uint32_t* words_;
  int bits_;
  uint32_t mask_;
  uint64_t buffer_ = 0;
  int buffered_ = 0;
};

}  // namespace nmcli
