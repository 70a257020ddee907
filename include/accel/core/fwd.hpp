#pragma once
// Forward declarations of accel's engines, so that policy tags can name the
// engine that implements them without pulling in LibTorch (mdspan's
// `layout_type::mapping<E>` idiom: the tag is cheap, the engine is heavy).

namespace accel {

template <class Strategy, class Precision, class Device>
class Trainer;

namespace strategy {
template <class Precision, class Device>
class SingleProcessEngine;
template <class Precision, class Device>
class DDPEngine;
template <int Stage, class Precision, class Device>
class ZeROEngine;
template <class Data, class Precision, class Device>
class ParallelEngine;
template <class Precision, class Device>
class HybridShardEngine;
}  // namespace strategy

}  // namespace accel
