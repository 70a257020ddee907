// The device mesh on real Gloo sub-groups: rank order, group membership,
// collectives confined to their group, and a shape that does not fit.
#include <ATen/ops/full.h>

#include "accel/comm/mesh.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using accel::comm::MeshDim;

TEST_SUITE("mesh") {
  TEST_CASE("a pipeline 2 x data 1 x tensor 2 mesh and a data 2 x tensor 2 mesh on 4 ranks") {
    for (auto shape : {accel::comm::MeshShape{.pipeline = 1, .data = 2, .tensor = 2},
                       accel::comm::MeshShape{.pipeline = 2, .data = 1, .tensor = 2}}) {
      accel::spawn(
          4,
          [shape](int rank) {
            accel::Trainer<accel::DDP> trainer;  // the world group
            accel::comm::DeviceMesh mesh(trainer.communicator(), shape);
            // Tensor peers are neighbours: ranks 2k and 2k+1.
            require(mesh.coordinate(MeshDim::tensor) == rank % 2, "tensor coordinate");
            require(mesh.rank_at(mesh.coordinate(MeshDim::tensor), mesh.coordinate(MeshDim::data),
                                 mesh.coordinate(MeshDim::pipeline)) == rank,
                    "rank_at inverts the coordinates");
            for (MeshDim dim : {MeshDim::tensor, MeshDim::data, MeshDim::pipeline}) {
              auto& group = mesh.group(dim);
              require(group.size() == mesh.size(dim), "group size");
              require(group.rank() == mesh.coordinate(dim), "group rank is the coordinate");
              // Sum of world ranks over the group: only its members contribute.
              auto t = at::full({1}, static_cast<float>(rank));
              group.all_reduce(t, "mesh test");
              // Megatron's order, by hand: tensor peers are {0,1} and {2,3}; the other
              // dimension of size 2 pairs {0,2} and {1,3}; a dimension of size 1 is the rank alone.
              const int size = dim == MeshDim::tensor ? shape.tensor
                                                      : (dim == MeshDim::data ? shape.data : shape.pipeline);
              const float expected = dim == MeshDim::tensor ? (rank < 2 ? 0 + 1 : 2 + 3)
                                     : size == 2            ? (rank % 2 == 0 ? 0 + 2 : 1 + 3)
                                                            : static_cast<float>(rank);
              require(t.item<float>() == expected, "the all-reduce stayed inside its group");
            }
          },
          bounded());
    }
  }

  TEST_CASE("a mesh whose product differs from the world size names both numbers") {
    accel::spawn(
        3,
        [](int) {
          accel::Trainer<accel::DDP> trainer;
          try {
            accel::comm::DeviceMesh mesh(trainer.communicator(), {.data = 2, .tensor = 2});
          } catch (const std::invalid_argument& e) {
            const std::string what = e.what();
            require(what.find("= 4 ranks does not match the world size 3") != std::string::npos, what);
            trainer.wait_for_everyone();  // no rank leaves while another still connects to it
            return;
          }
          require(false, "the mesh must be refused");
        },
        bounded());
  }
}
