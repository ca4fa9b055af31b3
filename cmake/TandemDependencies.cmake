# Third-party dependencies. All come from Debian packages installed by
# `make deps` (see scripts/deps.sh); nothing is downloaded at build time.

find_package(Threads REQUIRED)
find_package(Protobuf REQUIRED)                 # CMake's FindProtobuf (no config file on Debian 12)
find_package(gRPC CONFIG REQUIRED)              # gRPC::grpc++, gRPC::grpc_cpp_plugin
find_package(prometheus-cpp CONFIG REQUIRED)    # prometheus-cpp::core (Tandem serves /metrics itself)
find_package(yaml-cpp CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(fmt CONFIG REQUIRED)
find_package(GTest REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)  # PkgConfig::UCX (libucx-dev)

if(TARGET yaml-cpp::yaml-cpp)
  set(TANDEM_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(TANDEM_YAML_TARGET yaml-cpp)
endif()
