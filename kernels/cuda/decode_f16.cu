// Decode path instantiated for __half (see decode.cuh).
#include "decode.cuh"

namespace nmcli {
NMCLI_INSTANTIATE_DECODE(__half)
}  // namespace nmcli
