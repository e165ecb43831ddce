#pragma once
#include "nm_matmul_common.h"

namespace nmcli {
void add_cuda_ops(Ort::CustomOpDomain& domain);
}
