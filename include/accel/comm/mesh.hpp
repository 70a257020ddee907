#pragma once
// The device mesh: ranks arranged along named dimensions, each dimension
// with its own process group over the same store (for tensor, pipeline and
// hybrid-sharded data parallelism).
//
// NOTE [Mesh rank order]
// Megatron-LM's convention: tensor-parallel peers are neighbours (the
// fastest-varying coordinate, so they share a machine and its fast links),
// then data, then pipeline:
//   rank = tensor + T * (data + D * pipeline)
// The group of a dimension holds the ranks whose other coordinates are equal.

#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"

namespace accel::comm {

/// Sizes of the mesh's dimensions; their product must be the world size.
struct MeshShape {
  int pipeline = 1;
  int data = 1;
  int tensor = 1;
  int product() const { return pipeline * data * tensor; }
};

enum class MeshDim { tensor, data, pipeline };

class DeviceMesh {
 public:
  /// Builds every sub-group this rank belongs to (a collective: all ranks
  /// call it with the same shape). A shape that does not fit the world fails
  /// here, naming both numbers.
  DeviceMesh(const Communicator& world, MeshShape shape) : shape_(shape), world_(world) {
    if (shape.pipeline < 1 || shape.data < 1 || shape.tensor < 1)
      throw std::invalid_argument("accel: every mesh dimension must be at least 1");
    if (shape.product() != world.size())
      throw std::invalid_argument("accel: the mesh pipeline " + std::to_string(shape.pipeline) + " x data " +
                                  std::to_string(shape.data) + " x tensor " + std::to_string(shape.tensor) + " = " +
                                  std::to_string(shape.product()) + " ranks does not match the world size " +
                                  std::to_string(world.size()));
    const int r = world.rank();
    coordinates_ = {r % shape.tensor, (r / shape.tensor) % shape.data, r / (shape.tensor * shape.data)};
    for (MeshDim dim : {MeshDim::tensor, MeshDim::data, MeshDim::pipeline}) groups_.push_back(build(dim));
  }

  int size(MeshDim dim) const { return dim == MeshDim::tensor ? shape_.tensor : dim == MeshDim::data ? shape_.data : shape_.pipeline; }
  int coordinate(MeshDim dim) const { return coordinates_[static_cast<int>(dim)]; }
  /// The process group along `dim` (its rank is this rank's coordinate).
  Communicator& group(MeshDim dim) { return groups_[static_cast<int>(dim)]; }
  const MeshShape& shape() const { return shape_; }
  /// The whole mesh's group.
  Communicator& world() { return world_; }

  /// The world rank at the given coordinates (NOTE [Mesh rank order]).
  int rank_at(int tensor, int data, int pipeline) const {
    return tensor + shape_.tensor * (data + shape_.data * pipeline);
  }

 private:
  Communicator build(MeshDim dim) {
    std::vector<int> members;
    int c[3] = {coordinates_[0], coordinates_[1], coordinates_[2]};
    const int d = static_cast<int>(dim);
    for (int i = 0; i < size(dim); ++i) {
      c[d] = i;
      members.push_back(rank_at(c[0], c[1], c[2]));
    }
    // The group's name: the dimension and the coordinates it does not vary.
    static const char* names[] = {"tensor", "data", "pipeline"};
    std::string name = names[d];
    for (int k = 0; k < 3; ++k)
      if (k != d) {
        name += '/';  // two appends: GCC 12 warns (-Wrestrict) on "/" + std::string&& here
        name += std::to_string(coordinates_[k]);
      }
    return world_.subgroup(name, members);
  }

  MeshShape shape_;
  Communicator world_;
  std::vector<int> coordinates_;
  std::vector<Communicator> groups_;
};

}  // namespace accel::comm
