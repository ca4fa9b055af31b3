# What `cmake --install build --prefix PREFIX` puts under PREFIX:
#
#   bin/tandem, bin/tandem-coordinator, bin/tandem-server, bin/tandem-worker
#   lib/libtandem.so*                  the public API (Tandem::worker)
#   include/tandem/*.h                 its headers (worker/include/tandem)
#   lib/cmake/Tandem/                  TandemConfig.cmake, TandemConfigVersion.cmake,
#                                      TandemTargets*.cmake
#
# (lib is CMAKE_INSTALL_LIBDIR: lib/x86_64-linux-gnu under /usr on Debian.)
# A CMake project of one's own then builds against it with
#   find_package(Tandem 0.1 REQUIRED)   # -DCMAKE_PREFIX_PATH=PREFIX
#   target_link_libraries(my-program PRIVATE Tandem::worker)
# libtandem links the rest of Tandem and its dependencies (gRPC, protobuf,
# UCX, prometheus-cpp, ...) privately, so TandemConfig.cmake finds none of
# them; they are needed at run time only, as shared libraries (the Debian
# packages of `make deps`). Components: Tandem_Runtime (the programs and the
# library) and Tandem_Development (headers, the library's link name and the
# CMake files). tests/install_test.py checks all of it.
include(CMakePackageConfigHelpers)

set(TANDEM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Tandem)

install(TARGETS tandem tandem-coordinator tandem-server tandem-worker
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT Tandem_Runtime)
install(TARGETS tandem_api EXPORT TandemTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Tandem_Runtime NAMELINK_COMPONENT Tandem_Development)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/worker/include/tandem
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Tandem_Development
        FILES_MATCHING PATTERN "*.h")
install(EXPORT TandemTargets NAMESPACE Tandem:: DESTINATION ${TANDEM_INSTALL_CMAKEDIR}
        COMPONENT Tandem_Development)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/TandemConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/TandemConfig.cmake
                              INSTALL_DESTINATION ${TANDEM_INSTALL_CMAKEDIR})
# Before 1.0 a minor version may change the API: 0.1.x serves a request for 0.1.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/TandemConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/TandemConfig.cmake ${PROJECT_BINARY_DIR}/TandemConfigVersion.cmake
        DESTINATION ${TANDEM_INSTALL_CMAKEDIR} COMPONENT Tandem_Development)

# The installed programs and library find the shared libraries they link
# outside the system's directories (CUDA's, with TANDEM_WITH_CUDA) by RPATH.
set_target_properties(tandem tandem-coordinator tandem-server tandem-worker tandem_api
                      PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
