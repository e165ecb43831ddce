# ONNX Runtime's C/C++ API headers. No ORT wheel ships them; Debian's libonnxruntime-dev does.
# Looked up in: -DORT_INCLUDE_DIR, $ORT_INCLUDE_DIR, .deps/onnxruntime/include (what
# scripts/fetch-ort-headers.sh extracts), then the system include paths.
find_path(NMCLI_ORT_INCLUDE_DIR onnxruntime_cxx_api.h
  HINTS ${ORT_INCLUDE_DIR} $ENV{ORT_INCLUDE_DIR} ${PROJECT_SOURCE_DIR}/.deps/onnxruntime/include
  PATH_SUFFIXES onnxruntime)
if(NOT NMCLI_ORT_INCLUDE_DIR OR NOT EXISTS "${NMCLI_ORT_INCLUDE_DIR}/onnxruntime_lite_custom_op.h")
  message(FATAL_ERROR
    "ONNX Runtime C/C++ headers (onnxruntime_cxx_api.h) not found. ONNX Runtime's Python wheels do not "
    "ship them. Run ./scripts/fetch-ort-headers.sh (extracts Debian's libonnxruntime-dev into "
    ".deps/onnxruntime/include) or set ORT_INCLUDE_DIR to a folder that holds them.")
endif()
file(STRINGS "${NMCLI_ORT_INCLUDE_DIR}/onnxruntime_c_api.h" _ort_api_line REGEX "^#define ORT_API_VERSION")
message(STATUS "nmcli: ONNX Runtime headers in ${NMCLI_ORT_INCLUDE_DIR} (${_ort_api_line})")
