#pragma once
#include "nm_matmul_common.h"

namespace nmcli {
void add_cpu_ops(Ort::CustomOpDomain& domain);
}
