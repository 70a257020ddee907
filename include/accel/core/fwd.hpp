#pragma once
// Forward declarations of accel's engines, so that policy tags can name the
// engine that implements them without pulling in LibTorch (mdspan's
// `layout_type::mapping<E>` idiom: the tag is cheap, the engine is heavy).
// Engines are ordinary classes: none depends on the Trainer's precision or
// device, so each is one type, whatever Trainer uses it. Each is defined by
// exactly one header; the Trainer refuses, with the header's name, a
// strategy whose engine it cannot see.

namespace accel {

template <class Strategy, class Precision, class Device>
class Trainer;

namespace strategy {
class SingleProcessEngine;  // strategy/single_process.hpp
class DDPEngine;            // strategy/ddp.hpp
class ShardedEngine;        // strategy/sharded_engine.hpp: ZeRO<1>, <2>, <3>, HybridShard
template <class Data>
class ParallelEngine;       // strategy/parallel.hpp
}  // namespace strategy

}  // namespace accel
