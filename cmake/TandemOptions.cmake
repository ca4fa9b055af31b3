# Build options of Tandem. One option per optional backend: on where it can
# be, a FATAL_ERROR naming what is missing where it was asked for and cannot be.

set(TANDEM_WITH_CUDA "AUTO" CACHE STRING "Build the CUDA/NCCL GPU backend: AUTO, ON or OFF")
set_property(CACHE TANDEM_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(TANDEM_CUDA_ROOT "/usr/local/cuda" CACHE PATH "Where the CUDA toolkit and NCCL are installed")
set(TANDEM_CUDA_ARCHITECTURES "80;90" CACHE STRING "GPU architectures to compile CUDA code for")
set(TANDEM_SANITIZE "" CACHE STRING
    "Sanitizers, comma-separated: address, undefined, thread (thread excludes address)")
option(TANDEM_WERROR "Treat compiler warnings as errors" OFF)
option(TANDEM_THREAD_SAFETY
       "Check the lock annotations (common/thread_annotations.h) with clang's -Wthread-safety, as errors (clang only)"
       OFF)

string(TOUPPER "${TANDEM_WITH_CUDA}" _cuda_mode)
if(NOT _cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TANDEM_WITH_CUDA must be AUTO, ON or OFF, not '${TANDEM_WITH_CUDA}'")
endif()

# --- CUDA and NCCL ----------------------------------------------------------
set(TANDEM_CUDA_ENABLED OFF)
if(NOT _cuda_mode STREQUAL "OFF")
  set(_missing "")
  find_program(TANDEM_NVCC nvcc HINTS "${TANDEM_CUDA_ROOT}/bin" NO_DEFAULT_PATH)
  find_library(TANDEM_CUDART cudart HINTS "${TANDEM_CUDA_ROOT}/lib64" "${TANDEM_CUDA_ROOT}/lib" NO_DEFAULT_PATH)
  find_library(TANDEM_NCCL_LIBRARY nccl HINTS "${TANDEM_CUDA_ROOT}/lib64" "${TANDEM_CUDA_ROOT}/lib" NO_DEFAULT_PATH)
  find_path(TANDEM_NCCL_INCLUDE nccl.h HINTS "${TANDEM_CUDA_ROOT}/include" NO_DEFAULT_PATH)
  if(NOT TANDEM_NVCC)
    list(APPEND _missing "nvcc (looked in ${TANDEM_CUDA_ROOT}/bin)")
  endif()
  if(NOT TANDEM_CUDART)
    list(APPEND _missing "libcudart (looked in ${TANDEM_CUDA_ROOT}/lib64)")
  endif()
  if(NOT TANDEM_NCCL_LIBRARY OR NOT TANDEM_NCCL_INCLUDE)
    list(APPEND _missing "NCCL: libnccl and nccl.h (looked in ${TANDEM_CUDA_ROOT}/lib64 and include)")
  endif()
  if(_missing)
    list(JOIN _missing "; " _missing_text)
    if(_cuda_mode STREQUAL "ON")
      message(FATAL_ERROR "TANDEM_WITH_CUDA=ON but the GPU backend cannot be built: missing ${_missing_text}. "
                          "Install CUDA and NCCL under TANDEM_CUDA_ROOT (${TANDEM_CUDA_ROOT}) or configure with "
                          "-DTANDEM_WITH_CUDA=OFF.")
    endif()
    message(STATUS "CUDA backend off (TANDEM_WITH_CUDA=AUTO): missing ${_missing_text}")
  else()
    set(TANDEM_CUDA_ENABLED ON)
    set(CMAKE_CUDA_COMPILER "${TANDEM_NVCC}")
    set(CMAKE_CUDA_ARCHITECTURES "${TANDEM_CUDA_ARCHITECTURES}")
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no CUDA 20 flags for nvcc; the .cu files need only 17
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    set(CUDAToolkit_ROOT "${TANDEM_CUDA_ROOT}")
    find_package(CUDAToolkit REQUIRED)
    add_library(tandem_nccl_lib SHARED IMPORTED)
    set_target_properties(tandem_nccl_lib PROPERTIES
      IMPORTED_LOCATION "${TANDEM_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${TANDEM_NCCL_INCLUDE}")
    add_library(Tandem::nccl ALIAS tandem_nccl_lib)
  endif()
endif()

# --- Sanitizers -------------------------------------------------------------
set(TANDEM_SANITIZE_FLAGS "")
if(TANDEM_SANITIZE)
  string(REPLACE "," ";" _sanitizers "${TANDEM_SANITIZE}")
  foreach(_s IN LISTS _sanitizers)
    if(NOT _s MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "TANDEM_SANITIZE: unknown sanitizer '${_s}' (accepted: address, undefined, thread)")
    endif()
  endforeach()
  if("thread" IN_LIST _sanitizers AND "address" IN_LIST _sanitizers)
    message(FATAL_ERROR "TANDEM_SANITIZE: 'thread' cannot be combined with 'address'")
  endif()
  list(JOIN _sanitizers "," _joined)
  set(TANDEM_SANITIZE_FLAGS -fsanitize=${_joined} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _sanitizers)
    list(APPEND TANDEM_SANITIZE_FLAGS -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${TANDEM_SANITIZE_FLAGS}>")
  add_link_options(${TANDEM_SANITIZE_FLAGS})
endif()

# --- Lock annotations -----------------------------------------------------------
# clang checks TANDEM_GUARDED_BY, TANDEM_REQUIRES and the rest against the
# capabilities of tandem::Mutex (common/mutex.h); gcc has no such analysis.
if(TANDEM_THREAD_SAFETY AND NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "TANDEM_THREAD_SAFETY=ON needs clang (-Wthread-safety), not ${CMAKE_CXX_COMPILER_ID}: "
                      "configure with -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14")
endif()

# --- Warnings: applied to Tandem's own targets through this interface target --
add_library(tandem_warnings INTERFACE)
target_compile_options(tandem_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast
    -Wcast-align -Woverloaded-virtual -Wimplicit-fallthrough -Wformat=2>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:Clang>>:-Wthread-safety>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<OR:$<BOOL:${TANDEM_WERROR}>,$<BOOL:${TANDEM_THREAD_SAFETY}>>>:-Werror>)
