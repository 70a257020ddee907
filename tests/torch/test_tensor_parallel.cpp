// Tensor-parallel layers on a real Gloo tensor group (2 ranks): forward
// equal to the unsharded twin, training equal after several steps, the
// vocabulary-parallel embedding and cross-entropy equal to the full ones.
#include <torch/nn/modules/embedding.h>
#include <torch/optim/sgd.h>

#include "accel/comm/mesh.hpp"
#include "accel/nn/tensor_parallel.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using accel::comm::MeshDim;

namespace {

// Every rank's slice along `dim`, concatenated: the unsharded tensor.
at::Tensor gathered(accel::comm::Communicator& group, const at::Tensor& slice, int64_t dim) {
  return at::cat(group.all_gather(slice.detach().contiguous(), "test gather"), dim);
}

}  // namespace

TEST_SUITE("tensor_parallel") {
  TEST_CASE("Column- then RowParallelLinear on 2 ranks: outputs equal the unsharded MLP; after training the "
            "gathered parameters equal it (1e-5)") {
    accel::spawn(
        2,
        [](int) {
          accel::Trainer<accel::DDP> world;  // only for the world group
          accel::comm::DeviceMesh mesh(world.communicator(), {.tensor = 2});
          auto& tp = mesh.group(MeshDim::tensor);
          at::manual_seed(0);
          torch::nn::Linear full1(8, 16), full2(16, 4);
          accel::nn::ColumnParallelLinear col(full1, tp);
          accel::nn::RowParallelLinear row(full2, tp);
          require(col->weight.size(0) == 8 && row->weight.size(1) == 8, "each rank holds half");
          std::vector<at::Tensor> tp_params{col->weight, col->bias, row->weight, row->bias};
          torch::optim::SGD tp_opt(tp_params, torch::optim::SGDOptions(0.1));
          torch::optim::SGD ref_opt({full1->weight, full1->bias, full2->weight, full2->bias}, torch::optim::SGDOptions(0.1));
          for (int step = 0; step < 4; ++step) {
            auto batch = global_batch(step, 6);
            auto out = row(col(batch.x).tanh());
            auto ref = full2(full1(batch.x).tanh());
            const double diff = (out - ref).abs().max().item<double>();
            require(diff < 1e-6, "forward equals the unsharded model: " + std::to_string(diff));
            tp_opt.zero_grad();
            torch::nn::functional::cross_entropy(out, batch.y).backward();
            tp_opt.step();
            ref_opt.zero_grad();
            torch::nn::functional::cross_entropy(ref, batch.y).backward();
            ref_opt.step();
          }
          const double d1 = (gathered(tp, col->weight, 0) - full1->weight).abs().max().item<double>();
          const double d2 = (gathered(tp, row->weight, 1) - full2->weight).abs().max().item<double>();
          const double d3 = (gathered(tp, col->bias, 0) - full1->bias).abs().max().item<double>();
          const double d4 = (row->bias - full2->bias).abs().max().item<double>();
          require(std::max({d1, d2, d3, d4}) < 1e-5, "trained parameters equal the unsharded model's");
        },
        bounded());
  }

  TEST_CASE("VocabParallelEmbedding and the vocabulary-parallel cross-entropy equal the full ones, gradients "
            "included") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::DDP> world;
          accel::comm::DeviceMesh mesh(world.communicator(), {.tensor = 2});
          auto& tp = mesh.group(MeshDim::tensor);
          at::manual_seed(0);
          torch::nn::Embedding full_embedding(12, 6);
          torch::nn::Linear full_head(torch::nn::LinearOptions(6, 12).bias(false));
          accel::nn::VocabParallelEmbedding embedding(full_embedding, tp);
          accel::nn::ColumnParallelLinear head(full_head, tp);  // logits (N, 12/2) per rank
          auto tokens = at::randint(12, {10}, at::TensorOptions().dtype(at::kLong));
          auto targets = at::randint(12, {10}, at::TensorOptions().dtype(at::kLong));
          auto loss = accel::nn::vocab_parallel_cross_entropy(head(embedding(tokens)), targets, tp);
          auto ref = torch::nn::functional::cross_entropy(full_head(full_embedding(tokens)), targets);
          require(std::abs(loss.item<double>() - ref.item<double>()) < 1e-5,
                  "loss " + std::to_string(loss.item<double>()) + " vs " + std::to_string(ref.item<double>()));
          loss.backward();
          ref.backward();
          const double de = (embedding->weight.grad() - full_embedding->weight.grad().narrow(0, rank * 6, 6)).abs().max().item<double>();
          const double dh = (head->weight.grad() - full_head->weight.grad().narrow(0, rank * 6, 6)).abs().max().item<double>();
          require(de < 1e-6 && dh < 1e-6, "gradients of the vocabulary slices equal the full ones");
        },
        bounded());
  }

  TEST_CASE("a layer whose features do not divide by the tensor-parallel size is refused, naming both") {
    accel::spawn(
        2,
        [](int) {
          accel::Trainer<accel::DDP> world;
          accel::comm::DeviceMesh mesh(world.communicator(), {.tensor = 2});
          try {
            accel::nn::ColumnParallelLinear bad(4, 7, mesh.group(MeshDim::tensor));
          } catch (const std::invalid_argument& e) {
            require(std::string(e.what()).find("output features 7 does not divide by the tensor-parallel size 2") !=
                        std::string::npos,
                    e.what());
            world.wait_for_everyone();  // no rank leaves while another still connects to it
            return;
          }
          require(false, "must refuse");
        },
        bounded());
  }
}
