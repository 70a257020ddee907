#pragma once
// NOTE [Compiled once]
// accel is header-only: include it and build. Much of it does not depend on
// a Trainer's policies (the communicator, its liveness watch and flight
// recorder, the launcher's environment, checkpoints, trackers), yet every
// translation unit that includes it compiles and optimizes that code again. A program that wants
// its translation units to compile only their Trainers defines
// ACCEL_SEPARATE_COMPILATION for all of them (as Boost.Asio's
// BOOST_ASIO_SEPARATE_COMPILATION): the headers then only declare that code,
// and it is defined once, by the one .cpp that includes
// <accel/compiled_once.hpp> (meson: the `accel_compiled_dep` dependency
// does both). Mixing the two modes in one program breaks the one-definition
// rule. Such a translation unit also gets nlohmann::json only declared
// (core/json.hpp). Torch-free: macros only.
//
// Functions compiled once are defined in the section of their header guarded
// by ACCEL_DEFINE_COMPILED_ONCE, each marked ACCEL_COMPILED_ONCE (inline in
// the header-only mode, an ordinary definition in the compiled-once TU).

#if defined(ACCEL_SEPARATE_COMPILATION) && !defined(ACCEL_BUILDING_COMPILED_ONCE)
#define ACCEL_DEFINE_COMPILED_ONCE 0
#else
#define ACCEL_DEFINE_COMPILED_ONCE 1
#endif

#if defined(ACCEL_SEPARATE_COMPILATION)
#define ACCEL_COMPILED_ONCE
#else
#define ACCEL_COMPILED_ONCE inline
#endif
