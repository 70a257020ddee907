// The passing twins of fp16_on_cpu.cpp: BF16 on CPU, FP16 on CUDA (a type
// only: constructing it needs a GPU).
// expect-pass
#include <accel/trainer.hpp>
void build() { accel::Trainer<accel::DDP, accel::BF16, accel::CPU> trainer; }
using OnGpu = accel::Trainer<accel::DDP, accel::FP16, accel::CUDA>;
static_assert(std::is_same_v<OnGpu::precision_type, accel::FP16>);
