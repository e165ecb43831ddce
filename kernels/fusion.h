// What nmcli.NMMatMul fuses around the product (docs/FORMAT.md, "Fused neighbours"), so a
// decoder layer runs fewer small kernels between the projections:
//   A = X                                        neither
//   A = silu(X) * X_up                           glu = silu (a gated MLP's activation, LLaMA's SwiGLU)
//   A = X / sqrt(mean(X^2) + eps) * norm_weight  norm = rms (the RMSNorm that feeds Q/K/V, gate/up)
//   Y = alpha * (A @ W) + bias + residual
// (glu and norm exclude each other.)
// Shared by the CPU and CUDA kernels.
#pragma once
#include <cmath>
#include <string>

#include "nm_format.h"

namespace nmcli {

enum class Glu : int { none = 0, silu = 1 };

// The op attribute's spelling ("none" or absent, "silu"); false for anything else.
inline bool parse_glu(const char* name, Glu* glu) {
  const std::string s = name ? name : "";
  if (s.empty() || s == "none") *glu = Glu::none;
  else if (s == "silu") *glu = Glu::silu;
  else return false;
  return true;
}

// The activation the product reads at one position, in fp32.
NM_HD float gated_activation(Glu glu, float x, float up) {
  return glu == Glu::silu ? x / (1.0f + expf(-x)) * up : x;
}

}  // namespace nmcli
