// Decode path instantiated for float (see decode.cuh).
#include "decode.cuh"

namespace nmcli {
NMCLI_INSTANTIATE_DECODE(float)
}  // namespace nmcli
