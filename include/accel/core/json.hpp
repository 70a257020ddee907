#pragma once
// nlohmann::json in accel's headers. Header-only, they include all of it. A
// program built with ACCEL_SEPARATE_COMPILATION (NOTE [Compiled once]) gets
// only its declaration (<nlohmann/json_fwd.hpp>): the whole library is a
// second of parsing, half of what accel adds to a translation unit, and
// only the code compiled once reads or writes JSON. There, a translation
// unit that builds a JSON value (trainer.log({{"loss", x}}), a config for
// init_trackers) or calls gather_object includes <nlohmann/json.hpp> itself.
// Torch-free.

#include "accel/core/compiled_once.hpp"

#if ACCEL_DEFINE_COMPILED_ONCE
#include <nlohmann/json.hpp>
#else
#include <nlohmann/json_fwd.hpp>
#endif

namespace accel::detail {

// nlohmann::json named through a template parameter, so that a template
// using it is checked where it is instantiated, not where it is defined.
template <class>
struct json_for {
  using type = nlohmann::json;
};
template <class T>
using json_t = typename json_for<T>::type;

// Whether nlohmann::json is complete here (the check is made where a
// template is instantiated).
template <class Json>
concept complete_json = requires { sizeof(Json); };

}  // namespace accel::detail
