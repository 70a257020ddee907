// HybridShard over the data dimension of a tensor/pipeline mesh is not supported.
// expect-error: Parallel<Data> takes accel::DDP or accel::ZeRO<1|2|3> over the data dimension
// twin: parallel_with_zero_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::Parallel<accel::HybridShard>> trainer;
