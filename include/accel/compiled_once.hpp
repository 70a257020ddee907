#pragma once
// The definitions of accel's code compiled once (NOTE [Compiled once] in
// core/compiled_once.hpp). In a program built with
// ACCEL_SEPARATE_COMPILATION, exactly one .cpp includes this, before any
// other accel header; meson's `accel_compiled_dep` builds that .cpp for you.

#ifndef ACCEL_SEPARATE_COMPILATION
#error "accel/compiled_once.hpp is for programs built with ACCEL_SEPARATE_COMPILATION (NOTE [Compiled once])"
#endif
#ifdef ACCEL_DEFINE_COMPILED_ONCE
#error "accel/compiled_once.hpp must come before every other accel header in its .cpp"
#endif
#define ACCEL_BUILDING_COMPILED_ONCE 1

// Every header with a compiled-once section.
#include "accel/checkpoint/accelerate_state.hpp"
#include "accel/checkpoint/files.hpp"
#include "accel/checkpoint/safetensors.hpp"
#include "accel/checkpoint/safetensors_format.hpp"
#include "accel/checkpoint/save_model.hpp"
#include "accel/checkpoint/state.hpp"
#include "accel/comm/address.hpp"
#include "accel/comm/checked_group.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/comm/flight_recorder.hpp"
#include "accel/comm/gloo_adapter.hpp"
#include "accel/comm/liveness.hpp"
#include "accel/comm/nccl_adapter.hpp"
#include "accel/comm/pending.hpp"
#include "accel/comm/rendezvous.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/deferred_init/meta.hpp"
#include "accel/launch/settings.hpp"
#include "accel/nn/activation_checkpoint.hpp"
#include "accel/strategy/autograd_graph.hpp"
#include "accel/strategy/bucket_plan.hpp"
#include "accel/strategy/buckets.hpp"
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/hybrid_shard.hpp"
#include "accel/strategy/module_tree.hpp"
#include "accel/strategy/parallel.hpp"
#include "accel/strategy/zero.hpp"
#include "accel/strategy/zero3.hpp"
#include "accel/tracking/trackers.hpp"
#include "accel/trainer_base.hpp"
