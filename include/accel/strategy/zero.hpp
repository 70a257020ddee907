#pragma once
// ZeRO stages 1, 2 and 3: the optimizer state (stage 1), the gradients
// (stage 2) and the parameters (stage 3) sharded over the ranks. Every stage
// is the one sharded engine (sharded_engine.hpp) with other choices, so this
// header brings all three.
//
// NOTE [ZeRO shards]
// The gradient buckets of NOTE [Gradient buckets] are padded to a multiple of
// the world size, and the model's parameters are moved into flat buffers of
// the same layout (each parameter becomes a view of its bucket's buffer).
// Rank r owns elements [r*S, (r+1)*S) of every bucket, S = padded/world.
// The user's optimizer is rewired to step those shards (one leaf tensor per
// bucket, a view of the flat parameter buffer, whose .grad is the reduced
// gradient shard), so optimizer state exists for 1/world of the elements;
// this is exact for elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...).
//   stage 1: each bucket's gradients are all-reduced (as DDP), the shard is a view;
//   stage 2: each bucket is reduce-scattered as soon as it is ready
//            (comm::reduce_scatter_rows_async: NCCL's native one; Gloo's
//            all-to-all among the other ranks + a local sum, (n-1)/n of the
//            bytes and of a bucket received);
//            the full gradient buffers are released after the step, so only
//            the shard stays between steps;
//   stage 3: as stage 2, and each shard is a tensor of its own while the
//            flat buffers are freed between uses (NOTE [ZeRO-3 parameter
//            life cycle]).
// Stages 1 and 2: after the optimizer step every bucket's shards are all-gathered back into
// the flat parameter buffers, so every rank again holds the whole model, in
// place (comm::all_gather_rows_async: nothing staged beside the buckets).

#include "accel/strategy/sharded_engine.hpp"
