// FP16 autocast on CPU: LibTorch's CPU autocast is bf16-only.
// expect-error: FP16 autocast does not run on CPU.*use accel::BF16 on CPU
// twin: fp16_on_cpu_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::DDP, accel::FP16, accel::CPU> trainer;
