#pragma once
// The examples' GPT (examples/gpt_model.hpp) at the size tests train and
// estimate: two blocks of width 12, small enough for a step in milliseconds.
#include "../../examples/gpt_model.hpp"

namespace accel::testing {
inline const gpt::Config tiny_gpt{.vocab = 30, .context = 8, .width = 12, .heads = 3, .layers = 2};
}  // namespace accel::testing
