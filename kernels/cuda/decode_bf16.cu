// Decode path instantiated for __nv_bfloat16 (see decode.cuh).
#include "decode.cuh"

namespace nmcli {
NMCLI_INSTANTIATE_DECODE(__nv_bfloat16)
}  // namespace nmcli
